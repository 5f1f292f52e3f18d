"""The operator's own Prometheus metrics, served on its metrics port."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram

from proxyshift.api.proxynode import PHASES

# The metric objects are module-level on purpose: prometheus_client registers each in its process-wide
# REGISTRY, which the /metrics server serves, and a second object of one name raises "Duplicated
# timeseries". What the operator remembers between updates (ProxyNodeSeries) lives in its runtime.
ALL_PHASES = PHASES

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
EVENTS_DROPPED = PromCounter("proxyshift_events_dropped_total",
                             "Events not posted because too many waited for the API server (event_sender.py).")
POLICY_READY = Gauge("proxyshift_policy_ready", "1 when the policy's Ready condition is True.", ["policy"])
POLICY_CONDITION = Gauge("proxyshift_policy_condition", "1 when the policy's condition of this type is True.",
                         ["policy", "condition"])
POLICY_LAST_PROGRESS = Gauge(
    "proxyshift_policy_last_progress_timestamp_seconds",
    "When the rollout last moved (Unix time): a node changed phase, the spec rendered a new revision, a stage "
    "began, or the policy's deletion began.",
    ["policy"],
)
POLICY_REVERT_HALTED = Gauge(
    "proxyshift_policy_revert_halted",
    "1 while the policy is being deleted with deletionPolicy Revert and is Degraded: the walk back to the "
    "baseline is halted and the finalizer stays.",
    ["policy"],
)
PROXYNODE_HEARTBEAT = Gauge("proxyshift_proxynode_heartbeat_timestamp_seconds",
                            "When the node's agent last wrote its ProxyNode status (Unix time, agent's clock).",
                            ["node"])
PROXYNODE_MODE_MISMATCH = Gauge(
    "proxyshift_proxynode_mode_mismatch",
    "1 when no migration is moving the node and its kube-proxy reports a mode other than its target "
    "(observed_mode empty: kube-proxy did not answer /proxyMode).",
    ["node", "observed_mode", "target_mode"],
)

POLICY_GAUGES = (POLICY_READY, POLICY_LAST_PROGRESS, POLICY_REVERT_HALTED)


def _seconds_between(start: str | None, end: str | None) -> float | None:
    from proxyshift.planner.timeutil import parse

    a, b = parse(start), parse(end)
    return (b - a).total_seconds() if a and b else None


def forget_policy(policy: str) -> None:
    """Drop the policy's gauges: it is gone, or this replica stopped working on it (a standby must not
    go on exporting the last values it saw, which would keep an alert firing after the peer fixed it)."""
    for phase in ALL_PHASES:
        NODES_BY_PHASE.remove(policy, phase)
    for gauge in POLICY_GAUGES:
        gauge.remove(policy)
    from proxyshift.planner.status import CONDITION_TYPES

    for condition in CONDITION_TYPES:
        POLICY_CONDITION.remove(policy, condition)


@contextlib.contextmanager
def exported(policy: str) -> Iterator[None]:
    """The policy's gauges live as long as this replica's loop for it: kopf stops the daemon when the
    policy is deleted (the delete handler steps and exports from then on) and when peering pauses
    this replica, whose last values would otherwise outlive what the active peer reports."""
    try:
        yield
    finally:
        forget_policy(policy)


def record_policy(policy: str, world: Any, actions: list[Any]) -> None:
    from proxyshift.planner.signals import policy_signals
    from proxyshift.planner.world import RemoveFinalizer

    if any(isinstance(a, RemoveFinalizer) and a.policy == policy for a in actions):
        forget_policy(policy)
        return
    signals = policy_signals(world, policy, actions)
    if signals is None:
        return
    for condition, true in signals.conditions.items():
        POLICY_CONDITION.labels(policy, condition).set(1 if true else 0)
    POLICY_READY.labels(policy).set(1 if signals.conditions.get("Ready") else 0)
    if signals.last_progress is not None:
        POLICY_LAST_PROGRESS.labels(policy).set(signals.last_progress)
    POLICY_REVERT_HALTED.labels(policy).set(1 if signals.revert_halted else 0)


@dataclass
class ProxyNodeSeries:
    """Each ProxyNode's heartbeat and mode series.

    The mode series carries the observed and target modes as labels, so a change of either must remove
    the old series: `labels` remembers, per node, the labels it was last exported with.
    """

    labels: dict[str, tuple[str, str]] = field(default_factory=dict)

    def record(self, name: str, pn: Any, baseline_mode: str | None) -> None:
        """Set (pn None: remove) the node's heartbeat and mode series from its ProxyNode."""
        from proxyshift.planner.signals import node_signals

        old = self.labels.pop(name, None)
        if pn is None:
            PROXYNODE_HEARTBEAT.remove(name)
            if old is not None:
                PROXYNODE_MODE_MISMATCH.remove(name, *old)
            return
        signals = node_signals(pn, baseline_mode)
        if signals.heartbeat is None:
            PROXYNODE_HEARTBEAT.remove(name)
        else:
            PROXYNODE_HEARTBEAT.labels(name).set(signals.heartbeat)
        labels = (signals.observed_mode, signals.target_mode)
        if old is not None and old != labels:
            PROXYNODE_MODE_MISMATCH.remove(name, *old)
        if signals.target_mode:
            PROXYNODE_MODE_MISMATCH.labels(name, *labels).set(1 if signals.mode_mismatch else 0)
            self.labels[name] = labels


def record_plan(policy: str, world: Any, actions: list[Any]) -> None:
    """Update the metrics from one planner step: phase counts, finished migrations, rollbacks, the
    policy's conditions and progress."""
    from proxyshift.planner.world import SetMigration

    # A labelled counter is exported only from its first increment, and Prometheus' increase() cannot
    # see that first step from nothing: born at 0 here, the first rollback shows as an increase.
    ROLLBACKS.labels(policy)

    from proxyshift.planner.machine import is_prepared

    phases: Counter[str] = Counter()
    for pn in world.proxynodes.values():
        if pn.spec.policy == policy and pn.spec.migration is not None:
            # Prepared is not written (the record stays Preflight): counted as the planner sees it.
            phases["Prepared" if is_prepared(pn) else pn.spec.migration.phase] += 1
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
    record_policy(policy, world, actions)
