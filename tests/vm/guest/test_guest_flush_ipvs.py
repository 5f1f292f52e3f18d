"""The ipvs flush on a node state the real kube-proxy wrote, beside a user's own IPVS objects.

kube-proxy's own ipvs cleanup flushes every virtual server on the host; the
agent's flush must remove exactly kube-proxy's: its virtual servers,
kube-ipvs0, its KUBE-* ipsets and its chains, and leave a user's virtual and
real servers, sets (even one called KUBE-ALLOWED), a user's dummy interface
and its addresses byte for byte as `ipvsadm -Sn`, `ipset save` and `ip addr`
show them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.ipvs import parse_ipvsadm_save
from tests.support.kp_rules import kubelet_rules
from tests.support.kube_proxy_runner import KubeProxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.vm_guest

TOOLS = [IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")]
PROC = Path("/proc")
# A user's own load balancing: a weighted TCP service with two real servers, a persistent UDP one,
# a firewall-mark service, and a service on the node's own address on a port kube-proxy does not use.
USER_IPVS = """\
-A -t 198.18.200.1:80 -s wlc
-a -t 198.18.200.1:80 -r 198.18.16.200:8080 -m -w 3
-a -t 198.18.200.1:80 -r 198.18.16.201:8080 -m -w 1
-A -u 198.18.200.1:53 -s rr -p 600
-a -u 198.18.200.1:53 -r 198.18.16.202:53 -m -w 1
-A -f 7 -s sh
-a -f 7 -r 198.18.16.203:0 -m -w 1
-A -t 198.18.0.11:31999 -s rr
-a -t 198.18.0.11:31999 -r 198.18.16.204:8080 -m -w 1
"""
USER_SETS = """\
create KUBE-ALLOWED hash:ip family inet hashsize 1024 maxelem 65536
add KUBE-ALLOWED 198.18.5.5
create user-nets hash:net family inet hashsize 1024 maxelem 65536
add user-nets 198.18.6.0/24
"""
USER_RULES = """\
*filter
:USER-IN - [0:0]
-A INPUT -j USER-IN
-A USER-IN -m set --match-set user-nets src -j DROP
-A USER-IN -m set --match-set KUBE-ALLOWED src -j ACCEPT
COMMIT
"""
SHARED_CHAINS = ("*nat :KUBE-SERVICES", "*nat :KUBE-POSTROUTING", "*nat :KUBE-MARK-MASQ", "*filter :KUBE-FORWARD")


def add_user_objects(ns: Netns) -> None:
    ns.run(["ip", "link", "add", "user0", "type", "dummy"])
    ns.run(["ip", "addr", "add", "198.18.200.1/32", "dev", "user0"])
    ns.run(["ip", "addr", "add", "198.18.201.1/24", "dev", "user0"])
    ns.run(["ip", "link", "set", "user0", "up"])
    ns.run(["ipvsadm", "-R"], input=USER_IPVS)
    ns.run(["ipset", "restore"], input=USER_SETS)
    ns.restore(USER_RULES)


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def chains(save: str) -> set[str]:
    """'*table :CHAIN' for every chain in an iptables-save text."""
    table, found = "", set()
    for line in save.splitlines():
        if line.startswith("*"):
            table = line
        elif line.startswith(":"):
            found.add(f"{table} {line.split()[0]}")
    return found


def rules(save: str, table: str, chain: str) -> list[str]:
    """The -A lines of one chain of one table."""
    current, out = "", []
    for line in save.splitlines():
        if line.startswith("*"):
            current = line[1:]
        elif current == table and line.startswith(f"-A {chain} "):
            out.append(line)
    return out


USER_SERVICES = {"-t 198.18.200.1:80", "-u 198.18.200.1:53", "-f 7", "-t 198.18.0.11:31999"}


def user_part_of_ipvs(saved: str) -> str:
    """The user's virtual servers and their real servers in an `ipvsadm -Sn` text, as ipvsadm prints them."""
    keep, out = False, []
    for line in saved.splitlines():
        if line.startswith("-A"):
            keep = line.removeprefix("-A ").split(" -s ", 1)[0] in USER_SERVICES
        if keep:
            out.append(line)
    return "".join(f"{line}\n" for line in out)


def user_part_of_ipsets(saved: str) -> str:
    return "".join(f"{line}\n" for line in saved.splitlines()
                   if len(line.split()) > 1 and line.split()[1] in {"KUBE-ALLOWED", "user-nets"})


def user_view(ns: Netns) -> dict[str, str]:
    return {"ipvs": ns.run(["ipvsadm", "-Sn"]).stdout, "ipsets": ns.run(["ipset", "save"]).stdout,
            "user0": ns.run(["ip", "addr", "show", "dev", "user0"]).stdout}


def run_kube_proxy(ns: Netns, workdir: Path, mode: str, services: int = 6) -> None:
    kp = KubeProxy(ns, workdir, mode, services=services, conntrack_sysctls=False)
    try:
        assert kp.wait_synced(1, timeout=240)["facts"]["proxyMode"] == mode
    finally:
        kp.stop()


@pytest.mark.parametrize("target", ["nftables", "iptables"])
def test_flush_of_a_real_ipvs_node_removes_exactly_kube_proxys_objects(
        netns: Netns, tmp_path: Path, target: str) -> None:
    netns.restore(kubelet_rules())
    kubelet_only = netns.save()
    run_kube_proxy(netns, tmp_path / "kp", "ipvs")
    # The user's objects join the state kube-proxy left behind, after it stopped: whether a running
    # ipvs kube-proxy deletes virtual servers it does not know (outside ipvs.excludeCIDRs) is not
    # what this test is about, and was not checked here.
    add_user_objects(netns)
    reference = user_view(netns)  # kube-proxy's objects and the user's, side by side
    kube_vs = [vs for vs in parse_ipvsadm_save(reference["ipvs"]) if vs.service_arg not in USER_SERVICES]
    assert len(kube_vs) == 6 + 2  # six ClusterIPs and two NodePorts (services 0 and 4)
    assert user_part_of_ipvs(reference["ipvs"]).count("-A ") == 4

    remove = ["iptables", "ipvs"] if target == "nftables" else ["ipvs"]
    report = flush(remove, target, runner=netns.run, iptables_tools=TOOLS, proc_root=PROC)

    assert report.ok, report.message()
    ipvs_step = next(s for s in report.steps if s.tool == "ipvs")
    assert ipvs_step.removed["virtual servers"] == len(kube_vs)
    assert ipvs_step.removed["interfaces"] == 1
    after = user_view(netns)
    assert after["ipvs"] == user_part_of_ipvs(reference["ipvs"])
    assert after["ipsets"] == user_part_of_ipsets(reference["ipsets"])
    assert after["user0"] == reference["user0"]
    assert "kube-ipvs0" not in netns.run(["ip", "-o", "link", "show"]).stdout
    save = netns.save()
    for line in body(USER_RULES):
        if line.startswith("-A"):
            assert line in save
    kube_chains = {c for c in chains(save) if ":KUBE-" in c} - {"*filter :KUBE-FIREWALL",
                                                                "*filter :KUBE-KUBELET-CANARY",
                                                                "*nat :KUBE-KUBELET-CANARY",
                                                                "*mangle :KUBE-KUBELET-CANARY"}
    if target == "nftables":
        # Nothing of kube-proxy's is left: the IPv4 tables are as they were before it ran, plus the user's.
        assert kube_chains == set()
        # The IPv4 tables are kubelet's plus the user's rules, nothing else.
        assert [line for line in body(save) if "USER" not in line] == \
            [line for line in body(kubelet_only) if "USER" not in line]
    else:
        # iptables mode uses these chains too: they stay for the iptables kube-proxy now running.
        assert kube_chains <= set(SHARED_CHAINS) | {"*filter :KUBE-PROXY-FIREWALL", "*filter :KUBE-NODEPORTS",
                                                    "*filter :KUBE-SERVICES", "*filter :KUBE-EXTERNAL-SERVICES",
                                                    "*nat :KUBE-NODEPORTS", "*nat :KUBE-PROXY-CANARY",
                                                    "*filter :KUBE-PROXY-CANARY", "*mangle :KUBE-PROXY-CANARY"}
        assert {"*nat :KUBE-NODE-PORT", "*filter :KUBE-IPVS-FILTER", "*nat :KUBE-LOAD-BALANCER"} & kube_chains \
            == set()

    again = flush(remove, target, runner=netns.run, iptables_tools=TOOLS, proc_root=PROC)
    assert again.ok and again.total_removed() == 0, again.message()
    assert user_view(netns) == after and body(netns.save()) == body(save)


def test_flush_for_ipvs_from_iptables_keeps_the_chains_both_modes_share(netns: Netns, tmp_path: Path) -> None:
    # An iptables kube-proxy ran, then the ipvs one on the same node (iptables <-> ipvs cleans nothing).
    run_kube_proxy(netns, tmp_path / "kp-iptables", "iptables")
    run_kube_proxy(netns, tmp_path / "kp-ipvs", "ipvs")
    add_user_objects(netns)
    saved = netns.save()
    assert any(line.startswith(":KUBE-SVC-") for line in saved.splitlines())
    ipvs_before = user_view(netns)
    kube_ipvs0 = netns.run(["ip", "addr", "show", "dev", "kube-ipvs0"]).stdout
    shared_before = {c: rules(saved, c.split()[0][1:], c.split(":")[1]) for c in SHARED_CHAINS}

    report = flush(["iptables"], "ipvs", runner=netns.run, iptables_tools=TOOLS, proc_root=PROC)

    assert report.ok, report.message()
    after = netns.save()
    assert not any(line.startswith((":KUBE-SVC-", ":KUBE-SEP-", ":KUBE-EXT-")) for line in after.splitlines())
    assert set(SHARED_CHAINS) <= chains(after)
    # Their rules are the ipvs kube-proxy's (ipset matches), untouched.
    for chain, lines in shared_before.items():
        assert rules(after, chain.split()[0][1:], chain.split(":")[1]) == lines, chain
    assert any("--match-set KUBE-CLUSTER-IP" in line for line in shared_before["*nat :KUBE-SERVICES"])
    # IPVS itself is the target's: every virtual server, set and address stays.
    assert user_view(netns) == ipvs_before
    assert netns.run(["ip", "addr", "show", "dev", "kube-ipvs0"]).stdout == kube_ipvs0
