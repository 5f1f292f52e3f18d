"""The revisions' mirrors (controller/fleet.py): which objects are revisions, and that a re-list drops one whose
DELETED event never arrived (kopf's index kept it, and a Revert waited for it for good)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, TypeVar

import pytest
from fake_cluster import FakeCluster, policy

from proxyshift.controller.fleet import (
    REPLACEMENT_REVISIONS,
    REVISIONS,
    replacement_revision_item,
    revision_daemonset_item,
)
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.reconcile import step
from proxyshift.planner import world as w
from proxyshift.render import render_revision

pytestmark = pytest.mark.unit


T = TypeVar("T")


def some(found: T | None) -> T:
    assert found is not None
    return found


def rendered(cluster: FakeCluster, mode: str = "nftables") -> Any:
    return render_revision(policy(mode=mode), cluster.configmaps["kube-proxy"], cluster.daemonsets["kube-proxy"])


def test_a_kube_proxy_revision_is_its_daemonset_and_a_replacement_revision_its_configmap() -> None:
    cluster = FakeCluster()
    kube_proxy, cilium = rendered(cluster), rendered(cluster, "cilium-kpr")
    found = revision_daemonset_item(kube_proxy.daemonset)
    assert found is not None
    key, (view, generation) = found
    assert (view.name, view.policy, view.mode) == (kube_proxy.name, "blue", "nftables")
    assert generation == kube_proxy.daemonset["metadata"].get("generation")
    # Keyed as the mirror keys an object that no longer qualifies, so one that loses its label leaves the store.
    assert key == Mirror._key_of(None, kube_proxy.daemonset)  # type: ignore[arg-type]  # uses no field of self
    assert replacement_revision_item(kube_proxy.configmap) is None  # its DaemonSet is the record
    found_cm = replacement_revision_item(cilium.configmap)
    assert found_cm is not None and found_cm[1][0].mode == "cilium-kpr"
    assert revision_daemonset_item(cluster.daemonsets["kube-proxy"]) is None  # the baseline is no revision


def test_a_revision_whose_delete_went_unseen_leaves_with_the_next_list_and_the_revert_ends() -> None:
    cluster = FakeCluster()
    cluster.add_node("blue-1", {"pool": "blue"})
    cluster.add_policy(policy(deleting=True))
    revision = rendered(cluster)
    cluster.add_revision_daemonset(copy.deepcopy(revision.daemonset))

    async def run() -> tuple[dict[str, w.RevisionView], list[str], bool, bool]:
        runtime = cluster.runtime_for_test()
        fleet = runtime.fleet
        before = fleet.revision_views()
        # The DaemonSet goes while the API server is away: no DELETED event reaches the mirror.
        cluster.revision_watch_away = True
        del cluster.daemonsets[revision.daemonset["metadata"]["name"]]
        start = len(cluster.calls)
        finished_while_away = await finished_within(runtime, 5)
        deletes = [c for c in cluster.calls[start:] if c.startswith("delete_daemonset")]
        # The watch comes back: the mirror lists again and finds no such DaemonSet.
        cluster.revision_watch_away = False
        with runtime.wakers.registered("blue") as woken:
            woken.clear()
            cluster._fill_revisions()
            was_woken = woken.is_set()
        return before, deletes, finished_while_away, was_woken and await finished_within(runtime, 5)

    async def finished_within(runtime: Any, steps: int) -> bool:
        for _ in range(steps):
            plan = await step(runtime, "blue", cluster.indexes())
            if any(isinstance(a, w.RemoveFinalizer) for a in plan.actions):
                return True
        return False

    before, deletes, finished_while_away, finished = asyncio.run(run())
    assert list(before) == [revision.name]
    # While the mirror still holds it, every plan deletes it again (a 404, ignored) and keeps the finalizer:
    # what kopf's index made of a missed DELETED event, for good.
    ds_name = revision.daemonset["metadata"]["name"]
    assert deletes and set(deletes) == {f"delete_daemonset {ds_name}"} and not finished_while_away
    assert finished


def test_a_revision_daemonset_edited_by_someone_else_is_due_again() -> None:
    cluster = FakeCluster()
    revision = rendered(cluster)

    async def run() -> tuple[bool, bool, bool]:
        runtime = cluster.runtime_for_test()
        kept, mirror = runtime.executor.kept, runtime.fleet.mirrors[REVISIONS]
        body = copy.deepcopy(revision.daemonset)
        body["metadata"]["generation"] = 1
        mirror._apply(*some(revision_daemonset_item(body)))
        kept.applied(revision.name)
        quiet = kept.due(revision.name)
        mirror._apply(*some(revision_daemonset_item(body)))  # its pods' status moved: the same generation
        still = kept.due(revision.name)
        body["metadata"]["generation"] = 2
        mirror._apply(*some(revision_daemonset_item(body)))
        return quiet, still, kept.due(revision.name)

    assert asyncio.run(run()) == (False, False, True)


def test_both_mirrors_make_the_revisions_the_world_sees() -> None:
    cluster = FakeCluster()
    kube_proxy, cilium = rendered(cluster), rendered(cluster, "cilium-kpr")

    async def run() -> dict[str, w.RevisionView]:
        runtime = cluster.runtime_for_test()
        mirrors = runtime.fleet.mirrors
        mirrors[REVISIONS]._replace_all(dict([some(revision_daemonset_item(kube_proxy.daemonset))]))
        mirrors[REPLACEMENT_REVISIONS]._replace_all(dict([some(replacement_revision_item(cilium.configmap))]))
        return runtime.fleet.revision_views()

    views = asyncio.run(run())
    assert {name: view.mode for name, view in views.items()} == {kube_proxy.name: "nftables", cilium.name: "cilium-kpr"}
