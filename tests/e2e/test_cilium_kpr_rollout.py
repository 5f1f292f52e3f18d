"""Issue 19 end to end, first part: pool blue iptables -> Cilium's kube-proxy replacement -> nftables, through
the operator, node by node, on the local cluster with Cilium installed (the real agent, confined per node).

The move to cilium-kpr labels each node for Cilium (its DaemonSet starts there), takes kube-proxy off it,
gates on Cilium's own API through the proxyshift agent's read-only socket mount, then flushes the
iptables kube-proxy left; the edit to nftables starts kube-proxy again, takes the label off (Cilium's
pod goes) and flushes what Cilium left (its CILIUM_* chains, cilium_host/cilium_net). Still to come
(issue 19's Show): the continuous probes from both pools with the failed connections counted.
A Cilium that does not replace kube-proxy (its cilium-config says kube-proxy-replacement false) fails the
gate on its own API's word, and the node goes back to its kube-proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from localcluster import cilium_install
from tests.support.cilium_cluster import cilium_installed_in
from tests.support.operator_harness import IPTABLES_MODE_CHAINS, Harness, migration, policy

pytestmark = [pytest.mark.e2e, pytest.mark.cilium]

BLUE = ["ps-node-1", "ps-node-2"]
GREEN = ["ps-node-3"]
READY_TIMEOUT = 420  # each node's Cilium compiles its datapath at its first start (13 s alone, more when loaded)


@pytest.fixture
def cilium_installed(cluster: Any) -> Iterator[None]:
    with cilium_installed_in(cluster):
        yield


def _pods_on(h: Harness, node: str, selector: str) -> list[Any]:
    pods = h.core.list_namespaced_pod("kube-system", label_selector=selector,
                                      field_selector=f"spec.nodeName={node}").items
    return [p for p in pods if p.metadata is not None and p.metadata.deletion_timestamp is None]


def _cilium_leftovers(h: Harness, node: str) -> list[str]:
    chains = sorted(c for c in h.iptables_chains(node) if c.startswith("CILIUM_"))
    links = h.node_exec(node, ["ip", "-br", "link"]).stdout.split()
    return chains + [name for name in ("cilium_host", "cilium_net") if any(w.startswith(name) for w in links)]


def test_blue_iptables_to_cilium_kpr_then_on_to_nftables(harness: Harness, cilium_installed: None) -> None:
    h = harness
    green_before = h.node_labels(GREEN[0])
    h.apply(policy("blue-kpr", "cilium-kpr", rollout={"maxUnavailable": 1},
                   gate={"timeout": "3m", "behaviour": {"allowChanges": ["SocketLoadBalancing"]}}))
    h.wait_condition("blue-kpr", "Ready", READY_TIMEOUT)
    for node in BLUE:
        assert h.node_labels(node).get(cilium_install.NODE_LABEL) == cilium_install.NODE_LABEL_VALUE
        assert _pods_on(h, node, "k8s-app=cilium"), f"no Cilium pod on {node}"
        assert not _pods_on(h, node, "k8s-app=kube-proxy"), f"kube-proxy still runs on {node}"
        leftover = h.iptables_chains(node) & set(IPTABLES_MODE_CHAINS)
        assert not leftover, f"iptables kube-proxy chains left on {node}: {sorted(leftover)}"
    assert h.proxy_mode(GREEN[0]) == "iptables" and h.node_labels(GREEN[0]) == green_before

    h.patch("blue-kpr", {"spec": {"mode": "nftables", "gate": {"behaviour": {
        "allowChanges": ["SocketLoadBalancing", "LocalhostNodePorts", "NodePortAddresses"]}}}})
    h.wait_condition("blue-kpr", "Ready", READY_TIMEOUT)
    for node in BLUE:
        assert cilium_install.NODE_LABEL not in h.node_labels(node)
        assert h.proxy_mode(node) == "nftables"
        h.wait_for(lambda n=node: not _pods_on(h, n, "k8s-app=cilium"), 120, f"Cilium's pod to leave {node}")
        assert not _cilium_leftovers(h, node), f"Cilium left on {node}: {_cilium_leftovers(h, node)}"

    h.delete("blue-kpr", wait=READY_TIMEOUT)
    for node in BLUE:
        assert h.proxy_mode(node) == "iptables"


def test_a_cilium_that_does_not_replace_kube_proxy_rolls_the_node_back(harness: Harness, cluster: Any,
                                                                       cilium_installed: None) -> None:
    h = harness
    # Healthy, but not replacing kube-proxy: what an agent that never read the revision's node config reports.
    cluster.kubectl("-n", "kube-system", "patch", "configmap", "cilium-config", "--type=merge",
                    "-p", '{"data": {"kube-proxy-replacement": "false"}}')
    h.apply(policy("blue-kpr-off", "cilium-kpr", rollout={"maxUnavailable": 1},
                   gate={"timeout": "45s", "behaviour": {"allowChanges": ["SocketLoadBalancing"]}}))
    h.wait_condition("blue-kpr-off", "Degraded", READY_TIMEOUT)  # from the moment its rollback starts
    first = BLUE[0]
    h.wait_for(lambda: migration(h.proxynodes()[first]).get("phase") in ("RolledBack", "Failed"), READY_TIMEOUT,
               f"{first} to be back on its kube-proxy")
    record = migration(h.proxynodes()[first])
    assert (record.get("phase"), record.get("reason")) == ("RolledBack", "GateTimeout"), record
    assert "replacement is 'False'" in record.get("message", ""), record
    assert cilium_install.NODE_LABEL not in h.node_labels(first)
    h.wait_for(lambda: not _pods_on(h, first, "k8s-app=cilium"), 120, f"Cilium's pod to leave {first}")
    assert _pods_on(h, first, "k8s-app=kube-proxy") and h.proxy_mode(first) == "iptables"
    assert not _cilium_leftovers(h, first), f"Cilium left on {first}: {_cilium_leftovers(h, first)}"
    assert migration(h.proxynodes()[BLUE[1]]).get("phase") in (None, "Pending", "Preflight"), "a second node moved"
    h.delete("blue-kpr-off", wait=READY_TIMEOUT)
