"""ipvs mode's pure facts (pkg/proxy/ipvs)."""

from __future__ import annotations

from proxyshift.api.kubeproxy import KPIPVSConfiguration, KubeProxyConfiguration
from proxyshift.api.policy import IPVSSettings, ProxyPolicySpec
from proxyshift.modes.base import ModeFacts, ModuleNeed, Owned, ToolNeed, overlay
from proxyshift.modes.iptables import SHARED_WITH_IPVS

IPVS_MIN_IPSET = (6, 0)
DEFAULT_IPVS_SCHEDULER = "rr"
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh", "fo", "ovf", "twos")

# The dummy interface carrying every ClusterIP/external IP.
IPVS_DUMMY_INTERFACE = "kube-ipvs0"

_IPVS_SET_BASES = (
    "LOOP-BACK", "CLUSTER-IP", "EXTERNAL-IP", "EXTERNAL-IP-LOCAL", "LOAD-BALANCER",
    "LOAD-BALANCER-FW", "LOAD-BALANCER-LOCAL", "LOAD-BALANCER-SOURCE-IP", "LOAD-BALANCER-SOURCE-CIDR",
    "NODE-PORT-TCP", "NODE-PORT-LOCAL-TCP", "NODE-PORT-UDP", "NODE-PORT-LOCAL-UDP",
    "NODE-PORT-SCTP-HASH", "NODE-PORT-LOCAL-SCTP-HASH", "NODE-PORT-SCTP", "NODE-PORT-LOCAL-SCTP",
    "HEALTH-CHECK-NODE-PORT", "IPVS-IPS",
)
# The kernel's longest ipset name (IPSET_MAXNAMELEN 32 with its NUL).
IPSET_MAX_NAME = 31


def ipv6_set_name(base: str) -> str:
    """kube-proxy's IPv6 name of a set: KUBE-6-<base>, cut to 31 characters as kube-proxy cuts it
    (v1.37 pkg/proxy/ipvs/ipset.go NewIPSet): KUBE-6-LOAD-BALANCER-SOURCE-CIDR is created as
    KUBE-6-LOAD-BALANCER-SOURCE-CID, KUBE-6-NODE-PORT-LOCAL-SCTP-HASH as KUBE-6-NODE-PORT-LOCAL-SCTP-HAS.
    kube-proxy's own ipvs cleanup destroys only the IPv4 names, so the agent's flush is what removes these."""
    return f"KUBE-6-{base}"[:IPSET_MAX_NAME]


# IPv4 sets are KUBE-<base>; dual-stack IPv6 sets are KUBE-6-<base> (cut to 31 characters).
IPVS_IPSETS = frozenset({f"KUBE-{b}" for b in _IPVS_SET_BASES} | {ipv6_set_name(b) for b in _IPVS_SET_BASES})

# Sets whose members are service addresses kube-proxy bound (ip,proto:port entries).
IPVS_ADDRESS_SETS = frozenset({
    f"KUBE-{p}{b}" for p in ("", "6-")
    for b in ("CLUSTER-IP", "EXTERNAL-IP", "EXTERNAL-IP-LOCAL", "LOAD-BALANCER", "LOAD-BALANCER-LOCAL")
})
# bitmap:port sets of NodePorts, per protocol.
IPVS_NODEPORT_SETS: dict[str, tuple[str, ...]] = {
    "tcp": ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-6-NODE-PORT-TCP",
            "KUBE-6-NODE-PORT-LOCAL-TCP"),
    "udp": ("KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP", "KUBE-6-NODE-PORT-UDP",
            "KUBE-6-NODE-PORT-LOCAL-UDP"),
}

OWNED = Owned(
    # ipvs mode still programs KUBE-* chains with iptables-restore, some of them the same as iptables mode's.
    chains=SHARED_WITH_IPVS | {
        ("nat", "KUBE-NODE-PORT"), ("nat", "KUBE-LOAD-BALANCER"),
        ("filter", "KUBE-NODE-PORT"), ("filter", "KUBE-SOURCE-RANGES-FIREWALL"), ("filter", "KUBE-IPVS-FILTER"),
        ("filter", "KUBE-IPVS-OUT-FILTER"),
    },
    interface=IPVS_DUMMY_INTERFACE,
    ipsets=IPVS_IPSETS,
)


def modules(scheduler: str | None) -> tuple[ModuleNeed, ...]:
    sched = scheduler or DEFAULT_IPVS_SCHEDULER
    return (ModuleNeed("ip_vs", "ipvs mode programs IPVS virtual servers", on_demand=True),
            ModuleNeed(f"ip_vs_{sched}", f"the IPVS scheduler {sched!r} is its own module", on_demand=True),
            ModuleNeed("nf_conntrack", "ipvs mode relies on connection tracking"))


def render_settings(config: KubeProxyConfiguration, spec: ProxyPolicySpec) -> None:
    config.ipvs = config.ipvs or KPIPVSConfiguration()
    # The scheduler is always written (default rr): an empty baseline scheduler means
    # "kube-proxy's default", which may change between releases; the revision pins it.
    overlay(config.ipvs, spec.ipvs or IPVSSettings())


FACTS = ModeFacts(
    mode="ipvs",
    # ipvs mode still programs its KUBE-* chains with iptables-restore; the addresses live in ipsets.
    tools=(ToolNeed("iptables"), ToolNeed("ipset", IPVS_MIN_IPSET)),
    owned=OWNED,
    # Its virtual servers are found by evidence (kube-ipvs0's addresses, its ipsets), not by name.
    objects=("iptables-chains", "ipvs-objects"),
    modules=modules,
    ipvs_scheduler=True,
    session_affinity="ipvs-persistence",
    prunes_unexcluded_ipvs=True,
    deprecation=("IPVS mode is deprecated since Kubernetes 1.35 and nftables is GA since 1.33: "
                 "plan a move to nftables (proxyshift plan with mode: nftables shows which nodes can)"),
    # Not held: its virtual servers live in the IPVS table, not in rules that can be renamed.
    held_as=None,
    render_settings=render_settings,
    counters="ipvs",
    opens_node_ports=True,
    drops_invalid=True,
)
