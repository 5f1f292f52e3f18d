"""Rule sets as kube-proxy writes them, plus a user's own, for the dataplane tests and bench.

The iptables-mode text follows what kube-proxy 1.33-1.37 writes with
iptables-restore (chain names KUBE-SVC-/SEP-/EXT- + 16 base32 characters of a
sha256, the same comments, the same jump rules from the built-in chains).
Addresses: IPv4 only from 198.18.0.0/15 (ClusterIPs in 198.19.0.0/16), IPv6
only from the benchmarking prefix 2001:2::/48 (RFC 5180). Nothing is ever
assigned to an interface by these texts: they are rules only.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress

MASQ_MARK = "0x4000/0x4000"


def _hash(*parts: str) -> str:
    digest = hashlib.sha256("".join(parts).encode()).digest()
    return base64.b32encode(digest).decode()[:16]


def _cluster_ip(i: int, v6: bool) -> str:
    if v6:
        return str(ipaddress.IPv6Address("2001:2:0:1::") + i + 1)
    return str(ipaddress.IPv4Address("198.19.0.0") + 10 + i)


def _endpoint_ip(j: int, v6: bool) -> str:
    if v6:
        return str(ipaddress.IPv6Address("2001:2:0:2::") + j + 1)
    return str(ipaddress.IPv4Address("198.18.16.0") + j + 1)


def iptables_mode_rules(services: int, *, v6: bool = False, endpoints_per_service: int = 2) -> str:
    """iptables-restore input with kube-proxy's iptables-mode objects for `services` Services.

    kubelet's chains are separate (`kubelet_rules`): load both for what a real node carries.
    """
    plen = "/128" if v6 else "/32"
    pod_cidr = "2001:2:0:2::/64" if v6 else "198.18.16.0/20"
    nat_chains = ["KUBE-MARK-MASQ", "KUBE-NODEPORTS", "KUBE-POSTROUTING",
                  "KUBE-PROXY-CANARY", "KUBE-SERVICES"]
    nat_rules = [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        f"-A KUBE-MARK-MASQ -j MARK --set-xmark {MASQ_MARK}",
        f"-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK} -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" '
        "-j MASQUERADE --random-fully",
    ]
    svc_rules: list[str] = []
    filter_svc_rules: list[str] = []
    ep = 0
    for i in range(services):
        name = f"ns{i % 50}/svc{i}:http"
        cip = _cluster_ip(i, v6)
        svc = f"KUBE-SVC-{_hash(name, 'tcp')}"
        if i % 97 == 96:
            # A Service without endpoints: kube-proxy rejects in filter, no nat chains.
            reject = "icmp6-port-unreachable" if v6 else "icmp-port-unreachable"
            filter_svc_rules.append(
                f'-A KUBE-SERVICES -d {cip}{plen} -p tcp -m comment --comment "{name} has no endpoints" '
                f"-m tcp --dport 80 -j REJECT --reject-with {reject}"
            )
            continue
        nat_chains.append(svc)
        svc_rules.append(f'-A KUBE-SERVICES -d {cip}{plen} -p tcp -m comment --comment "{name} cluster IP" '
                         f"-m tcp --dport 80 -j {svc}")
        svc_rules.append(f'-A {svc} ! -s {pod_cidr} -d {cip}{plen} -p tcp -m comment --comment "{name} cluster IP" '
                         f"-m tcp --dport 80 -j KUBE-MARK-MASQ")
        for k in range(endpoints_per_service):
            epip = _endpoint_ip(ep, v6)
            ep += 1
            epaddr = f"[{epip}]:8080" if v6 else f"{epip}:8080"
            sep = f"KUBE-SEP-{_hash(name, 'tcp', epaddr)}"
            nat_chains.append(sep)
            left = endpoints_per_service - k
            stat = f" -m statistic --mode random --probability {1 / left:.11f}" if left > 1 else ""
            svc_rules.append(f'-A {svc} -m comment --comment "{name} -> {epaddr}"{stat} -j {sep}')
            svc_rules.append(f'-A {sep} -s {epip}{plen} -m comment --comment "{name}" -j KUBE-MARK-MASQ')
            svc_rules.append(f'-A {sep} -p tcp -m comment --comment "{name}" -m tcp -j DNAT '
                             f"--to-destination {epaddr}")
        if i % 4 == 0:
            ext = f"KUBE-EXT-{_hash(name, 'tcp')}"
            nat_chains.append(ext)
            svc_rules.append(f'-A KUBE-NODEPORTS -p tcp -m comment --comment "{name}" -m tcp '
                             f"--dport {30000 + i % 2768} -j {ext}")
            svc_rules.append(f'-A {ext} -m comment --comment "masquerade traffic for {name} external '
                             f'destinations" -j KUBE-MARK-MASQ')
            svc_rules.append(f"-A {ext} -j {svc}")
    svc_rules.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be '
                     'the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS')
    filter_lines = [
        "*filter",
        *(f":{c} - [0:0]" for c in ["KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
                                    "KUBE-PROXY-CANARY", "KUBE-PROXY-FIREWALL", "KUBE-SERVICES"]),
        '-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" '
        "-j KUBE-PROXY-FIREWALL",
        '-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS',
        '-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES",
        '-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" '
        "-j KUBE-PROXY-FIREWALL",
        '-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        '-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES",
        '-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" '
        "-j KUBE-PROXY-FIREWALL",
        '-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
        f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark {MASQ_MARK} -j ACCEPT',
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack '
        "--ctstate RELATED,ESTABLISHED -j ACCEPT",
        *filter_svc_rules,
        "COMMIT",
    ]
    nat_lines = ["*nat", *(f":{c} - [0:0]" for c in nat_chains), *nat_rules, *svc_rules, "COMMIT"]
    mangle_lines = ["*mangle", ":KUBE-PROXY-CANARY - [0:0]", "COMMIT"]
    return "\n".join([*mangle_lines, *filter_lines, *nat_lines]) + "\n"


def ipvs_mode_rules(*, v6: bool = False) -> str:
    """iptables-restore input with kube-proxy's ipvs-mode chains (they reference the KUBE-* ipsets)."""
    p = "KUBE-6-" if v6 else "KUBE-"
    return "\n".join([
        "*nat",
        ":KUBE-LOAD-BALANCER - [0:0]", ":KUBE-MARK-MASQ - [0:0]", ":KUBE-NODE-PORT - [0:0]",
        ":KUBE-POSTROUTING - [0:0]", ":KUBE-SERVICES - [0:0]",
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        f"-A KUBE-MARK-MASQ -j MARK --set-xmark {MASQ_MARK}",
        # Written on every sync, Services or not: it is why kube-proxy's own iptables-mode cleanup cannot
        # delete KUBE-MARK-MASQ on an ipvs node (docs/benchmarks.md, the ipvs flush section).
        "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ",
        f'-A KUBE-POSTROUTING -m comment --comment "Kubernetes endpoints dst ip:port, source ip for solving '
        f'hairpin purpose" -m set --match-set {p}LOOP-BACK dst,dst,src -j MASQUERADE',
        f"-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK} -j RETURN",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" '
        "-j MASQUERADE --random-fully",
        f'-A KUBE-NODE-PORT -p tcp -m comment --comment "Kubernetes nodeport TCP port for masquerade purpose" '
        f"-m set --match-set {p}NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
        f'-A KUBE-SERVICES -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" '
        f"-m set --match-set {p}CLUSTER-IP dst,dst -j KUBE-MARK-MASQ",
        '-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT',
        f"-A KUBE-SERVICES -m set --match-set {p}CLUSTER-IP dst,dst -j ACCEPT",
        "COMMIT",
        "*filter",
        ":KUBE-FORWARD - [0:0]", ":KUBE-IPVS-FILTER - [0:0]", ":KUBE-IPVS-OUT-FILTER - [0:0]",
        ":KUBE-NODE-PORT - [0:0]", ":KUBE-PROXY-FIREWALL - [0:0]", ":KUBE-SOURCE-RANGES-FIREWALL - [0:0]",
        '-A INPUT -m comment --comment "kubernetes health check rules" -j KUBE-NODE-PORT',
        '-A INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER',
        '-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        '-A OUTPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-OUT-FILTER',
        f"-A KUBE-IPVS-FILTER -m set --match-set {p}CLUSTER-IP dst,dst -j RETURN",
        f"-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set {p}IPVS-IPS dst -j REJECT",
        "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
        f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark {MASQ_MARK} -j ACCEPT',
        "COMMIT",
    ]) + "\n"


def ipvs_mode_ipsets(*, v6: bool = False, services: int = 5) -> str:
    """`ipset restore` input with kube-proxy's ipvs-mode sets and a few members."""
    p = "KUBE-6-" if v6 else "KUBE-"
    fam = "inet6" if v6 else "inet"
    lines = [
        f"create {p}CLUSTER-IP hash:ip,port family {fam} hashsize 1024 maxelem 65536",
        f"create {p}LOOP-BACK hash:ip,port,ip family {fam} hashsize 1024 maxelem 65536",
        f"create {p}IPVS-IPS hash:ip family {fam} hashsize 1024 maxelem 65536",
        f"create {p}NODE-PORT-TCP bitmap:port range 0-65535",
    ]
    for i in range(services):
        lines.append(f"add {p}CLUSTER-IP {_cluster_ip(i, v6)},tcp:80")
        lines.append(f"add {p}IPVS-IPS {_cluster_ip(i, v6)}")
    lines.append(f"add {p}NODE-PORT-TCP 30080")
    return "\n".join(lines) + "\n"


def nftables_mode_ruleset(services: int, *, family: str = "ip") -> str:
    """`nft -f` input shaped like kube-proxy's nftables table (maps, per-service chains)."""
    v6 = family == "ip6"
    addr_t = "ipv6_addr" if v6 else "ipv4_addr"
    lines = [
        f"add table {family} kube-proxy {{ comment \"rules for kube-proxy\" ; }}",
        f"add chain {family} kube-proxy nat-prerouting {{ type nat hook prerouting priority -100 ; }}",
        f"add chain {family} kube-proxy nat-output {{ type nat hook output priority -100 ; }}",
        f"add chain {family} kube-proxy services",
        f"add chain {family} kube-proxy mark-for-masquerade",
        f"add rule {family} kube-proxy mark-for-masquerade mark set mark or 0x4000",
        f"add map {family} kube-proxy service-ips {{ type {addr_t} . inet_proto . inet_service : verdict ; "
        "comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }",
        f"add rule {family} kube-proxy nat-prerouting jump services",
        f"add rule {family} kube-proxy nat-output jump services",
        f"add rule {family} kube-proxy services {'ip6' if v6 else 'ip'} daddr . meta l4proto . th dport "
        "vmap @service-ips",
    ]
    for i in range(services):
        chain = f"service-{_hash(str(i))[:8]}-ns{i % 50}/svc{i}/tcp/http"
        cip = _cluster_ip(i, v6)
        lines.append(f'add chain {family} kube-proxy {chain}')
        lines.append(f'add rule {family} kube-proxy {chain} {"ip6" if v6 else "ip"} daddr {cip} '
                     "jump mark-for-masquerade")
        lines.append(f'add element {family} kube-proxy service-ips {{ {cip} . tcp . 80 : goto {chain} }}')
    return "\n".join(lines) + "\n"


def user_rules(*, v6: bool = False) -> tuple[str, str]:
    """A user's own rules, split in two parts to load before and after kube-proxy's.

    They include a chain called KUBE-MYAPP (a lookalike that is not kube-proxy's),
    comments with quotes, and rules interleaved with kube-proxy's jumps in the
    built-in chains, which is what makes "byte for byte" meaningful.
    """
    net = "2001:2:0:5::/64" if v6 else "198.18.5.0/24"
    host = "2001:2:0:7::7/128" if v6 else "198.18.7.7/32"
    dnat_to = "[2001:2:0:7::8]:80" if v6 else "198.18.7.8:80"
    icmp = "ipv6-icmp" if v6 else "icmp"
    before = "\n".join([
        "*filter",
        ":USER-IN - [0:0]",
        ":KUBE-MYAPP - [0:0]",
        f'-A INPUT -s {net} -p tcp -m tcp --dport 22 -m comment --comment "user: ssh from the \\"lab\\"" -j ACCEPT',
        "-A INPUT -j USER-IN",
        "-A USER-IN -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        f"-A USER-IN -p {icmp} -j ACCEPT",
        "-A FORWARD -j KUBE-MYAPP",
        f"-A KUBE-MYAPP -d {host} -j DROP",
        "COMMIT",
        "*nat",
        ":USER-DNAT - [0:0]",
        f"-A PREROUTING -d {host} -p tcp -m tcp --dport 8080 -j USER-DNAT",
        f"-A USER-DNAT -p tcp -j DNAT --to-destination {dnat_to}",
        "COMMIT",
        "*mangle",
        ":USER-MARK - [0:0]",
        "-A PREROUTING -j USER-MARK",
        "-A USER-MARK -p udp -m udp --dport 4789 -j MARK --set-xmark 0x1/0x1",
        "COMMIT",
    ]) + "\n"
    after = "\n".join([
        "*filter",
        "-A INPUT -p tcp -m tcp --dport 9100 -j ACCEPT",
        "-A OUTPUT -m owner --uid-owner 0 -j ACCEPT",
        "COMMIT",
        "*nat",
        f"-A POSTROUTING -s {net} -o ps-uplink0 -j MASQUERADE",
        "-A OUTPUT -p tcp -m tcp --dport 15001 -j USER-DNAT",
        "COMMIT",
    ]) + "\n"
    return before, after


def kubelet_rules(*, v6: bool = False) -> str:
    """What kubelet itself keeps (must survive every flush)."""
    localnet = "::1/128" if v6 else "127.0.0.0/8"
    return "\n".join([
        "*mangle", ":KUBE-KUBELET-CANARY - [0:0]", "COMMIT",
        "*nat", ":KUBE-KUBELET-CANARY - [0:0]", "COMMIT",
        "*filter", ":KUBE-FIREWALL - [0:0]", ":KUBE-KUBELET-CANARY - [0:0]",
        "-A INPUT -j KUBE-FIREWALL", "-A OUTPUT -j KUBE-FIREWALL",
        f'-A KUBE-FIREWALL ! -s {localnet} -d {localnet} -m comment --comment "block incoming localnet '
        'connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP',
        "COMMIT",
    ]) + "\n"


def merge_restore(*texts: str) -> str:
    """One iptables-restore text equal to loading `texts` one after another with --noflush.

    iptables-nft-restore --noflush is quadratic in the number of chains (4,000
    Services take 8 s, 10,000 minutes); a plain restore of the merged text into an
    empty namespace is linear, so big benchmark node states load this way.
    """
    tables: dict[str, tuple[dict[str, str], list[str]]] = {}
    for text in texts:
        current: tuple[dict[str, str], list[str]] | None = None
        for line in text.splitlines():
            if line.startswith("*"):
                current = tables.setdefault(line[1:], ({}, []))
            elif line.startswith(":") and current is not None:
                current[0].setdefault(line[1:].split(" ", 1)[0], line)
            elif line.startswith("-A ") and current is not None:
                current[1].append(line)
    out: list[str] = []
    for name, (chains, rules) in tables.items():
        out += [f"*{name}", *chains.values(), *rules, "COMMIT"]
    return "\n".join(out) + "\n"
