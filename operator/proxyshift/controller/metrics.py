"""The operator's own Prometheus metrics, served on its metrics port."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram

ALL_PHASES = ("Pending", "Preflight", "Cordon", "Switch", "Gate", "Cleanup", "Verify", "Uncordon", "Done",
              "Failed", "RollingBack", "RolledBack")

NODES_BY_PHASE = Gauge(
    "proxyshift_nodes", "Nodes owned by a policy, by migration phase.", ["policy", "phase"]
)
NODE_MIGRATION_SECONDS = Histogram(
    "proxyshift_node_migration_duration_seconds",
    "Wall time of one node's migration, from start to Done or RolledBack.",
    ["from_mode", "to_mode", "result"],
    buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
GATE_FAILURES = PromCounter(
    "proxyshift_gate_failures_total",
    "Nodes whose switch, gate, cleanup or verify failed (rolled back), by reason.",
    ["policy", "reason"],
)
ROLLBACKS = PromCounter("proxyshift_rollbacks_total", "Nodes that were rolled back.", ["policy"])
RECONCILE_ERRORS = PromCounter(
    "proxyshift_reconcile_errors_total", "Rollout loop iterations that raised, by error type.", ["policy", "error"]
)
ACTIONS = PromCounter("proxyshift_actions_total", "API steps performed, by action type.", ["policy", "action"])
EVENTS_SKIPPED = PromCounter("proxyshift_node_events_skipped_total",
                             "Normal step Events not posted (PROXYSHIFT_NODE_EVENTS outcomes, or auto above "
                             "PROXYSHIFT_STEP_EVENTS_MAX_NODES selected nodes).")
POLICY_READY = Gauge("proxyshift_policy_ready", "1 when the policy's Ready condition is True.", ["policy"])


def _seconds_between(start: str | None, end: str | None) -> float | None:
    from proxyshift.planner.timeutil import parse

    a, b = parse(start), parse(end)
    return (b - a).total_seconds() if a and b else None


def record_plan(policy: str, world: Any, actions: list[Any]) -> None:
    """Update the metrics from one planner step: phase counts, finished migrations, rollbacks."""
    from proxyshift.planner.world import SetMigration

    phases: Counter[str] = Counter()
    for pn in world.proxynodes.values():
        if pn.spec.policy == policy and pn.spec.migration is not None:
            phases[pn.spec.migration.phase] += 1
    for phase in ALL_PHASES:
        NODES_BY_PHASE.labels(policy, phase).set(phases.get(phase, 0))
    for action in actions:
        if not isinstance(action, SetMigration) or action.migration is None:
            continue
        new = action.migration
        old_pn = world.proxynodes.get(action.node)
        old = old_pn.spec.migration.phase if old_pn and old_pn.spec.migration else None
        if new.phase == old:
            continue
        if new.phase == "RollingBack":
            ROLLBACKS.labels(policy).inc()
            GATE_FAILURES.labels(policy, new.reason or "Unknown").inc()
        if new.phase in ("Done", "RolledBack", "Failed"):
            seconds = _seconds_between(new.started_at, new.finished_at)
            if seconds is not None:
                result = {"Done": "succeeded", "RolledBack": "rolled_back", "Failed": "failed"}[new.phase]
                NODE_MIGRATION_SECONDS.labels(new.from_mode or "baseline", new.to_mode or "baseline",
                                              result).observe(seconds)
