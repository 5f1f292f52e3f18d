"""Issue 13's Show list on the local cluster: the behaviour gate over the whole matrix.

The workloads (behaviour_workloads: every Service kind, endpoints that answer with their name, a pod
namespace and a second address on every node) are looked at twice: by the product (the agent's matrix
before and after the switch, judged by the operator's gate) and from outside it (behaviour_observe,
the test bed's own dialler and its oracle of what kube-proxy answers in each mode).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from behaviour_observe import Cell, expected_problems, observe, table

from localcluster.behaviour_workloads import BehaviourWorkloads
from tests.support.operator_harness import REVISION_LABEL, Harness, migration, policy

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]
GREEN = ["ps-node-3"]
SETTLE_SECONDS = 60.0
READY_TIMEOUT = 420
PROBE_NAMESPACE = "proxyshift-system"
PROBE_LABEL = "app.kubernetes.io/name=proxyshift-probe"
NODE_PORT_CHANGES = ("LocalhostNodePorts", "NodePortAddresses")


def settled(made: BehaviourWorkloads, modes: dict[str, str]) -> list[Cell]:
    """The outside view once every node answers as kube-proxy in its mode should (within a minute)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        cells = observe(made)
        problems = [p for node, mode in modes.items()
                    for p in expected_problems(made, [c for c in cells if c.node == node], mode)]  # type: ignore[arg-type]  # modes: the policies' ProxyMode names
        if not problems:
            return cells
        if time.monotonic() > deadline:
            pytest.fail("the matrix does not settle:\n" + "\n".join(problems[:20]) + "\n" + table(cells))
        time.sleep(1.0)


@pytest.fixture
def probe_pods_ready(kube: Any, wait_for: Any) -> None:
    """The pod path needs the probe server on every blue node, Ready, before the preflight's matrix."""
    def ready() -> bool:
        pods = kube.get(f"/api/v1/namespaces/{PROBE_NAMESPACE}/pods", labelSelector=PROBE_LABEL)["items"]
        on = {p["spec"].get("nodeName") for p in pods
              if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])}
        return set(BLUE) <= on
    wait_for(ready, 120, "the proxyshift-probe pods to be Ready on the blue nodes")


def _cells(pn: dict[str, Any], which: str) -> list[dict[str, Any]]:
    return (((pn.get("status") or {}).get("behaviour") or {}).get(which) or {}).get("cells") or []


def _outcome(cells: list[dict[str, Any]], service: str, address: str, path: str = "node") -> str | None:
    for cell in cells:
        if cell["service"].endswith(f"/{service}") and cell["address"] == address and cell["path"] == path:
            return cell["outcome"]
    return None


def _wait_back_on_baseline(h: Harness, name: str) -> None:
    h.delete(name)

    def gone() -> bool:
        return h.get(name) is None

    deadline = time.monotonic() + 300
    while not gone():
        if time.monotonic() > deadline:
            records = {n: migration(pn) for n, pn in h.proxynodes().items()}
            pytest.fail(f"the Revert of {name} did not finish: {records}\n{h.describe(name)}")
        time.sleep(1.0)
    for node in BLUE:
        h.wait_for(lambda n=node: REVISION_LABEL not in h.node_labels(n) and h.proxy_mode(n) == "iptables", 120,
                   f"{node} back on the baseline")


def test_a_default_policy_stops_on_the_nodeport_changes_then_passes_when_they_are_allowed(
        harness: Harness, made: BehaviourWorkloads, probe_pods_ready: None) -> None:
    h = harness
    everyone_iptables = {n: "iptables" for n in BLUE + GREEN}
    before = settled(made, everyone_iptables)
    print("\n" + table(before))
    name = "blue-behaviour"
    h.apply(policy(name, "nftables", rollout={"maxUnavailable": 1}, gate={"timeout": "120s"}))

    told = h.wait_for(lambda: (c := h.condition(name, "BehaviourChanges")) and c["status"] == "True" and c, 60,
                      "the compatibility report on the policy")
    assert "LocalhostNodePorts" in told["message"] and "ps-behaviour/nodeport-tcp" in told["message"], told

    def rolled_back() -> dict[str, dict[str, Any]] | None:
        found = h.proxynodes()
        return found if any(migration(found[n]).get("phase") in ("RolledBack", "Failed") for n in BLUE) else None

    pns = h.wait_for(rolled_back, 300, "a blue node to end its migration rolled back")
    # The policy's status follows the node's record within a plan or two.
    degraded = h.wait_for(lambda: (c := h.condition(name, "Degraded")) and c["reason"] == "NodeRolledBack" and c,
                          60, "the policy to say the node was rolled back")
    assert degraded["status"] == "True" and "BehaviourChanged" in degraded["message"], degraded
    failed = [n for n in BLUE if migration(pns[n]).get("reason") == "BehaviourChanged"]
    assert len(failed) == 1, {n: migration(pns[n]) for n in BLUE}
    node = failed[0]
    record = migration(pns[node])
    print(f"\n{node}: {record.get('phase')} {record.get('reason')}: {record.get('message')}")
    assert record["phase"] == "RolledBack"
    assert any(change in record["message"] for change in NODE_PORT_CHANGES), record["message"]
    assert "refused" in record["message"] and "nftables" in record["message"]
    # The agent's own matrices say what changed: localhost and the second address, nothing else.
    here = made.node(node)
    was, now = _cells(pns[node], "before"), _cells(pns[node], "after")
    assert _outcome(was, "nodeport-tcp", "127.0.0.1") == "answered"
    assert _outcome(now, "nodeport-tcp", "127.0.0.1") == "refused"
    assert _outcome(now, "nodeport-tcp", here.ip) == "answered"
    assert {c["path"] for c in was} == {"node", "pod"}, "both paths were probed before the switch"
    # Rolled back: the node runs iptables again, the other blue node never started, and from outside
    # every cell answers as it did before the policy.
    assert h.proxy_mode(node) == "iptables" and REVISION_LABEL not in h.node_labels(node)
    other = next(n for n in BLUE if n != node)
    assert REVISION_LABEL not in h.node_labels(other), "the rollout went on past a failed node"
    after_rollback = settled(made, everyone_iptables)
    assert [c.outcome for c in after_rollback] == [c.outcome for c in before]

    h.patch(name, {"spec": {"gate": {"timeout": "120s",
                                     "behaviour": {"allowChanges": list(NODE_PORT_CHANGES)}}}})
    h.wait_condition(name, "Ready", READY_TIMEOUT)
    # The report still tells what is not allowed (no NodePort firewall openings, INVALID not dropped),
    # and no longer the two changes the policy now accepts.
    report = h.condition(name, "BehaviourChanges")
    assert report is not None
    assert not any(f"{change} (" in report["message"] for change in NODE_PORT_CHANGES), report
    for n in BLUE:
        assert h.proxy_mode(n) == "nftables"
    # Every other cell of the matrix is unchanged: the nftables oracle differs from the iptables one
    # exactly on NodePorts off the primary IP.
    settled(made, {BLUE[0]: "nftables", BLUE[1]: "nftables", GREEN[0]: "iptables"})
    _wait_back_on_baseline(h, name)


def test_node_port_addresses_in_the_policy_keep_the_second_address(
        harness: Harness, made: BehaviourWorkloads, probe_pods_ready: None, cluster: Any, tmp_path: Path) -> None:
    h = harness
    settled(made, {n: "iptables" for n in BLUE + GREEN})
    plain = policy("blue-addresses", "nftables", gate={"timeout": "120s"})
    manifest = tmp_path / "policy.yaml"
    manifest.write_text(yaml.safe_dump(plain))
    shown = subprocess.run([sys.executable, "-m", "proxyshift.cli", "plan", "-f", str(manifest),
                            "--kubeconfig", str(cluster.kubeconfig)], capture_output=True, text=True, timeout=120,
                           check=False)
    print(shown.stdout)
    assert shown.returncode == 0, shown.stderr
    assert "NodePortAddresses" in shown.stdout and "ps-behaviour/nodeport-tcp" in shown.stdout
    assert "nodePortAddresses" in shown.stdout  # the setting that keeps today's behaviour

    # Every local address of these nodes is in 198.18.0.0/15; localhost is accepted as a change.
    kept = policy("blue-addresses", "nftables", gate={"timeout": "120s",
                                                      "behaviour": {"allowChanges": ["LocalhostNodePorts"]}},
                  nodePortAddresses=["198.18.0.0/15"])
    h.apply(kept)
    h.wait_condition("blue-addresses", "Ready", READY_TIMEOUT)
    pns = h.proxynodes()
    for n in BLUE:
        here = made.node(n)
        assert h.proxy_mode(n) == "nftables"
        assert _outcome(_cells(pns[n], "after"), "nodeport-tcp", here.second_address) == "answered"
        assert _outcome(_cells(pns[n], "after"), "nodeport-tcp", "127.0.0.1") == "refused"

    # Each node recorded its traffic distribution before and after its move, and status shows it.
    def recorded() -> bool:
        found = h.proxynodes()
        return all(((found[n].get("status") or {}).get("distribution") or {}).get(side) for n in BLUE
                   for side in ("before", "after"))

    h.wait_for(recorded, 60, "both blue nodes' distribution before and after the move")
    shown = subprocess.run([sys.executable, "-m", "proxyshift.cli", "status", "blue-addresses",
                            "--kubeconfig", str(cluster.kubeconfig)], capture_output=True, text=True, timeout=120,
                           check=False)
    print(shown.stdout)
    assert shown.returncode == 0, shown.stderr
    assert "traffic distribution before -> after the move:" in shown.stdout
    assert "ps-behaviour/clusterip-tcp on ps-node-1: before " in shown.stdout
    _wait_back_on_baseline(h, "blue-addresses")
