"""The operator end to end on the local cluster (issue 5's Show list).

Written against the Kubernetes API; the node-level checks (/proxyMode, rules in
the kernel, traffic) use the local cluster's namespace helpers.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from tests.support.operator_harness import (
    IPTABLES_MODE_CHAINS,
    REVISION_LABEL,
    Harness,
    migration,
    policy,
    timestamp,
)
from tests.support.processes import assert_confined_as_operator

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]
GREEN = ["ps-node-3"]
READY_TIMEOUT = 420


def _assert_one_at_a_time(h: Harness, nodes: list[str]) -> None:
    """maxUnavailable 1: no node was touched (cordon, switch) before the one before it was done, while its
    preflight ran ahead, during that node's migration (rollout.preflightAhead, the default)."""
    windows = h.migration_windows(nodes)
    assert [w[0] for w in windows] and len(windows) == len(nodes), f"every node has a record: {windows}"
    records = {n: migration(pn) for n, pn in h.proxynodes().items() if n in nodes}
    for (a, _, a_end), (b, b_start, _) in itertools.pairwise(windows):
        assert b_start >= a_end, f"{b} was touched before {a} finished: {windows}"
        assert timestamp(records[b]["startedAt"]) < a_end, \
            f"{b}'s preflight did not run during {a}'s migration: {records[b]}"


def _assert_baseline_everywhere(h: Harness) -> None:
    for node in BLUE + GREEN:
        assert REVISION_LABEL not in h.node_labels(node), f"{node} still carries a revision label"
        assert h.proxy_mode(node) == "iptables"


def _service_answers_everywhere(h: Harness, tcp_probe: Any, service: Any) -> None:
    # A fresh Service is programmed before its EndpointSlice reaches kube-proxy (REJECT meanwhile).
    for node in BLUE + GREEN:
        h.wait_for(lambda n=node: tcp_probe(n, service.cluster_ip, service.port, 3).failed == 0, 60,
                   f"{service.name} to answer from {node}")


def test_the_operator_every_suite_drives_is_confined_as_its_deployment(harness: Harness) -> None:
    """The e2e, fault and soak suites run the operator as a host process (so a fault can kill -9 it), but with
    what its Deployment grants: a permission its container lacks fails those suites, not only test_in_cluster."""
    proc = harness.operator.proc
    assert proc is not None and harness.operator.running
    assert_confined_as_operator(proc.pid)


def test_blue_iptables_to_nftables_and_back(harness: Harness, test_service: Any, tcp_probe: Any,
                                            continuous_prober: Any, cluster: Any) -> None:
    h = harness
    _assert_baseline_everywhere(h)
    _service_answers_everywhere(h, tcp_probe, test_service)
    green_before = h.node_labels(GREEN[0])
    probers = {n: continuous_prober(n, test_service.cluster_ip, test_service.port) for n in (BLUE[0], GREEN[0])}

    h.apply(policy("blue-nft", "nftables", rollout={"maxUnavailable": 1, "cordon": True, "drain": True},
                   gate={"timeout": "90s", "minSyncs": 1,
                         "probeServices": [{"namespace": test_service.namespace, "name": test_service.name,
                                            "port": test_service.port}]}))
    h.wait_condition("blue-nft", "Ready", READY_TIMEOUT)
    results = {n: p.stop() for n, p in probers.items()}
    # what a person or a pipeline runs
    waited = cluster.kubectl("wait", "--for=condition=Ready", "proxypolicy/blue-nft", "--timeout=30s")
    assert "condition met" in waited.stdout

    for node in BLUE:
        assert h.proxy_mode(node) == "nftables"
        leftover = h.iptables_chains(node) & set(IPTABLES_MODE_CHAINS)
        assert not leftover, f"iptables-mode chains left on {node}: {sorted(leftover)}"
        assert "ip kube-proxy" in h.nft_tables(node)
        assert not h.unschedulable(node), f"{node} left cordoned"
    assert h.proxy_mode(GREEN[0]) == "iptables"
    assert h.node_labels(GREEN[0]) == green_before, "pool green was touched"
    _assert_one_at_a_time(h, BLUE)
    for node, result in results.items():
        print(f"traffic from {node}: {result.ok} ok, {result.failed} failed {dict(result.errors)}")
        assert result.ok > 0
    # Neither pool sees a failure: drain moved the pods off the switched node, and the agent's rule
    # hold kept the node's own connections DNATed while the new kube-proxy cleaned up the old mode's
    # rules before its first sync (docs/migration-guide.md, "The switch and its gap").
    for node, result in results.items():
        assert result.failed == 0, f"{node}: {result.failed} failed connections {dict(result.errors)}"
    for node in BLUE:
        _assert_no_hold_left(h, node)

    # back to iptables: edit the same policy (a spec change makes a new revision)
    back = continuous_prober(BLUE[0], test_service.cluster_ip, test_service.port)
    h.patch("blue-nft", {"spec": {"mode": "iptables", "gate": {"probeServices": None}}})
    h.wait_condition("blue-nft", "Ready", READY_TIMEOUT)
    result = back.stop()
    print(f"nftables -> iptables, traffic from {BLUE[0]}: {result.ok} ok, {result.failed} failed")
    assert result.ok > 0 and result.failed == 0, dict(result.errors)
    for node in BLUE:
        assert h.proxy_mode(node) == "iptables"
        assert "ip kube-proxy" not in h.nft_tables(node) and "ip6 kube-proxy" not in h.nft_tables(node)
        assert "KUBE-SERVICES" in h.iptables_chains(node)
        _assert_no_hold_left(h, node)


def _assert_no_hold_left(h: Harness, node: str) -> None:
    held = {c for c in h.iptables_chains(node) if c.startswith("PSHOLD-")}
    assert not held, f"rule hold chains left on {node}: {sorted(held)[:5]}"
    assert not any(t.endswith(" proxyshift-hold") for t in h.nft_tables(node)), h.nft_tables(node)


def test_without_cordon_and_drain_the_traffic_count_is_reported(harness: Harness, test_service: Any,
                                                                tcp_probe: Any, continuous_prober: Any) -> None:
    h = harness
    _service_answers_everywhere(h, tcp_probe, test_service)
    prober = continuous_prober(BLUE[0], test_service.cluster_ip, test_service.port)
    h.apply(policy("blue-nodrain", "nftables", rollout={"maxUnavailable": 1, "cordon": False, "drain": False}))
    h.wait_condition("blue-nodrain", "Ready", READY_TIMEOUT)
    result = prober.stop()
    print(f"without cordon/drain, traffic from {BLUE[0]}: {result.ok} ok, {result.failed} failed "
          f"{dict(result.errors)}")
    assert result.ok > 0
    assert not any(h.unschedulable(n) for n in BLUE), "nothing was cordoned"
    start, end = {n: (a, b) for n, a, b in h.migration_windows(BLUE)}[BLUE[0]]
    assert all(start - 1 <= t <= end + 1 for t, _ in prober.failures), "failures outside the switch window"


def test_ipvs_refused_by_preflight_changes_nothing(harness: Harness) -> None:
    h = harness
    labels_before = {n: h.node_labels(n) for n in BLUE}
    chains_before = {n: h.iptables_chains(n) for n in BLUE}
    h.apply(policy("blue-ipvs", "ipvs", ipvs={"scheduler": "rr"}))
    cond = h.wait_condition("blue-ipvs", "Degraded", 180)
    assert "ip_vs" in cond["message"], cond
    for node in BLUE:
        assert h.node_labels(node) == labels_before[node], f"labels of {node} changed"
        assert h.iptables_chains(node) == chains_before[node], f"rules of {node} changed"
        assert h.proxy_mode(node) == "iptables"
    migrations = {n: (pn.get("spec") or {}).get("migration") or {} for n, pn in h.proxynodes().items()}
    assert sum(m.get("phase") == "Failed" for m in migrations.values()) == 1, migrations
    assert all(m.get("phase") in (None, "Pending", "Failed") for n, m in migrations.items() if n in BLUE)


def test_gate_that_cannot_pass_rolls_back_then_retry_resumes(harness: Harness, test_service: Any,
                                                            tcp_probe: Any) -> None:
    h = harness
    # No kube-proxy syncs in a microsecond: the gate fails on the first node, which rolls back.
    h.apply(policy("blue-strict", "nftables",
                   gate={"timeout": "60s", "minSyncs": 1, "maxSyncDurationSeconds": 0.000001}))
    cond = h.wait_condition("blue-strict", "Degraded", 300)
    assert cond["reason"], cond
    first = BLUE[0]
    # Degraded comes with the rollback's start. The rollback ends once the old kube-proxy was probed after its
    # first sync: RolledBack, or here Failed (RollbackGateFailed), as the same impossible gate judges it too.
    # Only then is traffic promised, not as soon as the old kube-proxy answers /proxyMode (before its sync).
    h.wait_for(lambda: migration(h.proxynodes()[first]).get("phase") in ("RolledBack", "Failed"), 120,
               f"{first}'s rollback to end")
    assert h.proxy_mode(first) == "iptables"
    assert REVISION_LABEL not in h.node_labels(first)
    assert h.nft_tables(first).isdisjoint({"ip kube-proxy", "ip6 kube-proxy"}), "target's leftovers flushed"
    assert h.proxy_mode(BLUE[1]) == "iptables", "the rollout halted before the second node"
    probe = tcp_probe(first, test_service.cluster_ip, test_service.port, 5)
    assert probe.failed == 0, f"traffic did not recover on {first}: {probe.errors}"

    # fix the spec and ask for a retry
    h.patch("blue-strict", {"metadata": {"annotations": {"proxyshift.io/retry": "1"}},
                            "spec": {"gate": {"maxSyncDurationSeconds": None}}})
    h.wait_condition("blue-strict", "Ready", READY_TIMEOUT)
    assert all(h.proxy_mode(n) == "nftables" for n in BLUE)


def test_two_policies_on_one_node_conflict_without_flapping(harness: Harness) -> None:
    h = harness
    h.apply(policy("older-blue", "nftables"))
    time.sleep(1.5)  # creationTimestamp has a resolution of one second
    h.apply(policy("newer-blue", "iptables", rollout={"maxUnavailable": 1}))
    cond = h.wait_condition("newer-blue", "Conflict", 120)
    assert all(n in cond["message"] for n in BLUE), cond
    h.wait_condition("older-blue", "Ready", READY_TIMEOUT)
    labels = {n: h.node_labels(n).get(REVISION_LABEL) for n in BLUE}
    time.sleep(10)
    assert {n: h.node_labels(n).get(REVISION_LABEL) for n in BLUE} == labels, "labels flapped"
    owners = {n: (pn.get("spec") or {}).get("policy") for n, pn in h.proxynodes().items() if n in BLUE}
    assert set(owners.values()) == {"older-blue"}, owners


def test_stages_pause_after_the_first_node_until_unpaused(harness: Harness) -> None:
    h = harness
    h.apply(policy("blue-staged", "nftables",
                   rollout={"maxUnavailable": 1, "stages": [{"nodes": 1, "pause": "1h"}, {"percent": 100}]}))

    def one_done() -> bool:
        pns = h.proxynodes()
        return sum(((pns.get(n, {}).get("spec") or {}).get("migration") or {}).get("phase") == "Done"
                   for n in BLUE) == 1

    h.wait_for(one_done, 300, "the first stage's node to be Done")
    time.sleep(15)
    assert sum(h.proxy_mode(n) == "nftables" for n in BLUE) == 1, "the stage pause did not hold"
    # a user resumes early: pause set then cleared restarts nothing by itself; ending the stage pause
    # takes shortening it (or waiting). Here: drop the pause.
    h.patch("blue-staged", {"spec": {"rollout": {"stages": [{"nodes": 1}, {"percent": 100}]}}})
    h.wait_condition("blue-staged", "Ready", READY_TIMEOUT)
    assert all(h.proxy_mode(n) == "nftables" for n in BLUE)


def test_paused_policy_starts_no_node(harness: Harness) -> None:
    h = harness
    h.apply(policy("blue-paused", "nftables", rollout={"paused": True}))
    h.wait_condition("blue-paused", "Paused", 60)
    time.sleep(8)
    assert all(REVISION_LABEL not in h.node_labels(n) for n in BLUE)
    h.patch("blue-paused", {"spec": {"rollout": {"paused": False}}})
    h.wait_condition("blue-paused", "Ready", READY_TIMEOUT)


def test_delete_with_revert_returns_nodes_to_baseline(harness: Harness) -> None:
    h = harness
    h.apply(policy("blue-revert", "nftables", deletionPolicy="Revert"))
    h.wait_condition("blue-revert", "Ready", READY_TIMEOUT)
    h.delete("blue-revert", wait=READY_TIMEOUT)
    _assert_baseline_everywhere(h)
    for node in BLUE:
        assert h.nft_tables(node).isdisjoint({"ip kube-proxy", "ip6 kube-proxy"})
    from kubernetes import client

    # the revision objects are gone with the policy

    apps = client.AppsV1Api(h.api_client)
    leftovers = [d.metadata.name for d in apps.list_namespaced_daemon_set("kube-system").items
                 if d.metadata and (d.metadata.name or "").startswith("kube-proxy-blue-revert")]
    assert not leftovers, leftovers

    # uninstall: the baseline DaemonSet gets back exactly the affinity it had
    import subprocess
    import sys

    kubeconfig = str(h.operator.kubeconfig)
    done = subprocess.run([sys.executable, "-m", "proxyshift.cli", "restore-baseline", "--kubeconfig", kubeconfig],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    baseline = apps.read_namespaced_daemon_set("kube-proxy", "kube-system")
    assert baseline.spec is not None and baseline.spec.template.spec is not None and baseline.metadata is not None
    assert baseline.spec.template.spec.affinity is None, baseline.spec.template.spec.affinity
    assert "proxyshift.io/baseline-affinity-undo" not in (baseline.metadata.annotations or {})
    h.wait_for(lambda: all(h.kube_proxy_running(n) for n in BLUE + GREEN), 120, "baseline kube-proxy everywhere")


def test_a_drain_blocked_by_a_disruption_budget_times_out_and_leaves_the_node_untouched(harness: Harness) -> None:
    h = harness
    core = h.core
    from kubernetes import client

    policy_api = client.PolicyV1Api(h.api_client)
    guard = {"app": "ps-drain-guard"}
    # The client sends a dict body as it is.
    core.create_namespaced_pod("default", {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ps-drain-guard", "labels": guard},
        "spec": {"nodeName": BLUE[0], "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}]}})
    policy_api.create_namespaced_pod_disruption_budget("default", {  # type: ignore[arg-type]  # a dict body
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "ps-drain-guard"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": guard}}})
    try:
        # A read Pod and PDB have a status: the API server sets it on create.
        h.wait_for(lambda: core.read_namespaced_pod("ps-drain-guard", "default").status.phase == "Running",  # type: ignore[union-attr]
                   60,
                   "the guarded pod to run")
        h.wait_for(lambda: (policy_api.read_namespaced_pod_disruption_budget("ps-drain-guard", "default")
                            .status.observed_generation or 0) >= 1,  # type: ignore[union-attr]  # as above
                   60, "the disruption controller to see the PDB")
        labels_before = h.node_labels(BLUE[0])
        h.apply(policy("blue-guarded", "nftables", pool=None,
                       nodeSelector={"matchLabels": {"kubernetes.io/hostname": BLUE[0]}},
                       rollout={"cordon": True, "drain": True, "drainTimeout": "20s"}))
        degraded = h.wait_condition("blue-guarded", "Degraded", 180)
        migration = (h.proxynodes()[BLUE[0]].get("spec") or {}).get("migration") or {}
        assert migration.get("phase") == "Failed" and migration.get("reason") == "DrainTimeout", migration
        assert "DrainTimeout" in degraded["message"] or "DrainTimeout" in degraded.get("reason", ""), degraded
        # Untouched: uncordoned again, same labels, same kube-proxy, and the guarded pod still there.
        assert not h.unschedulable(BLUE[0])
        assert h.node_labels(BLUE[0]) == labels_before
        assert h.proxy_mode(BLUE[0]) == "iptables"
        guarded = core.read_namespaced_pod("ps-drain-guard", "default").metadata
        assert guarded is not None and guarded.deletion_timestamp is None
        events = core.list_namespaced_event("default", field_selector=f"involvedObject.name={BLUE[0]}").items
        said = [e.message or "" for e in events if e.reason == "DrainBlocked"]
        # Told once (the rollout retried every few seconds for 20 s), naming the pod the budget guards.
        assert len(said) == 1 and "default/ps-drain-guard" in said[0], [(e.reason, e.message) for e in events]
    finally:
        policy_api.delete_namespaced_pod_disruption_budget("ps-drain-guard", "default")
        core.delete_namespaced_pod("ps-drain-guard", "default", grace_period_seconds=0)


# kill -9 of the operator at each node step: tests/reliability/test_faults.py (operator-kill), which
# fires it at all seven steps of one migration, beside the other faults.
