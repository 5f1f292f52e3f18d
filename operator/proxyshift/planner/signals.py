"""What the operator's alerting gauges say about a policy and a node: pure functions of the World.

The alerts in config/prometheus/alerts (runbooks in docs/troubleshooting.md) need facts the
planner already holds but did not export: the policy's conditions, when its rollout last moved,
whether a Revert is halted, each agent's heartbeat and whether a settled node runs the mode it
should. They are computed here from the API objects alone, so a restarted operator exports the
same values at its first step; controller/metrics.py only sets the gauges.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxyshift.api.policy import ProxyPolicyStatus
from proxyshift.api.proxynode import ProxyNode
from proxyshift.planner.machine import is_in_flight
from proxyshift.planner.ownership import is_deleting
from proxyshift.planner.status import CONDITION_TYPES
from proxyshift.planner.timeutil import parse
from proxyshift.planner.world import Action, RecordStatus, SetMigration, World


@dataclass(frozen=True)
class PolicySignals:
    conditions: dict[str, bool]  # every condition type -> its status is True
    last_progress: float | None  # Unix seconds of the newest node phase change, spec render or deletion
    revert_halted: bool


@dataclass(frozen=True)
class NodeSignals:
    heartbeat: float | None  # Unix seconds of the agent's last status write; None: it never wrote one
    observed_mode: str  # "" when kube-proxy did not answer /proxyMode
    target_mode: str  # "" when not known (a revision whose mode is not recorded, an unknown baseline)
    mode_mismatch: bool


def _unix(text: str | None) -> float | None:
    moment = parse(text)
    return moment.timestamp() if moment is not None else None


def _newest(texts: Iterable[str | None]) -> float | None:
    stamps = [s for s in map(_unix, texts) if s is not None]
    return max(stamps) if stamps else None


def policy_signals(world: World, policy_name: str, actions: Sequence[Action]) -> PolicySignals | None:
    """The policy's signals after this plan: its new status if the plan records one, else the stored one."""
    policy = world.policies.get(policy_name)
    if policy is None:
        return None
    status: ProxyPolicyStatus = next(
        (a.status for a in actions if isinstance(a, RecordStatus) and a.policy == policy_name), policy.status
    )
    true = {c.type for c in status.conditions if c.status == "True"}
    conditions = {t: t in true for t in CONDITION_TYPES}
    # Progress is any node changing phase (the machine moves phaseSince only then, also per rollback
    # step), a new revision of the spec, a new stage, or the start of a deletion; a plan's own writes
    # count now.
    stamps: list[str | None] = [policy.metadata.get("creationTimestamp"), policy.metadata.get("deletionTimestamp"),
                                status.revision_since, status.stage_started_at]
    for pn in world.proxynodes.values():
        m = pn.spec.migration
        if pn.spec.policy == policy_name and m is not None:
            stamps += [m.phase_since, m.finished_at]
    for a in actions:
        if isinstance(a, SetMigration) and a.policy == policy_name and a.migration is not None:
            stamps += [a.migration.phase_since, a.migration.finished_at]
    # While the policy is deleted, Degraded means a failed node (or an unreadable baseline) stops the
    # walk back to the baseline, and the finalizer keeps `kubectl delete` (and Argo CD) waiting.
    revert_halted = (is_deleting(policy) and policy.spec.deletion_policy == "Revert"
                     and conditions.get("Degraded", False))
    return PolicySignals(conditions=conditions, last_progress=_newest(stamps), revert_halted=revert_halted)


def node_signals(pn: ProxyNode, baseline_mode: str | None) -> NodeSignals:
    """A node's heartbeat and whether its kube-proxy runs the mode it should, once no migration moves it.

    The target is spec.mode (the machine writes the target's mode on start, the source's on a rollback,
    the label's on release); a ProxyNode no policy ever held has none and should run the baseline.
    A node whose agent never reported is not judged: there is no observation to compare.
    """
    heartbeat = _unix(pn.status.heartbeat)
    observed = pn.status.observed_mode or ""
    target = pn.spec.mode or ("" if pn.spec.revision else baseline_mode or "")
    mismatch = (heartbeat is not None and bool(target) and not is_in_flight(pn.spec.migration)
                and observed != target)
    return NodeSignals(heartbeat=heartbeat, observed_mode=observed, target_mode=target, mode_mismatch=mismatch)
