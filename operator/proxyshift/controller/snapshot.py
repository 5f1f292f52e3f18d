"""Builds the planner's World from the operator's in-memory indexes (no API calls)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.planner.world import KubeProxyPodView, NodeView, RevisionView, World

POLICY_LABEL = "proxyshift.io/policy"
REVISION_NAME_LABEL = "proxyshift.io/revision"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def node_view(name: str, labels: Mapping[str, str], spec: Mapping[str, Any], status: Mapping[str, Any]) -> NodeView:
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return NodeView(name=name, labels=dict(labels), unschedulable=bool(spec.get("unschedulable")), ready=ready)


def kube_proxy_pod_view(body: Mapping[str, Any]) -> KubeProxyPodView | None:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    node = spec.get("nodeName")
    if not node:
        return None
    owner = next((o.get("name") for o in meta.get("ownerReferences") or [] if o.get("kind") == "DaemonSet"), "")
    statuses = status.get("containerStatuses") or []
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    started = statuses[0].get("state", {}).get("running", {}).get("startedAt") if statuses else None
    return KubeProxyPodView(
        node=node,
        name=meta.get("name", ""),
        daemonset=owner,
        ready=ready,
        running=status.get("phase") == "Running",
        deleting=bool(meta.get("deletionTimestamp")),
        started_at=parse_time(started),
        restarts=sum(int(c.get("restartCount", 0)) for c in statuses),
    )


def revision_view(body: Mapping[str, Any]) -> RevisionView | None:
    labels = body.get("metadata", {}).get("labels") or {}
    annotations = body.get("metadata", {}).get("annotations") or {}
    name = labels.get(REVISION_NAME_LABEL)
    if not name:
        return None
    return RevisionView(
        name=name,
        policy=labels.get(POLICY_LABEL, ""),
        mode=annotations.get("proxyshift.io/mode", ""),
        config_hash=annotations.get("proxyshift.io/config-hash", name.rsplit("-", 1)[-1]),
    )


def first(store: Iterable[Any] | None) -> Any:
    """kopf index values are stores (collections); our indexes keep one value per key."""
    for item in store or ():
        return item
    return None


def build_world(
    *,
    policies: Mapping[str, Iterable[ProxyPolicy]],
    nodes: Mapping[str, Iterable[NodeView]],
    proxynodes: Mapping[str, Iterable[ProxyNode]],
    revisions: Mapping[str, Iterable[RevisionView]],
    pods: Mapping[str, Iterable[KubeProxyPodView]],
    baseline_mode: str,
    now: datetime | None = None,
    **extra: Any,
) -> World:
    return World(
        now=now or datetime.now(UTC),
        policies={k: v for k, s in policies.items() if (v := first(s)) is not None},
        nodes={k: v for k, s in nodes.items() if (v := first(s)) is not None},
        proxynodes={k: v for k, s in proxynodes.items() if (v := first(s)) is not None},
        revisions={k: v for k, s in revisions.items() if (v := first(s)) is not None},
        kube_proxy_pods={k: list(s) for k, s in pods.items()},
        baseline_mode=baseline_mode,
        **extra,
    )
