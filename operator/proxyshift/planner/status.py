"""The ProxyPolicy status: counts, bounded node lists and conditions per the Kubernetes API conventions.

The status must stay small at any fleet size (an object is capped at 1.5 MiB by etcd and a status
that grows with the fleet makes every watch event expensive), so the node lists are capped and
every message copied from a node is clipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from proxyshift.api.common import Condition
from proxyshift.api.policy import NodeCounts, NodeFailure, NodeProgress, ProxyPolicy, ProxyPolicyStatus
from proxyshift.planner.timeutil import fmt

if TYPE_CHECKING:  # preview imports the planner, which imports this module
    from proxyshift.planner.preview import CompatGroup

LIST_LIMIT = 20  # entries in inFlight, failed and conflictingNodes
NODE_MESSAGE_LIMIT = 120
CONDITION_MESSAGE_LIMIT = 400
NAMES_IN_MESSAGE = 5
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Paused", "Conflict", "ControlPlaneSkipped",
                   "BehaviourChanges")


def clip(text: str | None, limit: int) -> str:
    text = text or ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def name_list(names: list[str], total: int | None = None) -> str:
    total = len(names) if total is None else total
    shown = ", ".join(names[:NAMES_IN_MESSAGE])
    return shown + (f" and {total - NAMES_IN_MESSAGE} more" if total > NAMES_IN_MESSAGE else "")


@dataclass
class Summary:
    """What the planner found and decided for one policy, the input of the status."""

    generation: int | None
    revision: str | None
    mode: str
    deleting: bool
    paused: bool
    selected: int = 0
    updated: int = 0
    pending: int = 0
    in_flight: list[NodeProgress] = field(default_factory=list)  # every in-flight node, in node order
    failures: list[NodeFailure] = field(default_factory=list)  # every failed / rolled-back node
    halting: list[NodeFailure] = field(default_factory=list)  # the failures that stop new starts
    rolling_back: int = 0
    conflicting: list[str] = field(default_factory=list)  # in node order
    conflict_owners: dict[str, str] = field(default_factory=dict)
    skipped_control_plane: list[str] = field(default_factory=list)  # in node order
    stage: int | None = None
    stage_started_at: str | None = None
    retry_token: str | None = None
    waiting: str = ""  # why no new node starts right now, for the Progressing message
    revision_missing: bool = False
    revision_since: str | None = None
    kube_proxy_crashlooping: list[str] = field(default_factory=list)  # migrated nodes, in node order
    render_error: str | None = None  # the revision cannot be rendered: no node starts
    compat: list[CompatGroup] | None = None  # the compatibility report; None: not taken (yet)
    allowed_changes: tuple[str, ...] = ()  # gate.behaviour.allowChanges


def set_condition(
    old: list[Condition], type_: str, status: bool, reason: str, message: str, now: datetime,
    generation: int | None,
) -> Condition:
    """A condition whose lastTransitionTime moves only when its status changes."""
    value: Literal["True", "False"] = "True" if status else "False"
    previous = next((c for c in old if c.type == type_), None)
    since = previous.last_transition_time if previous is not None and previous.status == value else fmt(now)
    return Condition(
        type=type_, status=value, reason=reason, message=clip(message, CONDITION_MESSAGE_LIMIT),
        last_transition_time=since, observed_generation=generation,
    )


def behaviour_changes_condition(old: list[Condition], s: Summary, now: datetime, generation: int | None) -> Condition:
    """What the target mode changes for this cluster's Services, told when the policy is applied: True while
    a documented change affects Services here and is neither preserved by a setting nor allowed."""
    if s.compat is None:
        previous = next((c for c in old if c.type == "BehaviourChanges"), None)
        if previous is not None:
            return previous  # the report is taken again later; until then what it last said stands
        return Condition(type="BehaviourChanges", status="Unknown", reason="NotAssessed",
                         message="the compatibility report is taken once the policy's revision renders",
                         last_transition_time=fmt(now), observed_generation=generation)
    ahead: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for group in s.compat:
        for f in group.findings:
            if f.preserved or f.service_count == 0 or f.change in s.allowed_changes:
                continue
            ahead.setdefault(f.change, set()).update(f.services)
            counts[f.change] = max(counts.get(f.change, 0), f.service_count)
    if ahead:
        told = [f"{change} ({name_list(sorted(services), counts[change])})" for change, services in ahead.items()]
        return set_condition(old, "BehaviourChanges", True, "BehaviourChangesAhead",
                             "the target mode changes how Services here are served: " + "; ".join(told)
                             + ". `proxyshift plan -f` names the setting that keeps each; the gate rolls back a "
                             "node whose Services answer differently unless gate.behaviour.allowChanges names it",
                             now, generation)
    return set_condition(old, "BehaviourChanges", False, "NoBehaviourChanges",
                         "the target mode changes nothing this cluster's Services use that is not preserved or "
                         "allowed", now, generation)


def _phase(s: Summary) -> str:
    if s.deleting:
        return "Deleting"
    if s.revision_missing:
        return "Pending"
    if s.halting or s.rolling_back or s.kube_proxy_crashlooping or s.render_error:
        return "Degraded"
    if s.selected == 0 and s.conflicting:
        return "Conflict"
    if s.updated == s.selected and not s.in_flight:
        return "Ready"
    if s.paused:
        return "Paused"
    return "Progressing"


def build_status(policy: ProxyPolicy, s: Summary, now: datetime) -> ProxyPolicyStatus:
    old = policy.status.conditions
    gen = s.generation
    complete = (s.updated == s.selected and not s.in_flight and not s.deleting and not s.revision_missing
                and not s.render_error)
    halted = bool(s.halting) or s.rolling_back > 0

    if complete:
        if s.selected == 0:
            # Say why nothing happens: an empty pool is more often a typo in the selector than intended.
            why = ("its nodes belong to older policies" if s.conflicting else
                   "it matches only control-plane nodes, which it skips" if s.skipped_control_plane else
                   "it matches no node")
            ready = set_condition(old, "Ready", True, "NoNodesSelected",
                                  f"no node to migrate: {why}; check spec.nodeSelector against the node labels",
                                  now, gen)
        else:
            ready = set_condition(old, "Ready", True, "RolloutComplete",
                                  f"all {s.selected} selected nodes run {s.mode} ({s.revision})", now, gen)
    else:
        reason = ("Deleting" if s.deleting else "BaselineUnreadable" if s.render_error
                  else "RevisionPending" if s.revision_missing
                  else "RolloutHalted" if halted else "RolloutInProgress")
        ready = set_condition(old, "Ready", False, reason, f"{s.updated}/{s.selected} nodes run {s.revision}",
                              now, gen)

    if complete:
        progressing = set_condition(old, "Progressing", False, "RolloutComplete", "nothing left to migrate", now, gen)
    elif halted:
        progressing = set_condition(old, "Progressing", bool(s.in_flight), "RolloutHalted",
                                    "no new node starts until the failure is dealt with", now, gen)
    elif s.paused and not s.deleting and not s.in_flight:
        progressing = set_condition(old, "Progressing", False, "RolloutPaused",
                                    "spec.rollout.paused is true", now, gen)
    else:
        reason = "Deleting" if s.deleting else "NodesMigrating"
        message = f"{len(s.in_flight)} in flight, {s.pending} pending" + (f"; {s.waiting}" if s.waiting else "")
        progressing = set_condition(old, "Progressing", True, reason, message, now, gen)

    if halted:
        names = [f.name for f in s.halting]
        any_failed = any(f.phase == "Failed" for f in s.halting)
        reason = "NodeFailed" if any_failed else "NodeRolledBack" if s.halting else "NodeRollingBack"
        first = s.halting[0] if s.halting else None
        detail = f" ({first.name}: {first.reason}: {first.message})" if first else ""
        message = (f"rollout halted: {name_list(names)} failed{detail}; " if names else
                   f"rollout halted: {s.rolling_back} node(s) rolling back; ")
        message += "edit the spec or set a new value on the proxyshift.io/retry annotation to retry"
        degraded = set_condition(old, "Degraded", True, reason, message, now, gen)
    elif s.render_error:
        degraded = set_condition(
            old, "Degraded", True, "BaselineUnreadable",
            f"{s.render_error}; no node starts until the baseline kube-proxy ConfigMap is fixed (nodes in "
            "flight finish)", now, gen)
    elif s.kube_proxy_crashlooping:
        degraded = set_condition(
            old, "Degraded", True, "KubeProxyCrashLooping",
            f"kube-proxy keeps restarting without becoming Ready on migrated nodes: "
            f"{name_list(s.kube_proxy_crashlooping)}; they passed the gate, so proxyshift leaves them be: look "
            "at the pod logs, and move them back by editing the spec or deleting the policy (Revert)", now, gen)
    else:
        degraded = set_condition(old, "Degraded", False, "AsExpected", "no failed nodes", now, gen)

    paused = set_condition(old, "Paused", s.paused, "RolloutPaused" if s.paused else "NotPaused",
                           "spec.rollout.paused is true: nodes in flight finish, no new node starts"
                           if s.paused else "", now, gen)

    if s.conflicting:
        owners = sorted(set(s.conflict_owners.values()))
        conflict = set_condition(
            old, "Conflict", True, "NodesOwnedByOlderPolicy",
            f"{len(s.conflicting)} selected nodes belong to older policies ({', '.join(owners[:NAMES_IN_MESSAGE])}) "
            f"and are left to them: {name_list(s.conflicting)}", now, gen)
    else:
        conflict = set_condition(old, "Conflict", False, "NoConflict", "", now, gen)

    if s.skipped_control_plane:
        skipped = set_condition(
            old, "ControlPlaneSkipped", True, "ControlPlaneNodesSkipped",
            f"{len(s.skipped_control_plane)} nodes the selector matches are control-plane nodes and are left "
            f"alone: {name_list(s.skipped_control_plane)}; set spec.controlPlaneNodes: Include to migrate them",
            now, gen)
    else:
        skipped = set_condition(old, "ControlPlaneSkipped", False, "NoControlPlaneNodes", "", now, gen)

    changes = behaviour_changes_condition(old, s, now, gen)

    failures = sorted(s.failures, key=lambda f: f.at, reverse=True)[:LIST_LIMIT]
    return ProxyPolicyStatus(
        observed_generation=gen,
        phase=_phase(s),
        current_revision=s.revision,
        revision_since=s.revision_since,
        progress=f"{s.updated}/{s.selected}",
        stage=s.stage,
        stage_started_at=s.stage_started_at,
        nodes=NodeCounts(
            selected=s.selected, updated=s.updated, in_flight=len(s.in_flight), pending=s.pending,
            failed=len(s.failures), conflicting=len(s.conflicting),
            skipped_control_plane=len(s.skipped_control_plane),
        ),
        in_flight=[p.model_copy(update={"message": clip(p.message, NODE_MESSAGE_LIMIT)})
                   for p in s.in_flight[:LIST_LIMIT]],
        failed=[f.model_copy(update={"message": clip(f.message, NODE_MESSAGE_LIMIT)}) for f in failures],
        conflicting_nodes=s.conflicting[:LIST_LIMIT],
        retry_token=s.retry_token,
        conditions=[ready, progressing, degraded, paused, conflict, skipped, changes],
    )


# (type, status) -> is it a warning; other transitions are not worth an Event.
_EVENTFUL = {
    ("Ready", "True"): False, ("Degraded", "True"): True, ("Degraded", "False"): False,
    ("Conflict", "True"): True, ("ControlPlaneSkipped", "True"): True,
    ("Paused", "True"): False, ("Paused", "False"): False,
    ("BehaviourChanges", "True"): True,
}


def transitions(old: ProxyPolicyStatus, new: ProxyPolicyStatus) -> list[tuple[str, str, bool]]:
    """(reason, message, warning) for each condition whose status changed in a way a person cares about."""
    before = {c.type: c.status for c in old.conditions}
    changed = []
    for c in new.conditions:
        key = (c.type, c.status)
        prev = before.get(c.type)
        if key not in _EVENTFUL or prev == c.status or (prev is None and c.status == "False"):
            continue
        changed.append((c.reason, c.message, _EVENTFUL[key]))
    return changed
