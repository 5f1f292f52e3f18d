"""The behaviour probe against the real kube-proxy v1.37 binary, iptables mode and nftables mode.

kube-proxy runs in a node namespace, fed by fake_apiserver.py (svc0 is a NodePort, 30000, with
endpoints 198.18.16.1 and .2; svc1 a ClusterIP 198.19.0.11:80 with .3 and .4). The endpoint
addresses live in one endpoint namespace behind a veth, answering on 8080. The node has its
Node-object address 198.18.0.11 and a second local address 198.18.0.12.

What the probe must see is KEP-3866's list made concrete: iptables mode serves the NodePort on
every local address and on 127.0.0.1; nftables mode (nodePortAddresses unset) only on the node IP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import behaviour_topology as bt
import pytest

from localcluster.container import run_in_netns
from proxyshift.agent.behaviour import run_behaviour
from proxyshift.api.behaviour import BehaviourMatrix, BehaviourParams, BehaviourTarget
from proxyshift.commands import run, stop_child
from tests.support.kube_proxy_runner import KubeProxy, find_kube_proxy
from tests.support.ps_netns import Netns, need_root

pytestmark = pytest.mark.dataplane

NODE_IP, SECOND = "198.18.0.11", "198.18.0.12"
POD_IP, POD_GW = "198.18.17.2", "198.18.17.1"
ENDPOINTS = [f"198.18.16.{i}" for i in range(1, 9)]  # svc0..svc3, two each


@pytest.fixture
def node_and_endpoints() -> Iterator[tuple[Netns, Netns, Netns]]:
    need_root()
    if find_kube_proxy() is None:
        pytest.skip("no kube-proxy binary (build the local cluster or set PROXYSHIFT_KUBE_PROXY)")
    node, ep, pod = Netns(), Netns(), Netns()
    listeners = None
    try:
        # A pod in the cluster CIDR (198.18.16.0/20) behind a veth, routed as a CNI would route it.
        node.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        node.run(["ip", "link", "add", "veth-pod", "type", "veth", "peer", "name", "eth0", "netns", pod.name])
        node.run(["ip", "addr", "add", f"{POD_GW}/24", "dev", "veth-pod"])
        node.run(["ip", "link", "set", "veth-pod", "up"])
        pod.run(["ip", "link", "set", "lo", "up"])
        pod.run(["ip", "addr", "add", f"{POD_IP}/24", "dev", "eth0"])
        pod.run(["ip", "link", "set", "eth0", "up"])
        for net in ("198.18.0.0/16", "198.19.0.0/16"):
            pod.run(["ip", "route", "add", net, "via", POD_GW])
        node.run(["ip", "link", "add", "veth-ep", "type", "veth", "peer", "name", "eth0", "netns", ep.name])
        node.run(["ip", "link", "set", "veth-ep", "up"])
        ep.run(["ip", "link", "set", "lo", "up"])
        ep.run(["ip", "link", "set", "eth0", "up"])
        for address in ENDPOINTS:
            ep.run(["ip", "addr", "add", f"{address}/32", "dev", "eth0"])
        ep.run(["ip", "route", "add", "198.18.0.0/24", "dev", "eth0"])
        ep.run(["ip", "route", "add", "198.18.17.0/24", "via", NODE_IP, "dev", "eth0", "onlink"])
        listeners = bt.Listeners({ep.name: "ep"})
        yield node, ep, pod
    finally:
        if listeners is not None:
            listeners.close()
        for ns in (node, ep, pod):
            ns.delete()


def matrix(node: Netns, pod_probe: str) -> BehaviourMatrix:
    params = BehaviourParams(node_ips=[NODE_IP], pod_probe=pod_probe, targets=[
        BehaviourTarget(service="ns0/svc0", kind="NodePort", port=30000, local_endpoints=ENDPOINTS[:2]),
        BehaviourTarget(service="ns1/svc1", kind="ClusterIP", port=80, address="198.19.0.11", attempts=4),
    ])
    return run_in_netns(node.name, run_behaviour, params, mode=None, runner=run)


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_the_probe_sees_what_each_mode_serves(
        node_and_endpoints: tuple[Netns, Netns, Netns], mode: str, tmp_path: Path) -> None:
    node, _, pod = node_and_endpoints
    kp = KubeProxy(node, tmp_path / "kp", mode, services=4, node_ip=NODE_IP)
    server = None
    try:
        node.run(["ip", "addr", "add", f"{SECOND}/32", "dev", "lo"])
        node.run(["ip", "route", "add", "198.18.16.0/24", "dev", "veth-ep", "src", NODE_IP])
        # Where a node's default route would send Service traffic before kube-proxy's DNAT (a
        # socket needs a route to the ClusterIP); the endpoint namespace drops what is not NATed.
        node.run(["ip", "route", "add", "198.19.0.0/16", "dev", "veth-ep", "src", NODE_IP])
        kp.wait_synced()
        server = bt.start_probe_server(pod, POD_IP, node)
        m = matrix(node, f"{POD_IP}:{bt.PROBE_PORT}")
    finally:
        if server is not None:
            stop_child(server, grace=5)
        kp.stop()
    assert m.pod_path_error is None
    pod_cells = {(c.service, c.address): c for c in m.cells if c.path == "pod"}
    print(f"\n{mode} pod path: " + "; ".join(f"{c.service} {c.address} {c.outcome} {c.endpoints}"
                                             for c in pod_cells.values()))
    assert pod_cells[("ns1/svc1", "198.19.0.11")].outcome == "answered"
    assert set(pod_cells[("ns1/svc1", "198.19.0.11")].endpoints) <= set(ENDPOINTS[2:4])
    assert pod_cells[("ns0/svc0", NODE_IP)].outcome == "answered"
    assert pod_cells[("ns0/svc0", NODE_IP)].local is True  # named by the node's conntrack
    assert pod_cells[("ns0/svc0", SECOND)].outcome == ("answered" if mode == "iptables" else "refused")
    assert ("ns0/svc0", "127.0.0.1") not in pod_cells
    got = {(c.service, c.address): c for c in m.cells if c.path == "node"}
    print(f"{mode} node path: " + "; ".join(f"{c.service} {c.address} {c.outcome} {c.endpoints}" for c in got.values())
          + f" ({m.duration_seconds:.3f} s)")
    cluster = got[("ns1/svc1", "198.19.0.11")]
    assert cluster.outcome == "answered" and set(cluster.endpoints) <= set(ENDPOINTS[2:4]) and cluster.endpoints
    assert got[("ns0/svc0", NODE_IP)].outcome == "answered"
    assert got[("ns0/svc0", NODE_IP)].local is True  # named by address, from conntrack
    expected = "answered" if mode == "iptables" else "refused"
    assert got[("ns0/svc0", SECOND)].address_role == "otherAddress"
    assert got[("ns0/svc0", SECOND)].outcome == expected, got[("ns0/svc0", SECOND)]
    assert got[("ns0/svc0", "127.0.0.1")].outcome == expected, got[("ns0/svc0", "127.0.0.1")]
