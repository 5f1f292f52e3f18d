"""The operator's memory of the fleet-sized kinds: Nodes, kube-proxy pods and ProxyNodes, plus the
Services side (controller/service_cache.py), mirrored outside kopf (controller/mirror.py).

The mirrors' change callbacks run on the event loop: they wake the loops that depend on the change,
keep the ProxyNode series of the metrics current, and hand every Node seen to the inventory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
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
from proxyshift.controller.snapshot import kube_proxy_pod_view, node_view
from proxyshift.controller.wakeups import Wakers
from proxyshift.planner import world as w

log = logging.getLogger("proxyshift.operator")

NODES, PODS, PROXYNODE_MIRROR = "nodes", "pods", "proxynodes"


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
