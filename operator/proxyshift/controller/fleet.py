"""The operator's memory of the fleet-sized kinds: Nodes, kube-proxy pods and ProxyNodes, plus the
Services side (controller/service_cache.py) and the revisions' objects, mirrored outside kopf
(controller/mirror.py).

The mirrors' change callbacks run on the event loop: they wake the loops that depend on the change,
keep the ProxyNode series of the metrics current, and hand every Node seen to the inventory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller.executor import Written
from proxyshift.controller.kube import API_GROUP, API_VERSION, PROXYNODES
from proxyshift.controller.metrics import ProxyNodeSeries
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.rest import Collection
from proxyshift.controller.service_cache import service_mirrors, service_world
from proxyshift.controller.settings import OperatorConfig
from proxyshift.controller.snapshot import kube_proxy_pod_view, node_view, revision_view
from proxyshift.controller.wakeups import Wakers
from proxyshift.modes import runs_kube_proxy
from proxyshift.planner import world as w
from proxyshift.render import ANNOTATION_MODE, LABEL_MANAGED_BY, MANAGED_BY

log = logging.getLogger("proxyshift.operator")

NODES, PODS, PROXYNODE_MIRROR = "nodes", "pods", "proxynodes"
# The revisions: kube-proxy ones by their DaemonSet, those of a mode that runs no kube-proxy (Cilium's KPR) by
# their ConfigMap. Mirrored, not kopf-indexed: kopf's re-list after a broken watch (an API server restart) adds
# what it lists but never drops what it no longer finds, so a revision deleted in that gap stayed in its index
# for good, and a Revert waiting for its policy's revisions to be gone never ended. A mirror's re-list replaces
# its whole store.
REVISIONS, REPLACEMENT_REVISIONS = "revisions", "replacement-revisions"


def node_item(obj: dict[str, Any]) -> tuple[str, tuple[w.NodeView, str]] | None:
    """A Node as (name, (its view, its uid)): the uid names it in ownerReferences and Events."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        return None
    view = node_view(name, meta.get("labels") or {}, obj.get("spec") or {}, obj.get("status") or {},
                     str(meta.get("resourceVersion", "")))
    return name, (view, str(meta.get("uid") or ""))


def pod_item(obj: dict[str, Any]) -> tuple[str, w.KubeProxyPodView] | None:
    view = kube_proxy_pod_view(obj)
    meta = obj.get("metadata") or {}
    return (f"{meta.get('namespace')}/{meta.get('name')}", view) if view is not None else None


# What the operator reads of a ProxyNode's metadata: its name, and the resourceVersion that tells when its
# own write is back (Fleet.seen_version). The rest (managedFields above all: server-side apply records
# every spec field the operator owns and every status field the agent writes, about 10 KB of parsed JSON
# per ProxyNode) would be kept for nothing, for every node of the fleet.
PROXYNODE_METADATA = ("name", "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp")


def proxynode_item(obj: dict[str, Any]) -> tuple[str, ProxyNode] | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        return None
    slim = {**obj, "metadata": {k: meta[k] for k in PROXYNODE_METADATA if k in meta}}
    try:
        return name, ProxyNode.model_validate(slim)
    except ValidationError as exc:
        log.warning("ProxyNode %s is invalid and is ignored: %s", name, exc)
        return None


def _object_key(meta: Mapping[str, Any]) -> str:
    """Keyed as the mirror keys an object that leaves its view (Mirror._key_of), so such an object leaves."""
    return f"{meta.get('namespace')}/{meta.get('name')}"


def revision_daemonset_item(obj: dict[str, Any]) -> tuple[str, tuple[w.RevisionView, Hashable]] | None:
    """A revision's DaemonSet as (namespace/name, (its view, its generation)): the generation tells the
    RevisionKeeper that someone else edited it (its pods' status does not move it)."""
    view = revision_view(obj)
    if view is None:
        return None
    meta = obj.get("metadata") or {}
    return _object_key(meta), (view, meta.get("generation"))


def replacement_revision_item(obj: dict[str, Any]) -> tuple[str, tuple[w.RevisionView, Hashable]] | None:
    """A revision of a mode that runs no kube-proxy, by its ConfigMap (render/replacement.py): it has no
    DaemonSet. A kube-proxy revision's ConfigMap is not one: its DaemonSet is."""
    meta = obj.get("metadata") or {}
    if runs_kube_proxy((meta.get("annotations") or {}).get(ANNOTATION_MODE)):
        return None
    view = revision_view(obj)
    return (_object_key(meta), (view, None)) if view is not None else None


@dataclass(frozen=True)
class FleetView:
    """What one plan reads of the fleet: copies of the stores, so the loop's later changes do not move it."""

    nodes: dict[str, w.NodeView]
    proxynodes: dict[str, ProxyNode]
    pods: dict[str, list[w.KubeProxyPodView]]  # node -> its kube-proxy pods
    api_back_at: datetime | None = None  # the latest reconnection of any mirror (planner World.api_back_at)


class NodeUids(Mapping[str, str]):
    """The Executor's node name -> uid (for ownerReferences and Events), read from the node mirror."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def _items(self) -> dict[str, Any]:
        nodes = self._fleet.mirrors.get(NODES)
        return nodes.items if nodes is not None else {}

    def __getitem__(self, name: str) -> str:
        return str(self._items()[name][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


def _ignore_node(_: str) -> None:
    pass


@dataclass
class Fleet:
    """The mirrors by name ("nodes", "pods", "proxynodes" and the Services side), and what their changes do."""

    wakers: Wakers
    series: ProxyNodeSeries = field(default_factory=ProxyNodeSeries)
    mirrors: dict[str, Mirror] = field(default_factory=dict)
    # The baseline's mode, from the baseline ConfigMap's index: ProxyNodes no policy holds should run it.
    baseline_mode: str | None = None
    # Called on the event loop for every Node present after a change: the inventory creates its ProxyNode.
    on_node: Callable[[str], None] = _ignore_node
    # Called on the event loop with (revision, generation) for every revision DaemonSet seen: the executor's
    # RevisionKeeper re-applies a revision someone else edited.
    on_revision_daemonset: Callable[[str, Hashable], None] = lambda revision, generation: None

    def build(self, config: OperatorConfig) -> None:
        """The mirrors, not yet started; the kubernetes client's configuration must be loaded."""
        # Raw collections, not the typed CoreV1Api (controller/rest.py: its import alone is ~78 MB).
        nodes = Collection("/api/v1/nodes")
        pods = Collection(f"/api/v1/namespaces/{config.kube_proxy_namespace}/pods")
        proxynodes = Collection(f"/apis/{API_GROUP}/{API_VERSION}/{PROXYNODES}")
        self.mirrors[NODES] = Mirror(NODES, nodes.list, node_item, self.node_changed)
        self.mirrors[PODS] = Mirror(PODS, pods.list, pod_item, self.pod_changed,
                                    kwargs={"label_selector": config.kube_proxy_pod_label})
        self.mirrors[PROXYNODE_MIRROR] = Mirror(PROXYNODE_MIRROR, proxynodes.list, proxynode_item,
                                                self.proxynode_changed)
        managed = {"label_selector": f"{LABEL_MANAGED_BY}={MANAGED_BY}"}
        daemonsets = Collection(f"/apis/apps/v1/namespaces/{config.kube_proxy_namespace}/daemonsets")
        configmaps = Collection(f"/api/v1/namespaces/{config.kube_proxy_namespace}/configmaps")
        self.mirrors[REVISIONS] = Mirror(REVISIONS, daemonsets.list, revision_daemonset_item,
                                         self.revision_daemonset_changed, kwargs=dict(managed))
        self.mirrors[REPLACEMENT_REVISIONS] = Mirror(REPLACEMENT_REVISIONS, configmaps.list,
                                                     replacement_revision_item, self.revision_changed,
                                                     kwargs=dict(managed))
        self.mirrors.update(service_mirrors())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for mirror in self.mirrors.values():
            mirror.start(loop)

    def stop(self) -> None:
        for mirror in self.mirrors.values():
            mirror.stop()

    async def synced(self) -> None:
        await asyncio.gather(*(m.synced.wait() for m in self.mirrors.values()))

    def is_synced(self, *names: str) -> bool:
        return all(name in self.mirrors and self.mirrors[name].synced.is_set() for name in names)

    @property
    def node_uids(self) -> NodeUids:
        return NodeUids(self)

    def view(self) -> FleetView:
        nodes = {name: view for name, (view, _) in self.mirrors[NODES].items.items()}
        pods: dict[str, list[w.KubeProxyPodView]] = {}
        for pod in self.mirrors[PODS].items.values():
            pods.setdefault(pod.node, []).append(pod)
        back = [m.reconnected_at for m in self.mirrors.values() if m.reconnected_at is not None]
        return FleetView(nodes, dict(self.mirrors[PROXYNODE_MIRROR].items), pods, max(back, default=None))

    def services(self) -> w.ServiceSide:
        return service_world(self.mirrors)

    def revision_views(self) -> dict[str, w.RevisionView]:
        """Every revision that exists, by its name: the kube-proxy ones by their DaemonSet, the others by their
        ConfigMap (a DaemonSet's view wins should both name one revision)."""
        views: dict[str, w.RevisionView] = {}
        for name in (REPLACEMENT_REVISIONS, REVISIONS):
            mirror = self.mirrors.get(name)
            for view, _ in mirror.items.values() if mirror is not None else ():
                views[view.name] = view
        return views

    def seen_version(self, item: Written) -> str | None:
        """The resourceVersion the mirror holds of what `item` wrote (None: not there)."""
        if item.index == "node_index":
            node = self.mirrors[NODES].items.get(item.key)
            return node[0].resource_version if node is not None else None
        pn = self.mirrors[PROXYNODE_MIRROR].items.get(item.key)
        return str((pn.metadata or {}).get("resourceVersion", "")) if pn is not None else None

    def describe(self) -> str:
        return ", ".join(f"{k} {len(m.items)}" for k, m in self.mirrors.items())

    # ---- change callbacks (event loop) ----

    def node_changed(self, _: Mirror, name: str, old: Any, new: Any) -> None:
        self.wakers.wake()
        if new is not None:
            self.on_node(name)

    def pod_changed(self, _: Mirror, key: str, old: Any, new: Any) -> None:
        self.wakers.wake()

    def revision_daemonset_changed(self, mirror: Mirror, key: str, old: tuple[w.RevisionView, Hashable] | None,
                                   new: tuple[w.RevisionView, Hashable] | None) -> None:
        if new is not None:
            self.on_revision_daemonset(new[0].name, new[1])
        self.revision_changed(mirror, key, old, new)

    def revision_changed(self, _: Mirror, key: str, old: tuple[w.RevisionView, Hashable] | None,
                         new: tuple[w.RevisionView, Hashable] | None) -> None:
        old_view, new_view = (old[0] if old else None), (new[0] if new else None)
        if old_view == new_view:
            return  # its pods' status, or a re-list that found it as it was: nothing the plan reads
        for policy in {view.policy for view in (old_view, new_view) if view is not None}:
            self.wakers.wake(policy)  # a revision created or gone: the policy waiting on it goes on

    def proxynode_changed(self, _: Mirror, name: str, old: ProxyNode | None, new: ProxyNode | None) -> None:
        self.series.record(name, new, self.baseline_mode)
        policies = {pn.spec.policy for pn in (old, new) if pn is not None and pn.spec.policy}
        if not policies:
            self.wakers.wake()  # a ProxyNode no policy holds may be the one a policy waits to take
        for policy in policies:
            self.wakers.wake(policy)

    def baseline_changed(self, mode: str) -> None:
        """ProxyNodes no policy holds should run the baseline's mode: their mode series follow it."""
        if self.baseline_mode == mode:
            return
        self.baseline_mode = mode
        proxynodes = self.mirrors.get(PROXYNODE_MIRROR)
        for name, pn in list(proxynodes.items.items()) if proxynodes is not None else ():
            self.series.record(name, pn, mode)
