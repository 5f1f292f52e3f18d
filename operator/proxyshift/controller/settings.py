"""Every operator knob in one place (kopf's advice: settings in one place, handlers thin)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


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
    idle_requeue_seconds: float = float(_env("PROXYSHIFT_IDLE_REQUEUE_SECONDS", "30"))
    # The shortest pause between two plans (to batch watch echoes); a plan that took longer pauses longer.
    min_requeue_seconds: float = float(_env("PROXYSHIFT_MIN_REQUEUE_SECONDS", "0.02"))
    # Which Normal Events a node's migration posts: "steps" (one per step, on the node and its policy),
    # "outcomes" (how it ended, on the node) or "auto": steps while the policy selects at most
    # step_events_max_nodes nodes, outcomes above (Events would be most of the operator's writes).
    # Warnings always.
    node_events: str = _env("PROXYSHIFT_NODE_EVENTS", "auto")
    step_events_max_nodes: int = int(_env("PROXYSHIFT_STEP_EVENTS_MAX_NODES", "100"))
    # How many nodes' steps one plan performs at once (each node's own steps stay in order): at
    # thousands of nodes a rollout is bound by API round trips, not by planning.
    node_concurrency: int = int(_env("PROXYSHIFT_NODE_CONCURRENCY", "8"))
    metrics_port: int = int(_env("PROXYSHIFT_METRICS_PORT", "8080"))
    peering_name: str = _env("PROXYSHIFT_PEERING", "proxyshift")
    kopf_field: str = "kopf"


CONFIG = OperatorConfig()

FINALIZER = "proxyshift.io/finalizer"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "proxyshift"
BASELINE_PATCH_ANNOTATION = "proxyshift.io/baseline-affinity-undo"
