"""Every operator knob in one place (kopf's advice: settings in one place, handlers thin)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from proxyshift.manifest import UsageError


class SettingsError(UsageError):
    """A PROXYSHIFT_* setting that cannot be used: the operator refuses to start, naming it."""


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _number(name: str, default: str, kind: type[int] | type[float], minimum: float, maximum: float) -> Any:
    text = _env(name, default).strip()
    try:
        value = kind(text)
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    # NaN compares false both ways, so it fails this check like any value out of range.
    if not minimum <= value <= maximum:
        raise SettingsError(f"{name}={text!r} is out of range: use {minimum:g} to {maximum:g}")
    return value


def _int(name: str, default: str, minimum: int, maximum: int) -> int:
    return int(_number(name, default, int, minimum, maximum))


def _float(name: str, default: str, minimum: float, maximum: float) -> float:
    return float(_number(name, default, float, minimum, maximum))


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _env(name, default).strip()
    if value not in choices:
        raise SettingsError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class OperatorConfig:
    """Where the baseline kube-proxy lives and how the operator paces itself."""

    kube_proxy_namespace: str = field(default_factory=lambda: _env("PROXYSHIFT_KUBE_PROXY_NAMESPACE", "kube-system"))
    baseline_configmap: str = field(default_factory=lambda: _env("PROXYSHIFT_BASELINE_CONFIGMAP", "kube-proxy"))
    baseline_daemonset: str = field(default_factory=lambda: _env("PROXYSHIFT_BASELINE_DAEMONSET", "kube-proxy"))
    kube_proxy_pod_label: str = field(
        default_factory=lambda: _env("PROXYSHIFT_KUBE_PROXY_POD_LABEL", "k8s-app=kube-proxy")
    )
    # The loop wakes on every ProxyNode/pod change; this is only the idle heartbeat.
    idle_requeue_seconds: float = field(
        default_factory=lambda: _float("PROXYSHIFT_IDLE_REQUEUE_SECONDS", "30", 0.1, 3600)
    )
    # The shortest pause between two plans (to batch watch echoes); a plan that took longer pauses longer.
    min_requeue_seconds: float = field(default_factory=lambda: _float("PROXYSHIFT_MIN_REQUEUE_SECONDS", "0.02", 0, 60))
    # How often an existing revision is applied again while none of its watched inputs moved
    # (controller/revision_keeper.py): bounds how long an edit to its unwatched ConfigMap stays; 0: every plan.
    revision_reapply_seconds: float = field(
        default_factory=lambda: _float("PROXYSHIFT_REVISION_REAPPLY_SECONDS", "30", 0, 3600)
    )
    # Which Normal Events a node's migration posts: "steps" (one per step, on the node and its policy),
    # "outcomes" (how it ended, on the node) or "auto": steps while the policy selects at most
    # step_events_max_nodes nodes, outcomes above (Events would be most of the operator's writes).
    # Warnings always.
    node_events: str = field(
        default_factory=lambda: _choice("PROXYSHIFT_NODE_EVENTS", "auto", ("auto", "steps", "outcomes"))
    )
    step_events_max_nodes: int = field(
        default_factory=lambda: _int("PROXYSHIFT_STEP_EVENTS_MAX_NODES", "100", 0, 1_000_000)
    )
    # How many nodes' steps one plan performs at once (each node's own steps stay in order): at
    # thousands of nodes a rollout is bound by API round trips, not by planning.
    node_concurrency: int = field(default_factory=lambda: _int("PROXYSHIFT_NODE_CONCURRENCY", "8", 1, 256))
    metrics_port: int = field(default_factory=lambda: _int("PROXYSHIFT_METRICS_PORT", "8080", 0, 65535))
    # The pod-network probe servers (config/agent/probe-daemonset.yaml): the behaviour probe's pod path.
    probe_namespace: str = field(default_factory=lambda: _env("PROXYSHIFT_PROBE_NAMESPACE", "proxyshift-system"))
    probe_pod_label: str = field(
        default_factory=lambda: _env("PROXYSHIFT_PROBE_POD_LABEL", "app.kubernetes.io/name=proxyshift-probe")
    )
    peering_name: str = field(default_factory=lambda: _env("PROXYSHIFT_PEERING", "proxyshift"))
    # kopf peering priority of this replica; unset: a random one, so two replicas never tie.
    peering_priority: int | None = field(
        default_factory=lambda: _int("PROXYSHIFT_PEERING_PRIORITY", "0", 0, 2**31 - 1) or None
    )
    kopf_field: str = "kopf"


CONFIG = OperatorConfig()

FINALIZER = "proxyshift.io/finalizer"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "proxyshift"
BASELINE_PATCH_ANNOTATION = "proxyshift.io/baseline-affinity-undo"
