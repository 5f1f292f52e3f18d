"""The per-node state machine: one node's migration, one transition per call.

    Pending -> Preflight -> [Prepared] -> [Cordon] -> Switch -> Gate -> [Cleanup [-> Verify]] -> [Uncordon] -> Done
    Preflight failure            -> Failed (nothing on the node was touched)
    Prepared: preflight passed while no maxUnavailable slot was free (the planner started the node's
              preflight ahead, during another node's gate); it switches when the planner grants a slot.
              Not written: the record stays Preflight, and its passed preflight (the agent's answer to the
              migration's own Preflight id) is what makes it Prepared (is_prepared). Where the switch holds
              rules and follows the grant directly, that preflight also made the rule hold (holds_ahead), so the
              granted switch moves the label at once (_held_ahead); the agent drops the hold when the record
              leaves flight (agent/hold.abandoned).
    Switch/Gate/Cleanup/Verify failure -> RollingBack -> RolledBack (or Failed if the old kube-proxy
                                          does not pass the gate either)

Everything the machine needs to resume is in ProxyNode.spec.migration, so a restarted operator
continues where the old one stopped. Each transition writes its intent first (SetMigration) and
then acts (label, cordon, ...): the operator performs actions in order and stops at the first
error, so after a crash the recorded phase always tells which idempotent act to repeat.

Operation ids are deterministic, "<toRevision|baseline>.<attempt>.<startedAt>.<step>.<n>", so an operator that
re-issues a step sends the same id and the agent (which runs each id once) does not repeat it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from proxyshift.api.behaviour import BehaviourParams, ConntrackParams, ConntrackReport
from proxyshift.api.common import parse_duration
from proxyshift.api.diagnostics import DiagnoseRequest
from proxyshift.api.policy import ProxyPolicySpec
from proxyshift.api.proxynode import (
    IN_FLIGHT,
    MAX_FOREIGN_VIRTUAL_SERVERS,
    MODES,
    VIRTUAL_SERVER_TEXT_LIMIT,
    CleanupParams,
    CleanupResult,
    Connects,
    HoldParams,
    Mode,
    NodeMigration,
    Operation,
    OperationStatus,
    Phase,
    PreflightParams,
    PreflightResult,
    ProbeParams,
    ProbeResult,
    ProxyNode,
    attempt_key,
    is_phase,
)
from proxyshift.api.replacement import ReplacementParams
from proxyshift.modes import (
    facts_of,
    hold_yields_to_live_rules,
    prunes_unexcluded_ipvs,
    replacement_labels,
    runs_kube_proxy,
    startup_cleanup_drops_old_rules,
)
from proxyshift.planner.behaviour import compare_matrices
from proxyshift.planner.gate import GateVerdict, evaluate_gate, evaluate_replacement_gate
from proxyshift.planner.gate import Result as GateResult
from proxyshift.planner.timeutil import fmt, parse, remaining, seconds_since, utc
from proxyshift.planner.world import (
    Action,
    Cordon,
    Drain,
    Event,
    KubeProxyPodView,
    NodeView,
    SetMigration,
    SetRevisionLabel,
    Uncordon,
    daemonset_for,
)

TERMINAL: frozenset[Phase] = frozenset({"Done", "Failed", "RolledBack"})
FAILED: frozenset[Phase] = frozenset({"Failed", "RolledBack"})
# Before the label moves nothing on the node has changed, so these phases can be abandoned for free.
UNTOUCHED: frozenset[Phase] = frozenset({"Preflight", "Prepared"})
ALL_MODES: tuple[Mode, ...] = MODES

POLL_SECONDS = 2.0  # how soon to look again while waiting for the agent or a pod
PROBE_INTERVAL_SECONDS = 3.0  # gap between two gate probes of the same node
AGENT_AWAIT_SECONDS = 10.0  # how long one probe may wait on the node for kube-proxy's sync
CRASHLOOP_RESTARTS = 3  # a new kube-proxy pod restarting this often is not going to come up
# How long after the API server came back the controllers may still be blind: client-go's reflectors retry a
# failed watch after up to 30 s plus up to 100 % jitter. A CI run saw the DaemonSet controller's cache stay
# 53 s behind its own writes after five API server restarts in 90 s (docs/reliability.md).
RECONNECT_GRACE = timedelta(seconds=60)
HOLD_WAIT_SECONDS = 20.0  # how long the switch waits for the agent's rule hold before going without
# The end of a rule hold kept for a rollback: the label back, the old kube-proxy's pod started and its first
# sync, all under the hold (a rollback without it loses the node's own connections until that sync).
HOLD_ROLLBACK_SECONDS = 30.0
MESSAGE_LIMIT = 400  # agent messages are copied into API objects: keep them bounded
class _Keep(enum.Enum):
    """_write's default for `diagnose`: carry the ProxyNode's current spec.diagnose over."""

    KEEP = "keep"


KEEP = _Keep.KEEP


@dataclass(frozen=True)
class Target:
    """Where a node should end up: a revision (None: the baseline kube-proxy) and its mode."""

    revision: str | None
    mode: str
    scheduler: str | None = None


@dataclass(frozen=True)
class NodeInput:
    """One node as the machine sees it, plus the owning policy's settings."""

    policy: str
    spec: ProxyPolicySpec
    node: NodeView
    proxynode: ProxyNode
    pods: Sequence[KubeProxyPodView]
    now: datetime
    service_ips: Mapping[str, str] = field(default_factory=dict)
    # The Service-behaviour sample for this node (None: the policy turned the probe off, or there is
    # nothing to sample) and the Service addresses whose un-NATed conntrack entries the agent deletes.
    behaviour: BehaviourParams | None = None
    conntrack: ConntrackParams | None = None
    # The Services whose distribution the node records before and after its move (id and record are set
    # by the machine); None: nothing worth recording.
    distribution: DiagnoseRequest | None = None
    api_back_at: datetime | None = None  # see World.api_back_at
    # Whether a node that passed preflight may go on to touch the node now: the planner grants it while a
    # maxUnavailable slot is free and no failed node halts the rollout. Without it the node waits Prepared.
    may_switch: bool = True
    # The current revision's ipvs.excludeCIDRs (None: no current revision), sent with a preflight for ipvs.
    ipvs_exclude_cidrs: tuple[str, ...] | None = None
    # For a node that runs no kube-proxy on one side of its move (cilium-kpr): the cluster's ClusterIP frontends
    # its replacement's Service table must hold (a bounded sample) and how many there are in all.
    frontends: tuple[tuple[str, ...], int] = ((), 0)

    @property
    def migration(self) -> NodeMigration | None:
        return self.proxynode.spec.migration


@dataclass
class Step:
    """The machine's answer for one node: actions, the phase they lead to, when to look again."""

    actions: list[Action]
    phase: Phase
    message: str = ""
    requeue_after: float | None = None


def clip(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def op_prefix(m: NodeMigration, step: str) -> str:
    return f"{attempt_key(m)}.{step}."


def op_id(m: NodeMigration, step: str, n: int) -> str:
    return f"{op_prefix(m, step)}{n}"


def is_in_flight(m: NodeMigration | None) -> bool:
    return m is not None and m.phase in IN_FLIGHT


def preflight_passed(pn: ProxyNode) -> bool:
    """The agent reports the preflight of the node's current migration Succeeded, and that preflight is
    still the node's operation."""
    m, op, last = pn.spec.migration, pn.spec.operation, pn.status.last_operation
    return (m is not None and op is not None and last is not None and last.id == op.id
            and op.id.startswith(op_prefix(m, "Preflight")) and last.state == "Succeeded")


def is_prepared(pn: ProxyNode) -> bool:
    """Ready to switch: untouched, its preflight passed, waiting for a maxUnavailable slot.

    The record says `Preflight` (an operator before this one wrote `Prepared`): entering Prepared costs
    no write. Everything Prepared needs is in the record already: the preflight's operation and its
    answer (the "before" matrix is recorded under that id), and `phaseSince`, the preflight's request,
    from which the wait expires."""
    m = pn.spec.migration
    if m is None:
        return False
    return m.phase == "Prepared" or (m.phase == "Preflight" and preflight_passed(pn))


# ---- building blocks ----


def _timeout(inp: NodeInput) -> timedelta:
    return parse_duration(inp.spec.gate.timeout)


def _step_since(inp: NodeInput, m: NodeMigration) -> str | None:
    """Where a step's timeout starts: when the node entered it, or RECONNECT_GRACE after the API server came
    back, the later.

    A step that outlasted an API server outage was not given its time: the controllers it waits for
    reconnect only after the outage, with their own back-off (world.World.api_back_at)."""
    entered = parse(m.phase_since)
    if entered is None or inp.api_back_at is None:
        return m.phase_since
    settled = utc(inp.api_back_at) + RECONNECT_GRACE
    return m.phase_since if settled <= entered else fmt(settled)


def _time_left(inp: NodeInput, m: NodeMigration) -> float:
    """Seconds left of gate.timeout for the node's current step (see _step_since)."""
    return remaining(_step_since(inp, m), _timeout(inp), inp.now)


def _result(inp: NodeInput, operation: Operation | None) -> OperationStatus | None:
    """The agent's report on `operation`, if the agent's last operation is that one."""
    last = inp.proxynode.status.last_operation
    if operation is None or last is None or last.id != operation.id:
        return None
    return last


def _write(
    inp: NodeInput,
    m: NodeMigration,
    operation: Operation | None,
    *,
    revision: str | None,
    mode: str | None,
    scheduler: str | None = None,
    diagnose: DiagnoseRequest | _Keep | None = KEEP,
) -> SetMigration:
    # The spec is replaced whole: a diagnose request the agent has not answered yet (a distribution
    # record, or a person's `proxyshift diagnose`) goes along unless this step asks for another.
    return SetMigration(
        node=inp.node.name,
        policy=inp.policy,
        revision=revision,
        mode=mode,
        scheduler=scheduler,
        migration=m,
        operation=operation,
        diagnose=inp.proxynode.spec.diagnose if isinstance(diagnose, _Keep) else diagnose,
    )


def _distribution(inp: NodeInput, m: NodeMigration, record: str) -> DiagnoseRequest | _Keep | None:
    """Record the node's traffic distribution before its move (with the Preflight) and after it (at Done),
    so `proxyshift status` can show the move's effect; with nothing worth recording, keep what is there."""
    if inp.distribution is None:
        return KEEP
    return inp.distribution.model_copy(update={"id": f"{attempt_key(m)}.{record}", "record": record})


def _forward_write(inp: NodeInput, m: NodeMigration, operation: Operation | None) -> SetMigration:
    return _write(inp, m, operation, revision=m.to_revision, mode=m.to_mode, scheduler=inp.proxynode.spec.scheduler)


def _event(inp: NodeInput, reason: str, message: str, warning: bool = False) -> Event:
    return Event(
        policy=inp.policy, node=inp.node.name, type="Warning" if warning else "Normal", reason=reason,
        message=clip(message),
    )


def _enter(inp: NodeInput, m: NodeMigration, phase: Phase, **changes: Any) -> NodeMigration:
    # A new phase's probes start again: the last phase's probe words would only mislead.
    return m.model_copy(update={"phase": phase, "phase_since": fmt(inp.now), "probe_said": None, **changes})


def _wait(phase: Phase, message: str, after: float = POLL_SECONDS) -> Step:
    return Step([], phase, message, after)


def is_crash_looping(pod: KubeProxyPodView) -> bool:
    """A kube-proxy pod that keeps restarting without becoming Ready (kube-proxy exits when its mode cannot run)."""
    return not pod.ready and not pod.deleting and pod.restarts >= CRASHLOOP_RESTARTS


def _pods(inp: NodeInput, revision: str | None) -> list[KubeProxyPodView]:
    ds = daemonset_for(revision)
    return [p for p in inp.pods if p.daemonset == ds]


def _pod_swap(inp: NodeInput, old: str | None, new: str | None,
              new_mode: str | None = None) -> tuple[bool, str, KubeProxyPodView | None]:
    """(done, what we wait for, the new pod): old revision's pod gone, new one Running and Ready. A revision of a
    mode that runs no kube-proxy (Cilium's KPR) has no pod: the old one gone is all; what serves the node's
    Services then is the gate's to prove."""
    old_pods = _pods(inp, old) if daemonset_for(old) != daemonset_for(new) else []
    new_pods = [p for p in _pods(inp, new) if not p.deleting]
    pod = new_pods[0] if new_pods else None
    if old_pods:
        return False, f"waiting for the old kube-proxy pod {old_pods[0].name} to go away", pod
    if not runs_kube_proxy(new_mode):
        return True, "", None
    if pod is None:
        return False, f"waiting for a {daemonset_for(new)} pod on the node", None
    if not (pod.running and pod.ready):
        return False, f"waiting for kube-proxy pod {pod.name} to be Running and Ready", pod
    return True, "", pod


def _modes_to_remove(inp: NodeInput, keep: str, left: str | None) -> list[str]:
    """Modes whose leftovers to flush: the one the node left plus any the agent found, never `keep`."""
    if keep not in ALL_MODES:
        return []  # we do not know what kube-proxy runs there now, so nothing is provably stale
    modes = set(inp.proxynode.status.leftovers or [])
    if left:
        modes.add(left)
    return [mode for mode in ALL_MODES if mode in modes and mode != keep]


def _probe_services(inp: NodeInput) -> tuple[list[str], list[str]]:
    """The gate's Services as ip:port, and those without a ClusterIP (namespace/name)."""
    services, unresolved = [], []
    for ref in inp.spec.gate.probe_services or []:
        ip = inp.service_ips.get(f"{ref.namespace}/{ref.name}")
        if ip:
            services.append(f"{ip}:{ref.port}")
        else:
            unresolved.append(f"{ref.namespace}/{ref.name}")
    return services, unresolved


def _connects(found: Connects | None, expected: list[str]) -> dict[str, bool | str]:
    """The agent's connect results (ProbeResult/CleanupResult read both wire shapes), per expected target."""
    return {target: (found or {}).get(target, "not probed") for target in expected}


# ---- entry point: start a node ----


def _replacement_params(inp: NodeInput, mode: str | None, *, frontends: bool) -> ReplacementParams | None:
    """What the agent reads of a mode that replaces kube-proxy (None for a kube-proxy mode): where its agent's API
    is (the policy's cilium.socketPath, else the mode's default) and, for a gate, the frontends to look for."""
    facts = facts_of(mode)
    if facts is None or facts.replacement is None:
        return None
    socket = inp.spec.cilium.socket_path if inp.spec.cilium is not None else facts.replacement.default_socket
    sample, total = inp.frontends if frontends else ((), 0)
    return ReplacementParams(socket_path=socket, frontends=list(sample), expected_frontends=total)


def _preflight_op(inp: NodeInput, m: NodeMigration, scheduler: str | None) -> Operation:
    hold = _hold_params(inp, m, ahead=True) if holds_ahead(inp, m) else None
    params = PreflightParams(
        mode=m.to_mode or "",
        scheduler=scheduler,
        load_modules=inp.spec.preflight.load_modules,
        extra_modules=list(inp.spec.preflight.extra_modules or []),
        allow_changes=list(inp.spec.gate.behaviour.allow_changes or []),
        behaviour=_behaviour_sample(inp),
        ipvs_exclude_cidrs=list(inp.ipvs_exclude_cidrs)
        if prunes_unexcluded_ipvs(m.to_mode) and inp.ipvs_exclude_cidrs is not None else None,
        replacement=_replacement_params(inp, m.to_mode, frontends=False),
        hold=hold,
    )
    return Operation.request(op_id(m, "Preflight", 0), params)


def _behaviour_sample(inp: NodeInput) -> BehaviourParams | None:
    """The Service sample to probe, None when there is nothing to sample."""
    return inp.behaviour if inp.behaviour is not None and inp.behaviour.targets else None


def start(
    inp: NodeInput,
    target: Target,
    *,
    from_mode: str,
    generation: int | None,
    retry_token: str | None,
) -> Step:
    """Pending -> Preflight: record the migration and ask the agent to check the node."""
    prev = inp.migration
    attempt = ((prev.attempt or 0) if prev else 0) + 1  # monotonic per node: op ids never repeat
    m = NodeMigration(
        phase="Preflight",
        phase_since=fmt(inp.now),
        from_revision=inp.node.revision,
        from_mode=from_mode,
        to_revision=target.revision,
        to_mode=target.mode,
        attempt=attempt,
        started_at=fmt(inp.now),
        generation=generation,
        retry_token=retry_token,
    )
    op = _preflight_op(inp, m, target.scheduler)
    where = target.revision or "the baseline kube-proxy"
    return Step(
        [
            _write(inp, m, op, revision=target.revision, mode=target.mode, scheduler=target.scheduler,
                   diagnose=_distribution(inp, m, "before")),
            _event(inp, "MigrationStarted", f"attempt {attempt}: {from_mode} -> {target.mode} ({where}); preflight"),
        ],
        "Preflight",
        "preflight requested",
        POLL_SECONDS,
    )


def abandon(inp: NodeInput, reason: str, message: str) -> Step:
    """Drop a migration that has not touched the node (Preflight) back to Pending."""
    m = inp.migration
    assert m is not None and m.phase in UNTOUCHED
    pending = _enter(inp, m, "Pending", reason=reason, message=clip(message))
    return Step(
        [
            _write(inp, pending, None, revision=inp.node.revision, mode=m.from_mode),
            _event(inp, reason, message),
        ],
        "Pending",
        message,
    )


# ---- one transition of an in-flight node ----


def step(inp: NodeInput) -> Step:
    m = inp.migration
    if m is None or m.phase not in IN_FLIGHT:
        # A phase this operator does not know (a newer one wrote it) is left alone, reported as not started.
        return Step([], m.phase if m is not None and is_phase(m.phase) else "Pending")
    handler = {
        "Preflight": _preflight,
        "Prepared": _prepared,
        "Cordon": _cordon,
        "Switch": _switch,
        "Gate": _gate,
        "Cleanup": _cleanup,
        "Verify": _gate,
        "Uncordon": _uncordon,
        "RollingBack": _rolling_back,
    }[m.phase]
    return handler(inp, m)


def _preflight(inp: NodeInput, m: NodeMigration) -> Step:
    op = inp.proxynode.spec.operation
    if op is None or not op.id.startswith(op_prefix(m, "Preflight")):
        # The start was recorded without its operation (or it was overwritten): ask again, same id.
        redo = _preflight_op(inp, m, inp.proxynode.spec.scheduler)
        return Step([_forward_write(inp, m, redo)], "Preflight", "preflight re-requested", POLL_SECONDS)
    res = _result(inp, op)
    if res is not None and res.state == "Succeeded":
        flushed = foreign_ipvs_accepted(res)
        told: list[Action] = []
        if flushed:
            # The user's virtual servers go with the switch: say which, durably (the migration record) and
            # where people look (a Warning Event on the node and the policy).
            m = m.model_copy(update={"foreign_ipvs_flushed": flushed})
            told = [_event(inp, "ForeignIPVSFlush", f"the switch to {m.to_mode} deletes IPVS virtual servers that are "
                           f"not kube-proxy's (accepted by gate.behaviour.allowChanges): {', '.join(flushed)}"
                           + _more(res, len(flushed)), warning=True)]
        if not inp.may_switch:
            # Prepared: nothing to write. The Event about foreign virtual servers waits for the switch
            # too, where the record that says it (foreign_ipvs_flushed) is written.
            return _wait_prepared(inp, m, f"preflight passed: {clip(res.message)}")
        nxt = _proceed(inp, m, f"preflight passed: {clip(res.message)}")
        return Step(told + nxt.actions, nxt.phase, nxt.message, nxt.requeue_after)
    if res is not None and res.state == "Failed":
        return _fail(inp, m, "PreflightFailed", f"preflight failed, node untouched: {res.message}")
    left = _time_left(inp, m)
    if left <= 0:
        return _fail(inp, m, "PreflightTimeout",
                     f"the agent did not report preflight {op.id} within {inp.spec.gate.timeout}; node untouched")
    state = res.state if res else "not started"
    return _wait("Preflight", f"waiting for the agent's preflight ({state})", min(POLL_SECONDS, left))


def _proceed(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    """The first step that touches the node: cordon, or straight to the switch."""
    m = m.model_copy(update={"touched_at": fmt(inp.now)})
    return _enter_cordon(inp, m) if inp.spec.rollout.cordon else _enter_switch(inp, m, why)


def _wait_prepared(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    """Preflight passed, no slot granted: wait without a write, or go back to Pending once the preflight is
    older than gate.timeout (it is a snapshot: the node's kernel, its Service behaviour). The age counts
    from the preflight's request (`phaseSince` of the Preflight record), a little before it ran."""
    left = remaining(m.phase_since, _timeout(inp), inp.now)
    if left <= 0:
        return abandon(inp, "PreflightExpired",
                       f"preflight passed, but it was taken more than {inp.spec.gate.timeout} ago and no slot "
                       "came free; it is taken again when one does")
    return _wait("Prepared", f"{why}; waiting for a free maxUnavailable slot", min(POLL_SECONDS, left))


def _prepared(inp: NodeInput, m: NodeMigration) -> Step:
    """A node an operator before this one recorded as Prepared (this one leaves the record at Preflight)."""
    if inp.may_switch:
        why = f"{m.message or 'preflight passed'}; a slot is free"
        return _proceed(inp, m.model_copy(update={"message": None}), why)
    return _wait_prepared(inp, m, m.message or "preflight passed")


def foreign_ipvs_accepted(res: OperationStatus) -> list[str]:
    """The foreign IPVS virtual servers a passed preflight accepted to lose (details.foreignIPVS), bounded."""
    found = res.result_as(PreflightResult).foreign_ipvs
    if found is None or not found.accepted:
        return []
    return [n[:VIRTUAL_SERVER_TEXT_LIMIT] for n in found.virtual_servers[:MAX_FOREIGN_VIRTUAL_SERVERS]]


def _more(res: OperationStatus, shown: int) -> str:
    found = res.result_as(PreflightResult).foreign_ipvs
    return f" and {found.count - shown} more" if found is not None and found.count > shown else ""


def _fail(inp: NodeInput, m: NodeMigration, reason: str, message: str) -> Step:
    failed = _enter(inp, m, "Failed", reason=reason, message=clip(message), finished_at=fmt(inp.now))
    return Step(
        [
            _write(inp, failed, None, revision=inp.node.revision, mode=m.from_mode),
            _event(inp, reason, message, warning=True),
        ],
        "Failed",
        message,
    )


def _enter_cordon(inp: NodeInput, m: NodeMigration) -> Step:
    # A node someone else cordoned stays theirs: we neither cordon nor uncordon it.
    ours = not inp.node.unschedulable
    nxt = _enter(inp, m, "Cordon", cordoned_by_us=ours)
    actions: list[Action] = [_forward_write(inp, nxt, None)]
    if ours:
        actions += [Cordon(node=inp.node.name, reason="Cordoned"), _event(inp, "Cordoned", "cordoned for the switch")]
    return Step(actions, "Cordon", "cordoning", POLL_SECONDS)


def _cordon(inp: NodeInput, m: NodeMigration) -> Step:
    if m.cordoned_by_us and not inp.node.unschedulable:
        return Step([Cordon(node=inp.node.name, reason="Cordoned")], "Cordon", "cordoning", POLL_SECONDS)
    actions: list[Action] = []
    if inp.spec.rollout.drain:
        limit = parse_duration(inp.spec.rollout.drain_timeout)
        if remaining(_step_since(inp, m), limit, inp.now) <= 0:
            # Nothing on the node changed but its schedulability: give that back, then fail.
            why = (f"pods could not be evicted within {inp.spec.rollout.drain_timeout} (a PodDisruptionBudget "
                   "refuses, or pods do not terminate); node untouched")
            nxt = _enter(inp, m, "Uncordon", reason="DrainTimeout", message=clip(why))
            give_back: list[Action] = [Uncordon(node=inp.node.name, reason="Uncordoned")] if m.cordoned_by_us else []
            return Step([_forward_write(inp, nxt, None), *give_back], "Uncordon", why, POLL_SECONDS)
        # The operator's Drain raises while PodDisruptionBudgets block evictions, which stops the
        # action list here: the switch is only recorded after the drain went through.
        actions.append(Drain(node=inp.node.name, reason="Drained"))
    switch = _enter_switch(inp, m, "node cordoned" + (" and drained" if inp.spec.rollout.drain else ""))
    return Step(actions + switch.actions, switch.phase, switch.message, switch.requeue_after)


def holds_rules(inp: NodeInput, m: NodeMigration) -> bool:
    """Whether the switch first asks the agent for a rule hold (agent/hold.py): only iptables <-> nftables,
    where the new kube-proxy deletes the old mode's rules before it has programmed its own."""
    return inp.spec.rollout.hold_rules and startup_cleanup_drops_old_rules(m.from_mode, m.to_mode)


def holds_ahead(inp: NodeInput, m: NodeMigration) -> bool:
    """Whether the preflight itself asks for the rule hold (PreflightParams.hold), so that the switch a slot
    grants moves the label at once: where the switch holds rules and follows the grant directly, and where the
    copy yields to the old kube-proxy's live rules while it waits (iptables -> nftables; from nftables the hold's
    nft table would run before kube-proxy's, serving every connection from a snapshot). With rollout.cordon the
    cordon and a drain (up to drainTimeout) come between: the switch asks, as before."""
    return holds_rules(inp, m) and not inp.spec.rollout.cordon and hold_yields_to_live_rules(m.from_mode)


def hold_ttl(inp: NodeInput, *, ahead: bool = False) -> timedelta:
    """How long a rule hold may live: the hold's wait, the switch and the gate each given gate.timeout and the
    reconnect grace of an API server outage (_step_since), then a rollback's return to the old kube-proxy.
    A hold made with the preflight (`ahead`) also covers the wait for a slot: the switch uses it only while
    the migration started at most gate.timeout ago (_held_ahead), and the hold was made after that start.

    Never the whole rollout: it is a copy that goes stale. It goes earlier as soon as any other kube-proxy
    has synced, which is how a switch or a rollback normally ends it, and as soon as the ProxyNode no longer
    names its migration in flight (the agent's hold.abandoned: the node went back to Pending or ended)."""
    step = _timeout(inp) + RECONNECT_GRACE
    ttl = 2 * step + timedelta(seconds=HOLD_WAIT_SECONDS + HOLD_ROLLBACK_SECONDS)
    return ttl + _timeout(inp) if ahead else ttl


def _hold_params(inp: NodeInput, m: NodeMigration, *, ahead: bool = False) -> HoldParams:
    return HoldParams(from_mode=m.from_mode, to_mode=m.to_mode,
                      ttl_seconds=int(hold_ttl(inp, ahead=ahead).total_seconds()))


def _hold_op(inp: NodeInput, m: NodeMigration) -> Operation:
    return Operation.request(op_id(m, "Hold", 0), _hold_params(inp, m))


def _held_ahead(inp: NodeInput, m: NodeMigration) -> tuple[str | None, str | None]:
    """(what the hold made with the preflight did, None: no usable hold; why a hold it made is gone, if it is).

    Usable: this migration's Preflight is the node's operation, it passed and made its hold, the agent's status
    still names that hold (a kube-proxy that restarted meanwhile ends it, as does a restarted agent), and the
    migration started at most gate.timeout ago (hold_ttl(ahead=True) counts on that)."""
    op = inp.proxynode.spec.operation
    if op is None or op.type != "Preflight" or not op.id.startswith(op_prefix(m, "Preflight")):
        return None, None
    res = _result(inp, op)
    made = res.result_as(PreflightResult).hold if res is not None and res.state == "Succeeded" else None
    if made is None or not made.ok:
        return None, None  # not asked (an older agent), or it failed: the switch asks for its own, as before
    status = inp.proxynode.status.hold
    if status is None or status.operation_id != op.id:
        return None, "the rule hold made with the preflight is gone (kube-proxy or the agent restarted since)"
    age = seconds_since(m.started_at, inp.now)
    if age is None or age > _timeout(inp).total_seconds():
        return None, None  # its time to live may not cover the switch and a rollback any more: a fresh one does
    return clip(made.message), None


def _forward_left(inp: NodeInput, m: NodeMigration) -> tuple[float, str]:
    """Seconds left for a forward step, and the limit in words: gate.timeout from the step's start
    (_time_left), but a held Switch or Gate never so late that a rollback would not find the rule hold in
    place. Only a run of API server outages stretches the steps that far; a hold gone before the old
    kube-proxy is back leaves the node with no Service rules at all."""
    left, limit = _time_left(inp, m), f"within {inp.spec.gate.timeout}"
    if m.phase in ("Switch", "Gate") and holds_rules(inp, m) and m.switched_at is not None:
        ttl = hold_ttl(inp)
        held = remaining(m.switched_at, ttl - timedelta(seconds=HOLD_ROLLBACK_SECONDS), inp.now)
        if held < left:
            left, limit = held, f"before the rule hold runs out ({int(ttl.total_seconds())}s)"
    return left, limit


def _enter_switch(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    nxt = _enter(inp, m, "Switch", switched_at=fmt(inp.now))
    if holds_rules(inp, m):
        held, lost = _held_ahead(inp, m)
        if held is None:
            # The label moves once the agent has answered: a hold made after the new kube-proxy
            # started would copy nothing.
            told = [_event(inp, "RuleHoldLost", f"{lost}; holding again before the switch", warning=True)] \
                if lost else []
            return Step([_forward_write(inp, nxt, _hold_op(inp, nxt)), *told], "Switch", "holding the old rules",
                        POLL_SECONDS)
        # The hold made with the preflight is in place: the label moves in this plan, no round trip.
        why = f"{why}; rules held since the preflight ({held})"
    step = _move_label(inp, nxt, why)
    return Step([_forward_write(inp, nxt, None), *step.actions], step.phase, step.message, step.requeue_after)


def _label(inp: NodeInput, revision: str | None, mode: str | None, *, reason: str) -> SetRevisionLabel:
    """The node's revision label and, in the same patch, its mode's replacement labels (Cilium's set for
    cilium-kpr, removed for a kube-proxy mode): kube-proxy leaves exactly when the replacement takes the node."""
    return SetRevisionLabel(node=inp.node.name, revision=revision, reason=reason,
                            labels=tuple(sorted(replacement_labels(mode).items())))


def _move_label(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    return Step(
        [
            _label(inp, m.to_revision, m.to_mode, reason="Switching"),
            _event(inp, "Switching", f"{why}; moving the node to {daemonset_for(m.to_revision)}"),
        ],
        "Switch",
        "switching",
        POLL_SECONDS,
    )


def _switch_hold(inp: NodeInput, m: NodeMigration) -> Step | None:
    """While the hold is asked for and not answered: the step that waits for it (None: go on)."""
    op = inp.proxynode.spec.operation
    if not holds_rules(inp, m) or op is None or not op.id.startswith(op_prefix(m, "Hold")):
        return None
    res = _result(inp, op)
    if res is not None and res.state == "Succeeded":
        return _move_label(inp, m, f"rules held ({clip(res.message)})")
    waited = seconds_since(m.phase_since, inp.now) or 0.0
    failed = res is not None and res.state == "Failed"
    if failed or waited >= HOLD_WAIT_SECONDS:
        # A missing hold costs at most the connections the node opens while kube-proxy starts:
        # not a reason to stop a migration that passed preflight.
        why = f"the rule hold failed ({clip(res.message if res else '')})" if failed \
            else f"the agent did not answer the rule hold within {HOLD_WAIT_SECONDS:.0f}s"
        step = _move_label(inp, m, f"{why}; switching without it")
        return Step([*step.actions, _event(inp, "RuleHoldSkipped", why, warning=True)], step.phase, step.message,
                    step.requeue_after)
    return _wait("Switch", "waiting for the agent's rule hold", POLL_SECONDS)


def _switch(inp: NodeInput, m: NodeMigration) -> Step:
    if inp.node.revision != m.to_revision:
        held = _switch_hold(inp, m)
        if held is not None:
            return held
        return Step([_label(inp, m.to_revision, m.to_mode, reason="Switching")],
                    "Switch", "moving the revision label", POLL_SECONDS)
    done, waiting, pod = _pod_swap(inp, m.from_revision, m.to_revision, m.to_mode)
    if done:
        return _enter_probe(inp, m, "Gate", "the new kube-proxy pod is Ready")
    if pod is not None and is_crash_looping(pod):
        return _start_rollback(inp, m, "KubeProxyCrashLooping",
                               f"the new kube-proxy pod {pod.name} restarted {pod.restarts} times without "
                               "becoming Ready (kube-proxy exits when its mode cannot run)")
    left, limit = _forward_left(inp, m)
    if left <= 0:
        return _start_rollback(inp, m, "SwitchTimeout", f"{waiting}, not done {limit}")
    return _wait("Switch", waiting, min(POLL_SECONDS, left))


def _probe_op(inp: NodeInput, m: NodeMigration, step_name: str, n: int) -> Operation:
    services, _ = _probe_services(inp)
    # The agent answers as soon as kube-proxy has synced (or after AGENT_AWAIT_SECONDS) instead of at
    # once: a probe sent while the new kube-proxy is still starting would otherwise cost a whole
    # PROBE_INTERVAL_SECONDS round. The gate still judges the answer; the wait only saves a round trip.
    mode = m.from_mode if step_name == "RollbackGate" else m.to_mode
    # Every probe after a switch (forward or back) clears un-NATed conntrack entries left from the gap;
    # only the forward gate compares Service behaviour with the matrix taken before the switch.
    # A node without kube-proxy has none to wait for: the replacement's own account is read instead.
    gate = step_name == "Gate"
    params = ProbeParams(services=services, await_mode=mode if runs_kube_proxy(mode) else None,
                         await_syncs=inp.spec.gate.min_syncs,
                         replacement=_replacement_params(inp, mode, frontends=True),
                         await_seconds=min(AGENT_AWAIT_SECONDS, _timeout(inp).total_seconds()),
                         conntrack=inp.conntrack, behaviour=_behaviour_sample(inp) if gate else None,
                         cleanup=_cleanup_in_gate(inp, m) if gate else None)
    return Operation.request(op_id(m, step_name, n), params)


def _cleanup_in_gate(inp: NodeInput, m: NodeMigration) -> CleanupParams | None:
    """The flush the gate's probe runs right after the first sync, or None: a Cleanup step follows the gate.

    Only where the new kube-proxy deleted the old mode's Service rules at its own start (iptables <->
    nftables): what is left of that mode serves no Service, so a rollback finds the node as it would
    without the flush. Elsewhere (iptables <-> ipvs, leaving Cilium's KPR) the stale rules may still
    carry traffic until the old kube-proxy is back, and they go only after the gate has passed."""
    if not (inp.spec.cleanup.stale_rules and inp.spec.cleanup.in_gate):
        return None
    if not startup_cleanup_drops_old_rules(m.from_mode, m.to_mode):
        return None
    to_mode = m.to_mode or ""
    remove = _modes_to_remove(inp, to_mode, m.from_mode if m.from_mode != m.to_mode else None)
    return CleanupParams(remove_modes=remove, target_mode=to_mode) if remove else None


def _enter_probe(inp: NodeInput, m: NodeMigration, phase: Phase, why: str) -> Step:
    nxt = _enter(inp, m, phase, message=None)
    return Step(
        [_forward_write(inp, nxt, _probe_op(inp, nxt, phase, 0)), _event(inp, phase, f"{why}; probing kube-proxy")],
        phase,
        "probing",
        POLL_SECONDS,
    )


def _probe_round(
    inp: NodeInput, m: NodeMigration, step_name: str, target_mode: str, since: str | None
) -> tuple[GateVerdict | None, Operation | None, float | None]:
    """Evaluate the current probe round: (verdict or None while the probe runs, next op to issue, wait)."""
    op = inp.proxynode.spec.operation
    prefix = op_prefix(m, step_name)
    if op is None or not op.id.startswith(prefix):
        return None, _probe_op(inp, m, step_name, 0), None
    res = _result(inp, op)
    if res is None or res.state == "Running":
        return None, None, POLL_SECONDS
    n = int(op.id.rsplit(".", 1)[1])
    _, unresolved = _probe_services(inp)
    switched = parse(since) or inp.now
    if unresolved:
        verdict = GateVerdict("wait", "ServiceNotFound", "no ClusterIP known for " + ", ".join(unresolved))
    elif res.state == "Failed":
        verdict = GateVerdict("wait", "ProbeFailed", f"the agent's probe failed: {clip(res.message)}")
    else:
        verdict = _judge_report(inp, op, res, target_mode, switched)
    if verdict.result != "wait":
        return verdict, None, None
    since_last = seconds_since(res.finished_at, inp.now)
    # finishedAt is the agent's clock. A result stamped in the future means the agent's clock is ahead of
    # ours and the result's age is unknown: pacing on it would hold the next probe until our clock caught
    # up (30 s of skew cost 33 s of the gate timeout). Probe again at once; the agent's round trip paces.
    if since_last is not None and 0 <= since_last < PROBE_INTERVAL_SECONDS:
        return verdict, None, PROBE_INTERVAL_SECONDS - since_last
    return verdict, _probe_op(inp, m, step_name, n + 1), None


def _judge_report(inp: NodeInput, op: Operation, res: OperationStatus, target_mode: str,
                  switched: datetime) -> GateVerdict:
    """The gate on an agent's answer (a Probe's, or a Cleanup's taken after its flush): kube-proxy's facts
    in the status and, when the gate asks, the connects to the Services the operation named."""
    if op.type == "Cleanup":
        cleanup = res.result_as(CleanupResult)
        expected, found, conntrack = op.params_as(CleanupParams).services, cleanup.connects, None
        sampled = False
    else:
        probe, probed = op.params_as(ProbeParams), res.result_as(ProbeResult)
        expected, found, conntrack = probe.services, probed.connects, probed.conntrack
        sampled = probe.behaviour is not None
    connects = _connects(found, expected) if inp.spec.gate.probe_services else None
    target_facts = facts_of(target_mode)
    replacement = target_facts.replacement if target_facts is not None else None
    if replacement is not None:
        # No kube-proxy on the node: its replacement proves itself by its own account (Cilium's API).
        verdict = evaluate_replacement_gate(inp.proxynode.status.replacement, inp.spec.gate, replacement.agent,
                                            inp.frontends[1], connects)
    else:
        verdict = evaluate_gate(inp.proxynode.status.kube_proxy, inp.spec.gate, target_mode, switched, inp.now,
                                connects)
    if verdict.passed and sampled:
        verdict = _judge_behaviour(inp, op, verdict)
    told = _conntrack_told(conntrack)
    return GateVerdict(verdict.result, verdict.reason, clip(f"{verdict.message}; {told}")) if told else verdict


def _conntrack_told(report: ConntrackReport | None) -> str | None:
    """What the probe's conntrack step deleted, for the gate's message (and so its Event); None: nothing."""
    if report is None:
        return None
    if report.error:
        return f"the conntrack step failed: {report.error}"
    if not report.deleted_tcp and not report.deleted_udp:
        return None
    return (f"deleted {report.deleted_tcp} TCP SYN_SENT and {report.deleted_udp} UDP un-NATed conntrack entries "
            "left from the switch's gap (clients that tried while the node had no Service rules)")


# A difference rolls the node back only when a later probe round still sees it, gate.behaviour.confirm
# after it was first seen (recorded in migration.behaviourDiffersSince): one cell timing out under load,
# or a Service down for a reason of its own, must not undo a good migration.
BEHAVIOUR_CONFIRM_ROUNDS = 2


def _judge_behaviour(inp: NodeInput, op: Operation, verdict: GateVerdict) -> GateVerdict:
    """kube-proxy has proven itself; now the node's Services must answer as they did before the switch."""
    m = inp.migration
    recorded = inp.proxynode.status.behaviour
    before = recorded.before if recorded else None
    after = recorded.after if recorded else None
    if m is None or before is None or not before.operation_id.startswith(op_prefix(m, "Preflight")):
        # An agent that predates the behaviour probe, or a preflight taken before the policy asked for it.
        return GateVerdict("pass", verdict.reason, f"{verdict.message}; Service behaviour not recorded before "
                           "the switch, not compared")
    if after is None or after.operation_id != op.id:
        return GateVerdict("pass", verdict.reason, f"{verdict.message}; the agent reported no Service behaviour "
                           "after the switch, not compared")
    allow = set(inp.spec.gate.behaviour.allow_changes or [])
    result = compare_matrices(before, after, allow, to_mode=m.to_mode or None)
    if not result.passed:
        lasted = seconds_since(m.behaviour_differs_since, inp.now)
        confirm = parse_duration(inp.spec.gate.behaviour.confirm).total_seconds()
        rounds = int(op.id.rsplit(".", 1)[1]) + 1
        confirmed = lasted is not None and lasted >= confirm and rounds >= BEHAVIOUR_CONFIRM_ROUNDS
        outcome: GateResult = "fail" if confirmed else "wait"
        why = result.reason if confirmed else f"{result.reason}; confirming for {inp.spec.gate.behaviour.confirm}"
        why = clip(why)
        return GateVerdict(outcome, "BehaviourChanged", why)  # the reason names the Service
    summary = f"{result.compared} Service cells answer as before"
    allowed = sorted({c.name for c in result.changes})
    if allowed:
        summary += "; allowed changes: " + ", ".join(allowed)
    return GateVerdict("pass", verdict.reason, f"{verdict.message}; {summary}")


def _gate(inp: NodeInput, m: NodeMigration) -> Step:
    phase: Phase = "Verify" if m.phase == "Verify" else "Gate"
    verdict, next_op, wait = _probe_round(inp, m, phase, m.to_mode or "", m.switched_at)
    if verdict is not None and verdict.result == "fail":
        return _start_rollback(inp, m, f"{phase}{verdict.reason}" if phase == "Verify" else verdict.reason,
                               f"{phase.lower()}: {verdict.message}")
    if verdict is not None and verdict.passed:
        return _after_gate(inp, m, verdict)
    left, limit = _forward_left(inp, m)
    waiting = verdict.message if verdict else _last_round_said(inp, m, phase)
    if left <= 0:
        reason = "GateTimeout" if phase == "Gate" else "VerifyTimeout"
        return _start_rollback(inp, m, reason, f"not proven {limit}: {waiting}")
    actions: list[Action] = []
    if next_op is not None:
        note = m.model_copy(update={"message": clip(waiting), "probe_said": clip(waiting),
                                    "behaviour_differs_since": _differs_since(inp, m, verdict)}) if verdict else m
        actions.append(_forward_write(inp, note, next_op))
    return Step(actions, phase, waiting, min(wait or POLL_SECONDS, left))


def _last_round_said(inp: NodeInput, m: NodeMigration, step_name: str) -> str:
    """While a probe round runs: what the round before it said (written to the record with this round's
    operation), so a timeout that lands while the agent waits on the node still names why it waited.
    A rollback keeps its own reason in `message`; only `probe_said` speaks for its rounds (a forward gate's
    record from an operator before probe_said has the words in `message` alone)."""
    op = inp.proxynode.spec.operation
    said = m.probe_said if step_name == "RollbackGate" else m.probe_said or m.message
    if op is not None and op.id.startswith(op_prefix(m, step_name)) and not op.id.endswith(".0") and said:
        return f"{said} (at the last probe's answer)"
    return "waiting for the agent's probe"


def _differs_since(inp: NodeInput, m: NodeMigration, verdict: GateVerdict) -> str | None:
    """Since when the Services answer differently. A round that waits for something else did not look at
    them, so it keeps what the last look said; a round that sees them answer as before passes the gate."""
    if verdict.reason != "BehaviourChanged":
        return m.behaviour_differs_since
    return m.behaviour_differs_since or fmt(inp.now)


def _after_gate(inp: NodeInput, m: NodeMigration, verdict: GateVerdict) -> Step:
    if m.phase == "Gate":
        flushed = _flushed_in_gate(inp)
        if flushed is not None and not flushed.ok:
            return _start_rollback(inp, m, "CleanupFailed", f"cleanup of stale rules failed: {flushed.message}")
        if flushed is not None:
            # The probe flushed before it connected and took the matrix: the gate judged the node as it stays.
            why = f"{verdict.message}; cleanup in the gate: {clip(flushed.message or '')}"
            step = _finish_forward(inp, m, why)
            # Told after the node's write (the agent waits on that one) and before how the node ended.
            write, *rest = step.actions
            return Step([write, _event(inp, "GatePassed", why), *rest], step.phase, step.message,
                        step.requeue_after)
        remove = _modes_to_remove(inp, m.to_mode or "", m.from_mode if m.from_mode != m.to_mode else None)
        if inp.spec.cleanup.stale_rules and remove:
            nxt = _enter(inp, m, "Cleanup", message=None)
            # The agent probes kube-proxy (and connects to the gate's Services) right after the flush, in
            # the same operation: that report is the verification, one write and one round trip fewer.
            services = _probe_services(inp)[0]
            op = Operation.request(op_id(nxt, "Cleanup", 0),
                                   CleanupParams(remove_modes=remove, target_mode=m.to_mode, services=services))
            return Step(
                [_forward_write(inp, nxt, op),
                 _event(inp, "GatePassed", f"{verdict.message}; cleaning up {', '.join(remove)} leftovers")],
                "Cleanup", "cleanup requested", POLL_SECONDS,
            )
    return _finish_forward(inp, m, verdict.message)


def _flushed_in_gate(inp: NodeInput) -> CleanupResult | None:
    """The flush the passing gate probe ran, or None: it was not asked to, or kube-proxy had not synced."""
    op = inp.proxynode.spec.operation
    if op is None or op.type != "Probe" or op.params_as(ProbeParams).cleanup is None:
        return None
    res = _result(inp, op)
    flushed = res.result_as(ProbeResult).cleanup if res is not None and res.state == "Succeeded" else None
    # An agent that knows no flush in a probe reports none: the Cleanup step follows, as before.
    return flushed if flushed is not None and flushed.ok is not None else None


def _finish_forward(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    if m.cordoned_by_us:
        nxt = _enter(inp, m, "Uncordon", message=None)
        return Step(
            [_forward_write(inp, nxt, None), Uncordon(node=inp.node.name, reason="Uncordoned")],
            "Uncordon", why, POLL_SECONDS,
        )
    return _done(inp, m, why)


def _done(inp: NodeInput, m: NodeMigration, why: str) -> Step:
    nxt = _enter(inp, m, "Done", message=None, reason=None, finished_at=fmt(inp.now))
    write = _write(inp, nxt, None, revision=nxt.to_revision, mode=nxt.to_mode, scheduler=inp.proxynode.spec.scheduler,
                   diagnose=_distribution(inp, nxt, "after"))
    return Step([write, _event(inp, "Migrated", f"now running {m.to_mode}: {why}")], "Done", why)


def _cleanup(inp: NodeInput, m: NodeMigration) -> Step:
    op = inp.proxynode.spec.operation
    if op is None or not op.id.startswith(op_prefix(m, "Cleanup")):
        return _after_gate(inp, m.model_copy(update={"phase": "Gate"}), GateVerdict("pass", "GatePassed", "resumed"))
    res = _result(inp, op)
    if res is not None and res.state == "Succeeded":
        verdict = _verify_from_cleanup(inp, m, op, res)
        if verdict is not None and verdict.result == "fail":
            return _start_rollback(inp, m, f"Verify{verdict.reason}", f"verify after cleanup: {verdict.message}")
        if verdict is not None and verdict.passed:
            return _finish_forward(inp, m, f"cleanup done ({clip(res.message)}), then {verdict.message}")
        return _enter_probe(inp, m, "Verify", f"cleanup done: {clip(res.message)}")
    if res is not None and res.state == "Failed":
        return _start_rollback(inp, m, "CleanupFailed", f"cleanup of stale rules failed: {res.message}")
    left = _time_left(inp, m)
    if left <= 0:
        return _start_rollback(inp, m, "CleanupTimeout",
                               f"the agent did not finish cleanup {op.id} within {inp.spec.gate.timeout}")
    return _wait("Cleanup", "waiting for the agent's cleanup", min(POLL_SECONDS, left))


def _verify_from_cleanup(inp: NodeInput, m: NodeMigration, op: Operation,
                         res: OperationStatus) -> GateVerdict | None:
    """The gate's verdict on what the agent saw right after its flush; None: probe again in Verify.

    An agent observes kube-proxy after every cleanup; one that predates the connect check reports no
    `connects`, and a Service without a ClusterIP cannot be checked: both fall back to a Verify probe,
    as does a verdict that is still "wait".
    """
    _, unresolved = _probe_services(inp)
    if unresolved or (op.params_as(CleanupParams).services and res.result_as(CleanupResult).connects is None):
        return None
    verdict = _judge_report(inp, op, res, m.to_mode or "", parse(m.switched_at) or inp.now)
    return None if verdict.result == "wait" else verdict


def _uncordon(inp: NodeInput, m: NodeMigration) -> Step:
    if m.cordoned_by_us and inp.node.unschedulable:
        return Step([Uncordon(node=inp.node.name, reason="Uncordoned")], "Uncordon", "uncordoning", POLL_SECONDS)
    if m.reason == "DrainTimeout":
        return _fail(inp, m, "DrainTimeout", m.message or "drain timed out; node untouched")
    return _done(inp, m, "uncordoned")


# ---- rollback ----


def _rollback_write(inp: NodeInput, m: NodeMigration, operation: Operation | None) -> SetMigration:
    return _write(inp, m, operation, revision=m.from_revision, mode=m.from_mode)


def _start_rollback(inp: NodeInput, m: NodeMigration, reason: str, message: str) -> Step:
    nxt = _enter(inp, m, "RollingBack", rollback_step="Label", reason=reason, message=clip(message))
    # Keep the agent's current operation in the spec: clearing it mid-run would not stop it, and the
    # Label step waits for it to finish before it moves the label.
    return Step(
        [_rollback_write(inp, nxt, inp.proxynode.spec.operation),
         _event(inp, reason, f"rolling back to {m.from_mode}: {message}", warning=True)],
        "RollingBack", message, 0.0,
    )


def _agent_busy(inp: NodeInput, m: NodeMigration) -> OperationStatus | None:
    """A cleanup of this attempt the agent is still running, while the agent is alive.

    Only a Cleanup rewrites kernel tables; Preflight and Probe read. An agent whose heartbeat is
    older than the gate timeout is not flushing anything, and the Label step clears
    spec.operation, so a restarted agent has nothing to resume.
    """
    last = inp.proxynode.status.last_operation
    attempt_prefix = f"{attempt_key(m)}."
    if last is None or last.state != "Running" or last.type != "Cleanup" or not last.id.startswith(attempt_prefix):
        return None
    silent = seconds_since(inp.proxynode.status.heartbeat, inp.now)
    if silent is not None and silent > _timeout(inp).total_seconds():
        return None
    return last


def _rolling_back(inp: NodeInput, m: NodeMigration) -> Step:
    sub = m.rollback_step or "Label"
    if sub == "Label":
        busy = _agent_busy(inp, m)
        if busy is not None:
            # Moving kube-proxy while the agent rewrites the same kernel tables would race it.
            return _wait("RollingBack", f"waiting for the agent to finish {busy.type} {busy.id} before rolling back")
        nxt = m.model_copy(update={"rollback_step": "Pod", "reverted_at": fmt(inp.now), "phase_since": fmt(inp.now)})
        actions: list[Action] = [_rollback_write(inp, nxt, None)]
        if inp.node.revision != m.from_revision:
            actions.append(_label(inp, m.from_revision, m.from_mode, reason="RollingBack"))
        return Step(actions, "RollingBack", "moving the node back", POLL_SECONDS)
    if sub == "Pod":
        if inp.node.revision != m.from_revision:
            return Step([_label(inp, m.from_revision, m.from_mode, reason="RollingBack")],
                        "RollingBack", "moving the revision label back", POLL_SECONDS)
        done, waiting, _ = _pod_swap(inp, m.to_revision, m.from_revision, m.from_mode)
        if not done:
            # No timeout: there is nowhere safer to go than the revision the node came from.
            return _wait("RollingBack", waiting)
        remove = _modes_to_remove(inp, m.from_mode or "", m.to_mode if m.to_mode != m.from_mode else None)
        if inp.spec.cleanup.stale_rules and remove:
            nxt = m.model_copy(update={"rollback_step": "Cleanup", "phase_since": fmt(inp.now)})
            cleanup = Operation.request(op_id(nxt, "RollbackCleanup", 0),
                                        CleanupParams(remove_modes=remove, target_mode=m.from_mode))
            return Step([_rollback_write(inp, nxt, cleanup)], "RollingBack", "cleaning up the target mode",
                        POLL_SECONDS)
        return _enter_rollback_gate(inp, m)
    if sub == "Cleanup":
        op = inp.proxynode.spec.operation
        res = _result(inp, op)
        finished = res is not None and res.state in ("Succeeded", "Failed")
        if not finished and _time_left(inp, m) > 0:
            return _wait("RollingBack", "waiting for the agent's cleanup of the target mode")
        # A failed cleanup leaves stale rules of a mode nobody runs: worth a note, not worth stopping.
        note = None if res is not None and res.state == "Succeeded" else clip(
            f"cleanup of {m.to_mode} leftovers did not succeed: {res.message if res else 'no answer'}")
        return _enter_rollback_gate(inp, m, note)
    if sub == "Gate":
        since = m.reverted_at
        facts, switched = inp.proxynode.status.kube_proxy, parse(m.switched_at)
        start = facts.process_start_time if facts is not None else None
        if start is not None and switched is not None and 0 < start < switched.timestamp():
            # The switch never took effect: the kube-proxy that ran before the migration still runs (its pod
            # was never replaced, e.g. the DaemonSet controller stalled and the switch timed out). That is the
            # process the node goes back to; judging it "since the revert" would call it old and fail a
            # healthy node. Judge it from its own start.
            since = fmt(datetime.fromtimestamp(start, UTC))
        verdict, next_op, wait = _probe_round(inp, m, "RollbackGate", m.from_mode or "", since)
        if verdict is not None and verdict.passed:
            if m.cordoned_by_us:
                nxt = m.model_copy(update={"rollback_step": "Uncordon", "phase_since": fmt(inp.now)})
                return Step([_rollback_write(inp, nxt, None), Uncordon(node=inp.node.name, reason="Uncordoned")],
                            "RollingBack", "uncordoning", POLL_SECONDS)
            return _rolled_back(inp, m)
        left = _time_left(inp, m)
        waiting = verdict.message if verdict else _last_round_said(inp, m, "RollbackGate")
        if (verdict is not None and verdict.result == "fail") or left <= 0:
            why = waiting if left > 0 else f"not proven within {inp.spec.gate.timeout}: {waiting}"
            failed = _enter(inp, m, "Failed", reason="RollbackGateFailed", finished_at=fmt(inp.now),
                            message=clip(f"rolled back after {m.reason}, but the old kube-proxy does not pass "
                                         f"the gate either ({why}); left cordoned if we cordoned it"))
            return Step([_rollback_write(inp, failed, None),
                         _event(inp, "RollbackGateFailed", failed.message or "", warning=True)], "Failed", why)
        # The round's words go with the next round (probe_said): the rollback's own reason stays in `message`.
        said = m.model_copy(update={"probe_said": clip(waiting)}) if verdict is not None else m
        probe: list[Action] = [_rollback_write(inp, said, next_op)] if next_op is not None else []
        return Step(probe, "RollingBack", waiting, min(wait or POLL_SECONDS, left))
    if sub == "Uncordon":
        if m.cordoned_by_us and inp.node.unschedulable:
            return Step([Uncordon(node=inp.node.name, reason="Uncordoned")], "RollingBack", "uncordoning",
                        POLL_SECONDS)
        return _rolled_back(inp, m)
    return Step([], "RollingBack", f"unknown rollback step {sub!r}")


def _enter_rollback_gate(inp: NodeInput, m: NodeMigration, note: str | None = None) -> Step:
    nxt = m.model_copy(update={"rollback_step": "Gate", "phase_since": fmt(inp.now)})
    if note:
        nxt = nxt.model_copy(update={"message": clip(f"{m.message}; {note}")})
    return Step([_rollback_write(inp, nxt, _probe_op(inp, nxt, "RollbackGate", 0))], "RollingBack",
                "probing the old kube-proxy", POLL_SECONDS)


def _rolled_back(inp: NodeInput, m: NodeMigration) -> Step:
    nxt = _enter(inp, m, "RolledBack", rollback_step=None, finished_at=fmt(inp.now))
    return Step(
        [_rollback_write(inp, nxt, None),
         _event(inp, "RolledBack", f"back on {m.from_mode} after {m.reason}: {m.message}", warning=True)],
        "RolledBack", m.message or "",
    )
