"""Builds the planner's World from the operator's in-memory caches (no API calls)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.modes import DEFAULT_MODE
from proxyshift.planner.world import KubeProxyPodView, NodeView, RevisionTarget, RevisionView, World
from proxyshift.render import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_MODE,
    ANNOTATION_POLICY,
    LABEL_REVISION,
    render_revision,
)

NODE_ADDRESS_TYPES = ("InternalIP", "ExternalIP")
MAX_NODE_ADDRESSES = 8


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def node_view(name: str, labels: Mapping[str, str], spec: Mapping[str, Any], status: Mapping[str, Any],
              resource_version: str = "") -> NodeView:
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    addresses = tuple(str(a["address"]) for a in (status.get("addresses") or [])[:MAX_NODE_ADDRESSES]
                      if isinstance(a, Mapping) and a.get("type") in NODE_ADDRESS_TYPES and a.get("address"))
    return NodeView(name=name, labels=dict(labels), unschedulable=bool(spec.get("unschedulable")), ready=ready,
                    addresses=addresses, resource_version=resource_version)


def probe_pod_endpoint(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(node, "podIP:port") of a running, ready pod-network probe server; None for any other pod."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    node, ip = spec.get("nodeName"), status.get("podIP")
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if not node or not ip or not ready or meta.get("deletionTimestamp") or spec.get("hostNetwork"):
        return None
    ports = [p.get("containerPort") for c in spec.get("containers") or [] for p in c.get("ports") or []]
    port = next((p for p in ports if isinstance(p, int)), None)
    return (str(node), f"{ip}:{port}") if port else None


def observed(seen: str | None, written: str) -> bool:
    """Has an index caught up with a write? resourceVersions are etcd revisions: compare as integers."""
    if not seen:
        return False
    try:
        return int(seen) >= int(written)
    except ValueError:
        return seen == written


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
    name = labels.get(LABEL_REVISION)
    if not name:
        return None
    return RevisionView(
        name=name,
        policy=annotations.get(ANNOTATION_POLICY, ""),
        mode=annotations.get(ANNOTATION_MODE, ""),
        config_hash=annotations.get(ANNOTATION_CONFIG_HASH, ""),
    )


def current_revisions(policies: Mapping[str, ProxyPolicy], baseline_configmap: Mapping[str, Any] | None,
                      baseline_daemonset: Mapping[str, Any] | None) -> tuple[dict[str, RevisionTarget], dict[str, str]]:
    """Render each policy's revision name on top of the baseline; errors per policy, for its status."""
    targets: dict[str, RevisionTarget] = {}
    errors: dict[str, str] = {}
    if baseline_configmap is None or baseline_daemonset is None:
        return targets, {name: "the baseline kube-proxy ConfigMap or DaemonSet was not found" for name in policies}
    for name, policy in policies.items():
        try:
            rendered = render_revision(policy, dict(baseline_configmap), dict(baseline_daemonset))
        except (ValueError, KeyError) as exc:
            errors[name] = f"cannot render a revision from the baseline kube-proxy: {exc}"
            continue
        # A replacement revision's config is its node config, not a KubeProxyConfiguration: no ipvs there.
        runs = rendered.kube_proxy_daemonset is not None
        settings = KubeProxyConfiguration.model_validate(rendered.config).ipvs if runs else None
        excluded = (settings.exclude_cidrs if settings is not None else None) or []
        targets[name] = RevisionTarget(name=rendered.name, mode=rendered.mode, scheduler=policy.spec.scheduler,
                                       ipvs_exclude_cidrs=tuple(str(c) for c in excluded))
    return targets, errors


def first(store: Iterable[Any] | None) -> Any:
    """kopf index values are stores (collections); our indexes keep one value per key."""
    for item in store or ():
        return item
    return None


def baseline_mode(configmap: Mapping[str, Any] | None) -> str:
    """The baseline kube-proxy's mode, from its ConfigMap; anything unreadable counts as kube-proxy's default."""
    text = ((configmap or {}).get("data") or {}).get("config.conf", "")
    try:
        return KubeProxyConfiguration.from_yaml(text).mode or DEFAULT_MODE
    except ValueError:
        return DEFAULT_MODE


def build_world(
    *,
    policies: Mapping[str, ProxyPolicy],
    nodes: Mapping[str, NodeView],
    proxynodes: Mapping[str, ProxyNode],
    revisions: Mapping[str, RevisionView],
    pods: Mapping[str, Iterable[KubeProxyPodView]],
    baseline_mode: str,
    now: datetime | None = None,
    **extra: Any,
) -> World:
    return World(
        now=now or datetime.now(UTC),
        policies=dict(policies),
        nodes=dict(nodes),
        proxynodes=dict(proxynodes),
        revisions=dict(revisions),
        kube_proxy_pods={k: list(s) for k, s in pods.items()},
        baseline_mode=baseline_mode,
        **extra,
    )
