"""A user's IPVS virtual server beside the ones the real kube-proxy made in ipvs mode, and a move to nftables.

Every start of an nftables kube-proxy runs the ipvs cleanup (v1.37.2
platformCleanup), which flushes every virtual server on the host. The
inventory tells the user's apart from kube-proxy's by the flush's own evidence;
preflight for nftables refuses the node naming it, with nothing changed; with
ForeignIPVSFlush accepted it passes, names what goes, and the real nftables
kube-proxy then deletes exactly what it said.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.ipvs import parse_ipvsadm_save
from proxyshift.agent.inventory import foreign_ipvs, take_inventory
from proxyshift.agent.preflight import check
from proxyshift.api.proxynode import ForeignIPVS
from tests.support.kube_proxy_runner import KubeProxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.vm_guest

TOOLS = [IptablesTool("ipv4", "nft")]
PROC = Path("/proc")
SERVICES = 4  # fake_apiserver: ClusterIPs 198.19.0.10..13, service 0 a NodePort too
USER_VS = "-t 198.18.5.1:80"


def node_state(ns: Netns) -> dict[str, str]:
    return {"ipvs": ns.run(["ipvsadm", "-Sn"]).stdout, "ipsets": ns.run(["ipset", "save"]).stdout,
            "kube-ipvs0": ns.run(["ip", "addr", "show", "dev", "kube-ipvs0"]).stdout,
            "iptables": "\n".join(line for line in ns.save().splitlines() if not line.startswith("#"))}


def test_a_users_virtual_server_is_foreign_refused_for_nftables_and_accepted_by_name(
        netns: Netns, tmp_path: Path) -> None:
    kp = KubeProxy(netns, tmp_path / "kp-ipvs", "ipvs", services=SERVICES, conntrack_sysctls=False)
    try:
        assert kp.wait_synced(1, timeout=240)["facts"]["proxyMode"] == "ipvs"
    finally:
        kp.stop()  # its virtual servers, kube-ipvs0 and ipsets stay: a node about to leave ipvs
    # A hand-made LVS on an address of the user's own, beside kube-proxy's.
    netns.run(["ipvsadm", "-A", "-t", "198.18.5.1:80", "-s", "rr"])
    netns.run(["ipvsadm", "-a", "-t", "198.18.5.1:80", "-r", "198.18.16.9:8080", "-m"])

    inv = take_inventory(runner=netns.run, iptables_tools=TOOLS, proc_root=PROC)
    assert not inv.errors
    every = {vs.key() for vs in inv.virtual_servers}
    assert len(every) == SERVICES + 1 + 1  # the ClusterIPs, one NodePort, the user's
    assert {vs.key() for vs in inv.kube_virtual_servers} == every - {USER_VS}
    assert foreign_ipvs(inv) == ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])

    before = node_state(netns)
    refused = check("nftables", runner=netns.run, proc_root=PROC)
    assert not refused.ok
    assert [m.what for m in refused.missing] == ["IPVS virtual servers that are not kube-proxy's"], refused.message()
    assert "this node holds 1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr)" in refused.message()
    assert "every start of an nftables kube-proxy deletes them" in refused.message()
    assert node_state(netns) == before  # refused: nothing on the node changed

    accepted = check("nftables", runner=netns.run, proc_root=PROC, allow_changes=["ForeignIPVSFlush"])
    assert accepted.ok, accepted.message()
    assert accepted.message().endswith("ForeignIPVSFlush accepted: the switch deletes 1 IPVS virtual server that "
                                       "is not kube-proxy's (TCP 198.18.5.1:80 rr)")
    assert accepted.details()["foreignIPVS"] == {"count": 1, "virtualServers": ["TCP 198.18.5.1:80 rr"],
                                                 "accepted": True}
    assert node_state(netns) == before

    # What the message promises, shown: the real nftables kube-proxy's start deletes the user's virtual
    # server with kube-proxy's own.
    kp = KubeProxy(netns, tmp_path / "kp-nft", "nftables", services=SERVICES, conntrack_sysctls=False)
    try:
        assert kp.wait_synced(1, timeout=240)["facts"]["proxyMode"] == "nftables"
    finally:
        kp.stop()
    assert parse_ipvsadm_save(netns.run(["ipvsadm", "-Sn"]).stdout) == []


def test_a_move_to_ipvs_refuses_a_users_virtual_server_outside_exclude_cidrs(netns: Netns, tmp_path: Path) -> None:
    # An iptables-mode node (no kube-proxy virtual server) with a hand-made LVS: an ipvs kube-proxy deletes it at
    # its first sync unless ipvs.excludeCIDRs holds its address (v1.37.2 cleanLegacyService).
    # No real server: a fresh namespace has no route to one, and the virtual server alone is what is deleted.
    netns.run(["ipvsadm", "-A", "-t", "198.18.5.1:80", "-s", "rr"])
    before = netns.run(["ipvsadm", "-Sn"]).stdout

    refused = check("ipvs", "rr", runner=netns.run, proc_root=PROC, ipvs_exclude_cidrs=[])
    assert [m.what for m in refused.missing] == ["IPVS virtual servers that are not kube-proxy's"], refused.message()
    assert "this node holds 1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr)" in refused.message()
    assert "ipvs.excludeCIDRs" in refused.message()
    excluded = check("ipvs", "rr", runner=netns.run, proc_root=PROC, ipvs_exclude_cidrs=["198.18.5.0/24"])
    assert excluded.ok, excluded.message()
    assert netns.run(["ipvsadm", "-Sn"]).stdout == before  # preflight changed nothing

    # What the refusal promises, shown: the real ipvs kube-proxy (no excludeCIDRs) deletes it at its first sync.
    kp = KubeProxy(netns, tmp_path / "kp-ipvs", "ipvs", services=SERVICES, conntrack_sysctls=False)
    try:
        assert kp.wait_synced(1, timeout=240)["facts"]["proxyMode"] == "ipvs"
    finally:
        kp.stop()
    left = {vs.key() for vs in parse_ipvsadm_save(netns.run(["ipvsadm", "-Sn"]).stdout)}
    assert USER_VS not in left and len(left) == SERVICES + 1  # kube-proxy's own: the ClusterIPs and one NodePort
