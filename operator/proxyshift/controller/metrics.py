"""The operator's own Prometheus metrics, served on its metrics port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

NODES_BY_PHASE = Gauge(
    "proxyshift_nodes", "Nodes owned by a policy, by migration phase.", ["policy", "phase"]
)
NODE_MIGRATION_SECONDS = Histogram(
    "proxyshift_node_migration_duration_seconds",
    "Wall time of one node's migration, from start to Done or RolledBack.",
    ["from_mode", "to_mode", "result"],
    buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
GATE_FAILURES = Counter(
    "proxyshift_gate_failures_total", "Gate evaluations that failed a node, by reason.", ["policy", "reason"]
)
ROLLBACKS = Counter("proxyshift_rollbacks_total", "Nodes that were rolled back.", ["policy"])
RECONCILE_ERRORS = Counter(
    "proxyshift_reconcile_errors_total", "Rollout loop iterations that raised, by error type.", ["policy", "error"]
)
ACTIONS = Counter("proxyshift_actions_total", "API steps performed, by action type.", ["policy", "action"])
POLICY_READY = Gauge("proxyshift_policy_ready", "1 when the policy's Ready condition is True.", ["policy"])
