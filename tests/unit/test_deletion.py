"""The deletion path (controller/deletion.py) against an in-memory cluster (fake_cluster.py): a deleted
policy walks its nodes back to the baseline, releases them, deletes its revision, and only then lets
kopf remove the finalizer."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from fake_cluster import INVENTORY, FakeCluster, policy

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.deletion import finish_deletion
from proxyshift.render import render_revision

pytestmark = pytest.mark.unit


def migrated_cluster(**spec: Any) -> tuple[FakeCluster, str]:
    """blue-1 migrated to the policy's nftables revision (Done), blue-2 never touched; the policy deleted."""
    cluster = FakeCluster()
    deleted = policy(deleting=True, **spec)
    rendered = render_revision(deleted, cluster.configmaps["kube-proxy"], cluster.daemonsets["kube-proxy"])
    cluster.configmaps[rendered.configmap["metadata"]["name"]] = rendered.configmap
    cluster.add_revision_daemonset(rendered.daemonset)
    cluster.add_node("blue-1", {"pool": "blue", "proxyshift.io/revision": rendered.name},
                     daemonset=rendered.daemonset["metadata"]["name"],
                     proxynode_spec={"policy": "blue", "revision": rendered.name, "mode": "nftables",
                                     "migration": {"phase": "Done", "toRevision": rendered.name, "fromMode": "iptables",
                                                   "toMode": "nftables", "attempt": 1,
                                                   "startedAt": "2026-11-30T11:00:00Z",
                                                   "finishedAt": "2026-11-30T11:05:00Z"}},
                     proxynode_status={**INVENTORY, "observedMode": "nftables"})
    cluster.add_node("blue-2", {"pool": "blue"})
    cluster.add_policy(deleted)
    return cluster, rendered.name


async def answer_nodes(cluster: FakeCluster, done: asyncio.Task[None]) -> None:
    """The DaemonSet controller, kubelets and agents, answering while the delete handler steps."""
    while not done.done():
        await asyncio.sleep(0.05)
        for node in cluster.nodes:
            cluster.kubelet(node)
            cluster.agent(node)


def test_deleting_a_policy_reverts_its_nodes_then_lets_the_finalizer_go() -> None:
    cluster, revision = migrated_cluster()

    async def run() -> None:
        runtime = cluster.runtime_for_test()
        handler = asyncio.create_task(finish_deletion(runtime, "blue", cluster.indexes(), seconds=30))
        await asyncio.gather(handler, answer_nodes(cluster, handler))

    asyncio.run(run())  # returning (not raising) is what lets kopf remove the finalizer

    # Back on the baseline: no revision label, the baseline kube-proxy, the ProxyNode released.
    assert "proxyshift.io/revision" not in cluster.nodes["blue-1"]["metadata"]["labels"]
    assert cluster.proxynodes["blue-1"]["spec"] == {"mode": "iptables"}
    assert cluster.proxynodes["blue-1"]["status"]["observedMode"] == "iptables"
    # The revision goes once no node uses it, after the label moved back.
    ds_name = f"kube-proxy-{revision}"
    assert ds_name not in cluster.daemonsets and ds_name not in cluster.configmaps
    assert cluster.calls.index(f"delete_daemonset {ds_name}") > cluster.calls.index("set_node_label blue-1")
    assert cluster.proxynodes["blue-2"]["spec"] == {}  # never the policy's: untouched
    assert cluster.policy_status["blue"]["phase"] == "Deleting"


def test_a_revert_that_takes_longer_than_one_call_hands_back_to_kopf_to_be_called_again() -> None:
    cluster, revision = migrated_cluster()

    async def run() -> None:
        runtime = cluster.runtime_for_test()
        # No agent answers: the revert's preflight stays open.
        with pytest.raises(kopf.TemporaryError):
            await finish_deletion(runtime, "blue", cluster.indexes(), seconds=0.3)

    asyncio.run(run())

    spec = cluster.proxynodes["blue-1"]["spec"]
    assert spec["migration"]["phase"] == "Preflight" and spec["mode"] == "iptables"
    assert spec["operation"]["type"] == "Preflight"
    assert cluster.nodes["blue-1"]["metadata"]["labels"]["proxyshift.io/revision"] == revision  # not moved yet
    assert f"kube-proxy-{revision}" in cluster.daemonsets


def test_orphan_deletion_leaves_nodes_and_revision_and_releases_at_once() -> None:
    cluster, revision = migrated_cluster(deletionPolicy="Orphan")

    async def run() -> None:
        await finish_deletion(cluster.runtime_for_test(), "blue", cluster.indexes(), seconds=5)

    asyncio.run(run())

    assert cluster.nodes["blue-1"]["metadata"]["labels"]["proxyshift.io/revision"] == revision
    assert f"kube-proxy-{revision}" in cluster.daemonsets
    assert not any(call.startswith(("set_node_label", "delete_")) for call in cluster.calls)


def test_a_deleted_policy_that_owns_nothing_lets_the_finalizer_go_at_once_without_writes() -> None:
    cluster = FakeCluster()
    cluster.add_node("blue-1", {"pool": "blue"})
    deleted: ProxyPolicy = policy(deleting=True)
    cluster.add_policy(deleted)

    async def run() -> None:
        await finish_deletion(cluster.runtime_for_test(), "blue", cluster.indexes(), seconds=5)

    asyncio.run(run())
    assert cluster.calls == []
