"""The real kube-proxy v1.37.2 in ipvs mode, per scheduler, on the guest's kernel; the agent's inventory of it
(virtual servers, kube-ipvs0's addresses, KUBE-* ipsets).

The host cannot run this (no IPVS there: test_agent_real_kube_proxy.py shows
kube-proxy refusing ipvs exactly when preflight does); here it runs.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.ipvs import parse_ipset_save, parse_ipvsadm_save
from proxyshift.agent.inventory import leftovers, take_inventory
from tests.support.kube_proxy_runner import KubeProxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.vm_guest

SERVICES = 8  # fake_apiserver: ClusterIPs 198.19.0.10.., every 4th a NodePort 30000+i, 2 endpoints each
NODE_IP = "198.18.0.11"
TOOLS = [IptablesTool("ipv4", "nft")]
CLUSTER_IPS = {str(ipaddress.IPv4Address("198.19.0.10") + i) for i in range(SERVICES)}
NODE_PORTS = {30000 + i for i in range(SERVICES) if i % 4 == 0}


@pytest.mark.parametrize("scheduler", ["rr", "wrr", "lc", "sh", "mh"])
def test_real_kube_proxy_programs_ipvs_and_the_inventory_reports_it(
        netns: Netns, tmp_path: Path, scheduler: str) -> None:
    kp = KubeProxy(netns, tmp_path / "kp", "ipvs", services=SERVICES, scheduler=scheduler, conntrack_sysctls=False)
    try:
        answer = kp.wait_synced(1, timeout=240)
    finally:
        kp.stop()  # its objects stay in the kernel: what a node looks like after a switch away from ipvs
    assert answer["facts"]["proxyMode"] == "ipvs" and answer["facts"]["healthzStatus"] == 200

    saved = netns.run(["ipvsadm", "-Sn"]).stdout
    services = parse_ipvsadm_save(saved)
    cluster = {vs.address for vs in services if vs.port == 80}
    assert cluster == CLUSTER_IPS
    assert {vs.port for vs in services if vs.address == NODE_IP} == NODE_PORTS
    schedulers = {line.split(" -s ", 1)[1].split()[0] for line in saved.splitlines() if line.startswith("-A")}
    assert schedulers == {scheduler}
    real = [line for line in saved.splitlines() if line.startswith("-a -t 198.19.0.10:80 ")]
    assert sorted(line.split()[4] for line in real) == ["198.18.16.1:8080", "198.18.16.2:8080"]

    addrs = json.loads(netns.run(["ip", "-j", "addr", "show", "dev", "kube-ipvs0"]).stdout)
    bound = {a["local"] for link in addrs for a in link["addr_info"]}
    assert bound >= CLUSTER_IPS

    sets = parse_ipset_save(netns.run(["ipset", "save"]).stdout)
    assert {"KUBE-CLUSTER-IP", "KUBE-LOOP-BACK", "KUBE-NODE-PORT-TCP"} <= set(sets.names)
    assert sets.service_addresses >= CLUSTER_IPS and sets.nodeports["tcp"] == NODE_PORTS

    inv = take_inventory(runner=netns.run, iptables_tools=TOOLS, proc_root=Path("/proc"))
    assert inv.ipvs_available and inv.dummy_interface and not inv.errors
    assert {vs.key() for vs in inv.kube_virtual_servers} == {vs.key() for vs in services}
    assert inv.foreign_virtual_servers == []  # every one of them is kube-proxy's: nothing to refuse for nftables
    assert set(sets.names) <= set(inv.ipsets)
    # kube-ipvs0's addresses as the inventory reads them: exactly what ip shows, every ClusterIP among them,
    # and counted with the ipvs objects the status reports.
    assert inv.dummy_addresses == sorted(bound, key=ipaddress.ip_address) and inv.dummy_address_count == len(bound)
    assert set(inv.dummy_addresses) >= CLUSTER_IPS
    assert f"kube-ipvs0 with {len(bound)} addresses" in inv.summary("ipvs")
    assert "ipvs" in leftovers(inv, "nftables") and "ipvs" not in leftovers(inv, "ipvs")
