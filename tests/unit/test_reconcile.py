"""The reconcile step (controller/reconcile.py) against an in-memory cluster (fake_cluster.py): what it
writes for a given ProxyPolicy and ProxyNodes, and that it waits for its own writes to come back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_cluster import FakeCluster, policy
from kubernetes.client.exceptions import ApiException

from proxyshift.controller.fleet import NODES, PROXYNODE_MIRROR
from proxyshift.controller.reconcile import Indexes, step
from proxyshift.controller.wakeups import Wakers
from proxyshift.render import render_revision

pytestmark = pytest.mark.unit


def blue_and_green(**spec: Any) -> FakeCluster:
    cluster = FakeCluster()
    cluster.add_node("blue-1", {"pool": "blue"})
    cluster.add_node("blue-2", {"pool": "blue"})
    cluster.add_node("green-1", {"pool": "green"})
    cluster.add_policy(policy(**spec))
    return cluster


def phase(cluster: FakeCluster, node: str) -> str | None:
    return (cluster.proxynodes[node]["spec"].get("migration") or {}).get("phase")


async def steps(cluster: FakeCluster, n: int, *, agents: bool = False) -> list[list[str]]:
    """n steps of policy blue; with agents, the nodes' side answers between them. The calls of each step."""
    runtime = cluster.runtime or cluster.runtime_for_test()
    calls: list[list[str]] = []
    for _ in range(n):
        start = len(cluster.calls)
        await step(runtime, "blue", cluster.indexes())
        calls.append(cluster.calls[start:])
        if agents:
            for node in cluster.nodes:
                cluster.kubelet(node)
                cluster.agent(node)
            await asyncio.sleep(0.05)  # the echoes are delivered on the event loop
    return calls


def test_a_new_policy_first_gets_its_revision_then_one_node_starts_preflight() -> None:
    cluster = blue_and_green(rollout={"maxUnavailable": 1})
    revision = render_revision(cluster.index_policies["blue"][0], cluster.configmaps["kube-proxy"],
                               cluster.daemonsets["kube-proxy"])

    first, second = asyncio.run(steps(cluster, 2))

    # Step 1: one node (maxUnavailable 1) of the selected pool is asked for its preflight (its ProxyNode made
    # with it; green is not touched) beside the revision's ConfigMap and DaemonSet (nftables), the baseline
    # kept off revision nodes. A preflight only reads the node: no node moves before its revision exists.
    ds_name = revision.daemonset["metadata"]["name"]
    assert first == ["ensure_proxynode blue-1", "json_patch_daemonset kube-proxy", f"apply_configmap {ds_name}",
                     f"apply_daemonset {ds_name}", "patch_policy_status blue"]
    assert cluster.daemonsets[ds_name]["metadata"]["annotations"]["proxyshift.io/mode"] == "nftables"
    assert "proxyshift.io/baseline-affinity-undo" in cluster.daemonsets["kube-proxy"]["metadata"]["annotations"]
    # Step 2: the revision exists and nothing it is rendered from moved: it is not applied again
    # (revision_keeper.py); the preflight has no answer yet.
    assert second == ["patch_policy_status blue"]
    assert cluster.writes == [ds_name, ds_name]  # the ConfigMap and the DaemonSet, once each
    spec = cluster.proxynodes["blue-1"]["spec"]
    assert (spec["policy"], spec["revision"], spec["mode"]) == ("blue", revision.name, "nftables")
    assert spec["operation"]["type"] == "Preflight" and spec["operation"]["params"]["mode"] == "nftables"
    assert spec["migration"]["fromMode"] == "iptables" and spec["migration"]["toMode"] == "nftables"
    assert cluster.proxynodes["blue-2"]["spec"] == {} and cluster.proxynodes["green-1"]["spec"] == {}
    status = cluster.policy_status["blue"]
    assert status["phase"] == "Progressing"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Progressing"] == "True"
    assert [e["reason"] for e in cluster.events if e["kind"] == "Node"] == ["MigrationStarted"]


def test_a_step_returns_only_once_its_writes_are_back_in_the_mirrors() -> None:
    cluster = blue_and_green()
    cluster.echo_delay = 0.3  # a slow watch: the write's echo arrives well after the call returned

    async def run() -> tuple[str, str]:
        await steps(cluster, 2)
        assert cluster.runtime is not None
        mirrors = cluster.runtime.fleet.mirrors
        return (mirrors[PROXYNODE_MIRROR].items["blue-1"].metadata["resourceVersion"],
                mirrors[NODES].items["blue-1"][0].resource_version)

    seen_proxynode, _ = asyncio.run(run())
    # The planner must never plan on a world without its own last write (a stale view re-issues a switch).
    assert seen_proxynode == cluster.proxynodes["blue-1"]["metadata"]["resourceVersion"]


def test_a_node_walks_the_whole_migration_with_answering_agents() -> None:
    cluster = blue_and_green(rollout={"maxUnavailable": 2})

    asyncio.run(steps(cluster, 12, agents=True))

    revision = cluster.proxynodes["blue-1"]["spec"]["revision"]
    for node in ("blue-1", "blue-2"):
        assert phase(cluster, node) == "Done"
        assert cluster.nodes[node]["metadata"]["labels"]["proxyshift.io/revision"] == revision
        assert cluster.proxynodes[node]["status"]["observedMode"] == "nftables"
    assert "proxyshift.io/revision" not in cluster.nodes["green-1"]["metadata"]["labels"]
    assert cluster.policy_status["blue"]["phase"] == "Ready"
    assert {e["reason"] for e in cluster.events if e["kind"] == "Node" and e["name"] == "blue-1"} >= {
        "MigrationStarted", "Switching", "GatePassed", "Migrated"}


def test_a_failed_preflight_fails_the_node_and_degrades_the_policy_without_switching_it() -> None:
    cluster = blue_and_green(rollout={"maxUnavailable": 1})

    async def run() -> None:
        await steps(cluster, 2)
        cluster.agent("blue-1", fail="kernel module nf_tables missing")
        await asyncio.sleep(0.05)
        await steps(cluster, 2)

    asyncio.run(run())

    assert phase(cluster, "blue-1") == "Failed"
    assert "proxyshift.io/revision" not in cluster.nodes["blue-1"]["metadata"]["labels"]
    assert not any(call.startswith("set_node_label") for call in cluster.calls)
    status = cluster.policy_status["blue"]
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "nf_tables" in degraded["message"]
    assert cluster.proxynodes["blue-2"]["spec"] == {}  # the rollout halts: no next node
    warnings = [e for e in cluster.events if e["type_"] == "Warning" and e["name"] == "blue-1"]
    assert warnings and "nf_tables" in warnings[0]["message"]


def test_a_failed_node_write_keeps_the_policy_status_from_describing_it() -> None:
    cluster = blue_and_green(rollout={"maxUnavailable": 2})
    cluster.fail[("ensure_proxynode", "blue-2")] = ApiException(status=500, reason="etcd timeout")

    async def run() -> list[str]:
        with pytest.raises(ApiException):
            await step(cluster.runtime_for_test(), "blue", cluster.indexes())
        return list(cluster.calls)

    calls = asyncio.run(run())

    # Side by side, then nothing: neither the revision (a policy action, after the nodes') nor the status.
    assert sorted(calls) == ["ensure_proxynode blue-1", "ensure_proxynode blue-2"]
    assert phase(cluster, "blue-1") == "Preflight"  # the other node's step happened and is recorded
    assert "Preflight" not in str(cluster.policy_status.get("blue", {}).get("nodes"))


def test_indexes_come_from_the_handler_keywords_named_after_the_index_handlers() -> None:
    stores: dict[str, Any] = {"policy_index": {"a": [1]}, "baseline_configmap_index": {"body": [3]},
                              "baseline_daemonset_index": {"body": [4]}, "logger": None}
    indexes = Indexes.from_kwargs(stores)
    assert indexes.policies == {"a": [1]}
    assert (indexes.baseline_configmap, indexes.baseline_daemonset) == ({"body": [3]}, {"body": [4]})


def test_a_proxynode_change_wakes_the_loops_of_its_policy_only() -> None:
    cluster = blue_and_green()

    async def run() -> tuple[bool, bool, bool]:
        runtime = cluster.runtime_for_test()
        with runtime.wakers.registered("blue") as blue, runtime.wakers.registered("red") as red:
            blue.clear()
            red.clear()
            cluster.ensure_proxynode("blue-1", "uid-blue-1", {"policy": "blue"})
            await asyncio.sleep(0.01)
            woke = (blue.is_set(), red.is_set())
            cluster.set_unschedulable("green-1", True)  # a Node change may concern any policy
            await asyncio.sleep(0.01)
        return (*woke, red.is_set())

    assert asyncio.run(run()) == (True, False, True)


def test_waking_a_policy_nobody_waits_for_wakes_every_loop() -> None:
    async def run() -> bool:
        wakers = Wakers()
        with wakers.registered("blue") as event:
            wakers.wake("gone")
            return event.is_set()

    assert asyncio.run(run())


def test_every_node_without_a_proxynode_gets_one_once_the_mirrors_are_synced() -> None:
    cluster = blue_and_green()
    del cluster.proxynodes["green-1"]

    async def run() -> None:
        runtime = cluster.runtime_for_test()
        for name in list(cluster.nodes):
            runtime.inventory.ensure(name)
            runtime.inventory.ensure(name)  # a second change while the first create runs: one create
        await asyncio.gather(*runtime.tasks.running)

    asyncio.run(run())
    assert cluster.calls == ["ensure_proxynode green-1"]
    assert cluster.proxynodes["green-1"]["spec"] == {}
