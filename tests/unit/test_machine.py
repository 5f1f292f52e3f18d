"""The per-node state machine, one transition at a time."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from simulator import T0, make_policy

from proxyshift.api.proxynode import (
    KubeProxyFacts,
    NodeMigration,
    Operation,
    OperationStatus,
    ProbeParams,
    ProxyNode,
    ProxyNodeSpec,
    ProxyNodeStatus,
    RuleHold,
)
from proxyshift.api.replacement import ReplacementFacts
from proxyshift.planner import machine
from proxyshift.planner.machine import NodeInput, Target
from proxyshift.planner.timeutil import fmt
from proxyshift.planner.world import (
    Cordon,
    Drain,
    Event,
    KubeProxyPodView,
    NodeView,
    SetMigration,
    SetRevisionLabel,
    Uncordon,
)

pytestmark = pytest.mark.unit

REV = "blue-0123abcd"
# Every move to a kube-proxy mode removes the kube-proxy replacement label in the same patch.
NO_REPLACEMENT = (("proxyshift.io/kube-proxy-replacement", None),)


def pod(ds: str, ready: bool = True, deleting: bool = False, restarts: int = 0) -> KubeProxyPodView:
    return KubeProxyPodView(node="n1", name=f"{ds}-x", daemonset=ds, ready=ready, running=True, deleting=deleting,
                            restarts=restarts)


def mig(phase: str, **kw: Any) -> NodeMigration:
    base: dict[str, Any] = {"phase": phase, "phase_since": fmt(T0), "from_revision": None, "from_mode": "iptables",
            "to_revision": REV, "to_mode": "nftables", "attempt": 1, "switched_at": fmt(T0)}
    base.update(kw)
    return NodeMigration(**base)


def inp(
    m: NodeMigration | None = None, *, label: str | None = None, pods: list[KubeProxyPodView] | None = None,
    op: Operation | None = None, last: OperationStatus | None = None, facts: KubeProxyFacts | None = None,
    unschedulable: bool = False, now_plus: float = 1.0, leftovers: list[str] | None = None, **policy_kw: Any,
) -> NodeInput:
    labels = {"pool": "blue"} | ({"proxyshift.io/revision": label} if label else {})
    pn = ProxyNode(metadata={"name": "n1"},
                   spec=ProxyNodeSpec(policy="blue", revision=REV, mode="nftables", migration=m, operation=op),
                   status=ProxyNodeStatus(last_operation=last, kube_proxy=facts, leftovers=leftovers or []))
    return NodeInput(policy="blue", spec=make_policy("blue", **policy_kw).spec,
                     node=NodeView("n1", labels, unschedulable=unschedulable), proxynode=pn,
                     pods=pods if pods is not None else [pod("kube-proxy")], now=T0 + timedelta(seconds=now_plus))


def done(op: Operation, state: Literal["Running", "Succeeded", "Failed"] = "Succeeded", message: str = "ok",
         **details: Any) -> OperationStatus:
    return OperationStatus(id=op.id, type=op.type, state=state, message=message, details=details,
                           finished_at=fmt(T0))


def writes(step: machine.Step) -> list[SetMigration]:
    return [a for a in step.actions if isinstance(a, SetMigration)]


def record_of(write: SetMigration) -> NodeMigration:
    """The migration record a write carries (every write these tests look into has one)."""
    assert write.migration is not None
    return write.migration


def migration_of(step: machine.Step) -> NodeMigration:
    """The record of the step's first migration write."""
    return record_of(writes(step)[0])


def operation_of(step: machine.Step) -> Operation:
    """The operation of the step's first migration write (the tests that call it expect one)."""
    operation = writes(step)[0].operation
    assert operation is not None
    return operation


def test_start_records_migration_and_deterministic_preflight() -> None:
    step = machine.start(inp(), Target(REV, "nftables"), from_mode="iptables", generation=3, retry_token="a")
    (w,) = writes(step)
    assert w.migration is not None and w.operation is not None
    assert w.migration.phase == "Preflight" and w.migration.attempt == 1 and w.migration.generation == 3
    assert w.migration.started_at == "2026-11-30T12:00:01Z"
    assert w.operation.id == f"{REV}.1.20261130120001.Preflight.0" and w.operation.params["mode"] == "nftables"
    again = machine.start(inp(), Target(REV, "nftables"), from_mode="iptables", generation=3, retry_token="a")
    assert writes(again)[0].operation == w.operation  # a restarted operator asks for the same id


def test_attempts_never_repeat_an_operation_id() -> None:
    failed = mig("Failed", attempt=4)
    step = machine.start(inp(failed), Target(REV, "nftables"), from_mode="iptables", generation=1, retry_token=None)
    assert operation_of(step).id == f"{REV}.5.20261130120001.Preflight.0"


def test_a_new_policy_on_a_released_node_never_reuses_an_operation_id() -> None:
    # A released node starts again at attempt 1 under the next policy; the start time keeps ids apart.
    first = machine.start(inp(), Target(REV, "nftables"), from_mode="iptables", generation=1, retry_token=None)
    later = machine.start(inp(now_plus=300), Target(REV, "nftables"), from_mode="iptables", generation=1,
                          retry_token=None)
    assert migration_of(first).attempt == migration_of(later).attempt == 1
    assert operation_of(first).id != operation_of(later).id


def test_preflight_waits_then_switches_intent_first() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    assert machine.step(inp(m, op=op)).actions == []
    step = machine.step(inp(m, op=op, last=done(op), rollout={"holdRules": False}))
    assert step.phase == "Switch"
    kinds = [type(a) for a in step.actions]
    # The record goes first: after a crash between the two, the phase says "re-label".
    assert kinds.index(SetMigration) < kinds.index(SetRevisionLabel)
    label = next(a for a in step.actions if isinstance(a, SetRevisionLabel))
    assert label.revision == REV


def test_a_preflight_that_passes_without_a_slot_waits_prepared_and_writes_nothing() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    waiting = dataclasses.replace(inp(m, op=op, last=done(op, message="kernel 6.1")), may_switch=False)
    step = machine.step(waiting)
    # Prepared is the record as it stands (Preflight, its operation answered Succeeded): no write, no touch.
    assert step.phase == "Prepared" and step.actions == [] and "kernel 6.1" in step.message
    assert machine.is_prepared(waiting.proxynode)
    later = dataclasses.replace(inp(m, op=op, last=done(op), now_plus=60), may_switch=False)
    assert machine.step(later).actions == [] and machine.step(later).phase == "Prepared"


def test_only_the_migration_s_own_passed_preflight_makes_it_prepared() -> None:
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    other = Operation(id=f"{REV}.0.0.Preflight.0", type="Preflight")  # an earlier attempt's
    assert not machine.is_prepared(inp(mig("Preflight"), op=op).proxynode)  # not answered
    assert not machine.is_prepared(inp(mig("Preflight"), op=op, last=done(op, state="Running")).proxynode)
    assert not machine.is_prepared(inp(mig("Preflight"), op=op, last=done(op, state="Failed")).proxynode)
    assert not machine.is_prepared(inp(mig("Preflight"), op=other, last=done(other)).proxynode)
    assert not machine.is_prepared(inp(mig("Gate"), op=op, last=done(op)).proxynode)
    assert machine.is_prepared(inp(mig("Prepared"), op=op, last=done(op)).proxynode)  # an older operator's record


def test_a_prepared_node_switches_once_granted_a_slot_in_one_write() -> None:
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    for record in (mig("Preflight"), mig("Prepared", message="preflight passed: ok")):  # this and older operators
        step = machine.step(inp(record, op=op, last=done(op), rollout={"holdRules": False}, now_plus=30))
        assert step.phase == "Switch"
        assert [a.revision for a in step.actions if isinstance(a, SetRevisionLabel)] == [REV]
        assert len(writes(step)) == 1
        switching = writes(step)[0].migration
        assert switching is not None
        assert switching.message is None and switching.touched_at == fmt(T0 + timedelta(seconds=30))
        cordoned = machine.step(inp(record, op=op, last=done(op), rollout={"cordon": True}))
        assert cordoned.phase == "Cordon" and any(isinstance(a, Cordon) for a in cordoned.actions)


def test_a_prepared_node_that_waited_past_the_gate_timeout_goes_back_to_pending() -> None:
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    # gate.timeout 2m; the wait counts from the preflight's request (the Preflight record's phaseSince).
    for record in (mig("Preflight"), mig("Prepared")):
        fresh = dataclasses.replace(inp(record, op=op, last=done(op), now_plus=119), may_switch=False)
        assert machine.step(fresh).phase == "Prepared" and machine.step(fresh).requeue_after == 1.0
        stale = dataclasses.replace(inp(record, op=op, last=done(op), now_plus=121), may_switch=False)
        step = machine.step(stale)
        assert step.phase == "Pending" and migration_of(step).reason == "PreflightExpired"
        assert writes(step)[0].operation is None and writes(step)[0].revision is None  # back where it was
        assert not any(isinstance(a, SetRevisionLabel | Cordon) for a in step.actions)


def test_iptables_to_nftables_holds_the_old_rules_before_the_label_moves() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    step = machine.step(inp(m, op=op, last=done(op)))
    # Intent and the hold request in one write; the label waits for the agent's answer.
    assert step.phase == "Switch" and [type(a) for a in step.actions] == [SetMigration]
    hold = writes(step)[0].operation
    assert hold is not None
    assert hold.type == "Hold" and hold.id == f"{REV}.1.0.Hold.0"
    assert hold.params["fromMode"] == "iptables" and hold.params["toMode"] == "nftables"
    assert hold.params["ttlSeconds"] >= 2 * 120  # outlives the gate, bounded
    switching = writes(step)[0].migration
    assert machine.step(inp(switching, op=hold)).actions == []  # agent not done yet: wait
    running = done(hold, "Running")
    assert machine.step(inp(switching, op=hold, last=running)).actions == []
    moved = machine.step(inp(switching, op=hold, last=done(hold, message="25 chains copied")))
    assert [type(a) for a in moved.actions] == [SetRevisionLabel, Event] and moved.phase == "Switch"
    assert "25 chains copied" in next(a for a in moved.actions if isinstance(a, Event)).message


def test_a_failed_or_unanswered_hold_does_not_stop_the_switch() -> None:
    m = mig("Switch")
    hold = Operation(id=f"{REV}.1.0.Hold.0", type="Hold")
    failed = machine.step(inp(m, op=hold, last=done(hold, "Failed", "iptables-restore: exit 4")))
    kinds = [type(a) for a in failed.actions]
    assert SetRevisionLabel in kinds and failed.phase == "Switch"
    warning = [a for a in failed.actions if isinstance(a, Event) and a.reason == "RuleHoldSkipped"]
    assert warning and warning[0].type == "Warning" and "exit 4" in warning[0].message
    silent = machine.step(inp(m, op=hold, now_plus=machine.HOLD_WAIT_SECONDS + 1))
    assert SetRevisionLabel in [type(a) for a in silent.actions]
    assert machine.step(inp(m, op=hold, now_plus=machine.HOLD_WAIT_SECONDS - 1)).actions == []


# ---- the rule hold made with the preflight (PreflightParams.hold) ----

STARTED = mig("Preflight", started_at=fmt(T0), switched_at=None)
PREFLIGHT = Operation(id=machine.op_id(STARTED, "Preflight", 0), type="Preflight")
HOLD_AT_SWITCH = machine.op_id(STARTED, "Hold", 0)


def held_ahead(m: NodeMigration | None = None, *, hold: str = "ok", status_id: str | None = PREFLIGHT.id,
               may_switch: bool = True, **kw: Any) -> NodeInput:
    """A node whose preflight passed and made its hold (`hold`: "ok", "failed" or "none": not asked) and whose
    agent reports the hold of `status_id` (None: no hold)."""
    details: dict[str, Any] = {} if hold == "none" else {
        "hold": {"ok": hold == "ok", "message": f"rule hold install: {hold}"}}
    i = inp(m or STARTED, op=PREFLIGHT,
            last=done(PREFLIGHT, message="kernel 6.1", **details), **kw)
    i.proxynode.status.hold = RuleHold(operation_id=status_id, expires=fmt(T0 + timedelta(minutes=10))) \
        if status_id else None
    return dataclasses.replace(i, may_switch=may_switch)


def test_the_preflight_asks_for_the_hold_where_the_switch_follows_the_grant() -> None:
    def hold_asked(mode: str = "nftables", from_mode: str = "iptables", **rollout: Any) -> dict[str, Any] | None:
        start = machine.start(inp(rollout=rollout), Target(REV, mode), from_mode=from_mode, generation=1,
                              retry_token=None)
        return operation_of(start).params.get("hold")

    made = inp()
    ttl = machine.hold_ttl(made, ahead=True)
    assert hold_asked() == {"fromMode": "iptables", "toMode": "nftables", "ttlSeconds": int(ttl.total_seconds())}
    # It also outlives the wait for a slot (gate.timeout at most, from the start) on top of the switch's hold.
    assert ttl == machine.hold_ttl(made) + timedelta(minutes=2)
    # From nftables the hold's nft table would hook before the live kube-proxy's: made only at the switch.
    assert hold_asked("iptables", "nftables") is None
    assert hold_asked(cordon=True) is None        # cordon and a drain come between: the switch asks
    assert hold_asked(holdRules=False) is None
    assert hold_asked("ipvs") is None and hold_asked("nftables", "ipvs") is None  # nothing deletes the rules


def test_a_prepared_node_keeps_its_hold_without_a_write_and_its_granted_switch_moves_the_label_at_once() -> None:
    waiting = held_ahead(may_switch=False)
    assert machine.is_prepared(waiting.proxynode)
    step = machine.step(waiting)
    assert step.phase == "Prepared" and step.actions == []  # untouched, nothing written: it disrupts nothing
    granted = machine.step(held_ahead(now_plus=30))
    kinds = [type(a) for a in granted.actions]
    assert kinds == [SetMigration, SetRevisionLabel, Event] and granted.phase == "Switch"
    record = migration_of(granted)
    assert record.phase == "Switch" and record.switched_at == fmt(T0 + timedelta(seconds=30))
    assert record.touched_at == record.switched_at and writes(granted)[0].operation is None
    told = next(a for a in granted.actions if isinstance(a, Event))
    assert told.reason == "Switching" and "rules held since the preflight (rule hold install: ok)" in told.message
    # The switch's later plans see no Hold to wait for: the label is all that is left to (re)do.
    again = machine.step(inp(record, op=None))
    assert [type(a) for a in again.actions] == [SetRevisionLabel]


@pytest.mark.parametrize(("case", "kw", "lost"), [
    ("gone", {"status_id": None}, True),                           # kube-proxy or the agent restarted
    ("another", {"status_id": HOLD_AT_SWITCH.replace(".1.", ".0.")}, True),  # not the preflight's hold
    ("failed", {"hold": "failed"}, False),
    ("not asked", {"hold": "none"}, False),                        # an agent older than params.hold
    ("too old", {"now_plus": 121}, False),                         # its time to live may not cover the switch
])
def test_without_a_usable_hold_from_the_preflight_the_switch_asks_for_one(case: str, kw: dict[str, Any],
                                                                         lost: bool) -> None:
    step = machine.step(held_ahead(**kw))
    assert step.phase == "Switch" and SetRevisionLabel not in [type(a) for a in step.actions], case
    assert operation_of(step).id == HOLD_AT_SWITCH and operation_of(step).params["ttlSeconds"] == int(
        machine.hold_ttl(inp()).total_seconds())
    warned = [a for a in step.actions if isinstance(a, Event) and a.reason == "RuleHoldLost"]
    assert bool(warned) is lost, case  # a hold the agent dropped is said, never claimed
    if lost:
        assert warned[0].type == "Warning" and "gone" in warned[0].message
    # From there on as before: the label moves on the agent's answer, or without it after HOLD_WAIT_SECONDS.
    switching = migration_of(step)
    hold = operation_of(step)
    moved = machine.step(inp(switching, op=hold, last=done(hold, message="9 chains copied"), now_plus=122))
    assert [type(a) for a in moved.actions] == [SetRevisionLabel, Event]


def test_a_prepared_node_that_expires_goes_back_to_pending_and_its_hold_with_it() -> None:
    """The operator's part of an abandon: the record leaves flight (Pending), which is what the agent reads to
    drop the hold (agent/hold.abandoned); the same for Halted, Paused and Superseded (planner.py)."""
    from proxyshift.agent.hold import abandoned

    step = machine.step(held_ahead(may_switch=False, now_plus=121))
    record = migration_of(step)
    assert step.phase == "Pending" and record.reason == "PreflightExpired" and writes(step)[0].operation is None
    assert abandoned(PREFLIGHT.id, record)
    assert not abandoned(PREFLIGHT.id, held_ahead().proxynode.spec.migration)


def test_no_hold_where_kube_proxy_keeps_the_old_rules_or_when_turned_off() -> None:
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    for m, rollout in [(mig("Preflight", from_mode="iptables", to_mode="ipvs"), {}),
                       (mig("Preflight", from_mode="ipvs", to_mode="nftables"), {}),
                       (mig("Preflight"), {"holdRules": False})]:
        step = machine.step(inp(m, op=op, last=done(op), rollout=rollout))
        assert SetRevisionLabel in [type(a) for a in step.actions], (m.from_mode, m.to_mode, rollout)
        assert writes(step)[0].operation is None


def test_preflight_failure_touches_nothing() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    step = machine.step(inp(m, op=op, last=done(op, "Failed", "ip_vs_mh missing")))
    assert step.phase == "Failed"
    assert not any(isinstance(a, SetRevisionLabel | Cordon) for a in step.actions)
    assert migration_of(step).reason == "PreflightFailed"
    assert "ip_vs_mh missing" in (migration_of(step).message or "")


def test_preflight_timeout_when_agent_silent() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    step = machine.step(inp(m, op=op, now_plus=121))
    assert step.phase == "Failed" and migration_of(step).reason == "PreflightTimeout"


def test_cordon_only_when_schedulable_and_drain_before_switch() -> None:
    m = mig("Preflight")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    step = machine.step(inp(m, op=op, last=done(op), rollout={"cordon": True, "drain": True}))
    assert step.phase == "Cordon" and any(isinstance(a, Cordon) for a in step.actions)
    assert migration_of(step).cordoned_by_us is True
    theirs = machine.step(inp(m, op=op, last=done(op), unschedulable=True, rollout={"cordon": True}))
    assert not any(isinstance(a, Cordon) for a in theirs.actions)
    assert migration_of(theirs).cordoned_by_us is False
    cordoned = mig("Cordon", cordoned_by_us=True)
    step = machine.step(inp(cordoned, unschedulable=True, rollout={"cordon": True, "drain": True}))
    kinds = [type(a) for a in step.actions]
    assert kinds[0] is Drain and step.phase == "Switch"
    assert writes(step)[0].operation is not None and operation_of(step).type == "Hold"


def test_switch_waits_for_old_pod_gone_and_new_pod_ready() -> None:
    m = mig("Switch")
    both = [pod("kube-proxy", deleting=True), pod(f"kube-proxy-{REV}", ready=False)]
    assert machine.step(inp(m, label=REV, pods=both)).phase == "Switch"
    assert machine.step(inp(m, label=REV, pods=[pod(f"kube-proxy-{REV}", ready=False)])).phase == "Switch"
    step = machine.step(inp(m, label=REV, pods=[pod(f"kube-proxy-{REV}")]))
    assert step.phase == "Gate" and operation_of(step).id == f"{REV}.1.0.Gate.0"


def test_switch_relabels_after_crash_between_record_and_label() -> None:
    step = machine.step(inp(mig("Switch"), label=None))
    assert step.actions == [SetRevisionLabel(node="n1", revision=REV, reason="Switching", labels=NO_REPLACEMENT)]


def test_crashlooping_new_pod_rolls_back() -> None:
    step = machine.step(inp(mig("Switch"), label=REV, pods=[pod(f"kube-proxy-{REV}", ready=False, restarts=3)]))
    assert step.phase == "RollingBack" and migration_of(step).reason == "KubeProxyCrashLooping"


def test_switch_timeout_rolls_back() -> None:
    step = machine.step(inp(mig("Switch"), label=REV, pods=[pod(f"kube-proxy-{REV}", ready=False)], now_plus=121))
    assert step.phase == "RollingBack" and migration_of(step).reason == "SwitchTimeout"


def test_a_switch_that_outlasted_an_api_server_outage_gets_its_whole_timeout_after_the_api_came_back() -> None:
    grace = machine.RECONNECT_GRACE.total_seconds()
    timeout = 120  # the test policy's gate.timeout (2m): 121 s after the node entered the step is past it
    waiting = inp(mig("Switch"), label=REV, pods=[pod(f"kube-proxy-{REV}", ready=False)], now_plus=121)
    # The API server came back 30 s ago: the DaemonSet controller's watches are still backing off.
    back = dataclasses.replace(waiting, api_back_at=waiting.now - timedelta(seconds=30))
    step = machine.step(back)
    assert step.phase == "Switch" and not writes(step)
    # An outage that settled (came back, plus the grace) before the node entered the step changes nothing.
    before = dataclasses.replace(waiting, api_back_at=T0 - timedelta(seconds=grace + 5))
    assert migration_of(machine.step(before)).reason == "SwitchTimeout"
    # Back shortly before the node entered the step: the grace still runs into it.
    just_before = dataclasses.replace(waiting, api_back_at=T0 - timedelta(seconds=5))
    assert not writes(machine.step(just_before))
    # Once the grace and then the whole timeout have passed since the API server came back, it times out.
    long_back = dataclasses.replace(waiting, api_back_at=waiting.now - timedelta(seconds=grace + timeout + 1))
    assert migration_of(machine.step(long_back)).reason == "SwitchTimeout"


def test_every_step_timeout_counts_from_the_api_server_s_return() -> None:
    probe_op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={})
    cases = {"Preflight": "PreflightTimeout", "Gate": "GateTimeout", "Cleanup": "CleanupTimeout"}
    for phase, reason in cases.items():
        op = probe_op if phase == "Gate" else Operation(id=f"{REV}.1.0.{phase}.0",
                                                        type="Preflight" if phase == "Preflight" else "Cleanup",
                                                        params={})
        late = inp(mig(phase), label=REV, pods=[pod(f"kube-proxy-{REV}")], op=op, now_plus=121)
        assert any(record_of(w).reason == reason for w in writes(machine.step(late))), phase
        back = dataclasses.replace(late, api_back_at=late.now - timedelta(seconds=10))
        assert not any(record_of(w).reason == reason for w in writes(machine.step(back))), phase


def test_a_held_gate_stretched_by_api_server_outages_rolls_back_while_the_hold_still_stands() -> None:
    """The CI run of 3 December: a crash-looping target kube-proxy never synced, the API server had come back
    just before, so the gate ran 85 s of its 30 s; the hold, then 80 s, went first and the node's own
    connections failed for 4 s until the rollback's kube-proxy synced. The hold now covers both steps'
    reconnect grace and a rollback, and a gate stretched further still rolls back before the hold goes."""
    probe = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={})
    gate = inp(mig("Gate", phase_since=fmt(T0 + timedelta(seconds=1))), label=REV, pods=[pod(f"kube-proxy-{REV}")],
               op=probe, gate={"timeout": "30s"}, now_plus=86)
    ttl = machine.hold_ttl(gate).total_seconds()
    assert ttl >= 2 * (30 + machine.RECONNECT_GRACE.total_seconds()) + machine.HOLD_WAIT_SECONDS
    # That run: back 25 s after the gate began, so the gate's 30 s count from 60 s later; the hold stands.
    stretched = dataclasses.replace(gate, api_back_at=T0 + timedelta(seconds=25))
    assert not writes(machine.step(stretched))
    # Outage after outage: the gate gives up HOLD_ROLLBACK_SECONDS before the hold's end, not at it.
    last_call = ttl - machine.HOLD_ROLLBACK_SECONDS
    for now_plus, rolls_back in ((last_call - 1, False), (last_call + 0.5, True)):
        late = dataclasses.replace(inp(mig("Gate"), label=REV, pods=[pod(f"kube-proxy-{REV}")], op=probe,
                                       gate={"timeout": "30s"}, now_plus=now_plus),
                                   api_back_at=T0 + timedelta(seconds=now_plus - 10))
        found = [record_of(w) for w in writes(machine.step(late)) if record_of(w).reason == "GateTimeout"]
        assert bool(found) == rolls_back, now_plus
    assert "before the rule hold runs out" in (found[0].message or "")
    # Without a hold (holdRules off, or ipvs) nothing but the timeout and its grace decides.
    unheld = dataclasses.replace(late, spec=make_policy("blue", gate={"timeout": "30s"},
                                                        rollout={"holdRules": False}).spec)
    assert not writes(machine.step(unheld))


def test_a_held_switch_that_never_ends_rolls_back_while_the_hold_still_stands() -> None:
    ttl = machine.hold_ttl(inp(gate={"timeout": "30s"})).total_seconds()
    now_plus = ttl - machine.HOLD_ROLLBACK_SECONDS + 1
    late = inp(mig("Switch"), label=REV, pods=[pod(f"kube-proxy-{REV}", ready=False)], gate={"timeout": "30s"},
               now_plus=now_plus)
    step = machine.step(dataclasses.replace(late, api_back_at=late.now - timedelta(seconds=5)))
    (w,) = [w for w in writes(step) if record_of(w).reason == "SwitchTimeout"]
    assert w.migration is not None
    assert "before the rule hold runs out" in (record_of(w).message or "")


@settings(max_examples=200, deadline=None)
@given(timeout=st.integers(min_value=5, max_value=900), phase=st.sampled_from(["Switch", "Gate"]),
       entered=st.floats(min_value=0, max_value=600),
       back=st.one_of(st.none(), st.floats(min_value=-100, max_value=2000)),
       after=st.floats(min_value=0, max_value=4000))
def test_no_held_forward_step_outlives_its_hold_less_a_rollback(timeout: int, phase: str, entered: float,
                                                                 back: float | None, after: float) -> None:
    """Whatever the API server did, a held node in Switch or Gate starts its rollback by the time only
    HOLD_ROLLBACK_SECONDS of its rule hold are left (times in seconds after the switch)."""
    probe = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={})
    step_in = inp(mig(phase, phase_since=fmt(T0 + timedelta(seconds=entered))), label=REV, op=probe,
                  pods=[pod(f"kube-proxy-{REV}", ready=phase == "Gate")], gate={"timeout": f"{timeout}s"},
                  now_plus=entered + after)
    if back is not None:
        step_in = dataclasses.replace(step_in, api_back_at=T0 + timedelta(seconds=back))
    rolled_back = any(record_of(w).phase == "RollingBack" for w in writes(machine.step(step_in)))
    if entered + after >= (machine.hold_ttl(step_in).total_seconds() - machine.HOLD_ROLLBACK_SECONDS):
        assert rolled_back


def _good_facts() -> KubeProxyFacts:
    t = T0.timestamp()
    return KubeProxyFacts(proxy_mode="nftables", healthz_status=200, process_start_time=t + 1,
                          last_sync_timestamp=t + 2, sync_count=2, sync_failures=0, sync_duration_p99_seconds=0.1)


def test_gate_pass_leads_to_cleanup_of_the_mode_left() -> None:
    m = mig("Gate")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    step = machine.step(inp(m, label=REV, pods=[pod(f"kube-proxy-{REV}")], op=op, last=done(op), facts=_good_facts(),
                            leftovers=["ipvs"]))
    assert step.phase == "Cleanup"
    cleanup = writes(step)[0].operation
    assert cleanup is not None
    assert cleanup.type == "Cleanup" and cleanup.params == {"removeModes": ["iptables", "ipvs"],
                                                            "targetMode": "nftables"}


IN_GATE = {"removeModes": ["iptables"], "targetMode": "nftables"}


@pytest.mark.parametrize(("from_mode", "to_mode", "spec", "asked"), [
    ("iptables", "nftables", {}, IN_GATE),
    ("nftables", "iptables", {}, {"removeModes": ["nftables"], "targetMode": "iptables"}),
    ("iptables", "nftables", {"cleanup": {"inGate": False}}, None),
    ("iptables", "nftables", {"cleanup": {"staleRules": False}}, None),
    # kube-proxy in ipvs mode deletes no iptables rules at its start: they may carry traffic until the gate.
    ("iptables", "ipvs", {}, None),
])
def test_the_gate_probe_flushes_only_where_the_new_kube_proxy_already_dropped_the_old_rules(
        from_mode: str, to_mode: str, spec: dict[str, Any], asked: dict[str, Any] | None) -> None:
    m = mig("Gate", from_mode=from_mode, to_mode=to_mode)
    step = machine.step(inp(m, label=REV, mode=to_mode, extra_spec=spec))
    assert operation_of(step).type == "Probe"
    assert operation_of(step).params.get("cleanup") == asked


def test_the_verify_and_rollback_probes_flush_nothing() -> None:
    verify = machine.step(inp(mig("Verify"), label=REV))
    assert operation_of(verify).type == "Probe" and "cleanup" not in operation_of(verify).params
    back = mig("RollingBack", rollback_step="Pod", from_mode="iptables")
    step = machine.step(inp(back, label=None, pods=[pod("kube-proxy")]))
    assert "cleanup" not in operation_of(step).params


def _gate_probe_answered(cleanup: dict[str, Any] | None, **kw: Any) -> machine.Step:
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={"awaitMode": "nftables", "cleanup": IN_GATE})
    last = done(op, cleanup=cleanup) if cleanup is not None else done(op)
    return machine.step(inp(mig("Gate"), label=REV, pods=[pod(f"kube-proxy-{REV}")], op=op,
                            last=last, facts=_good_facts(), **kw))


def test_a_gate_that_flushed_in_its_probe_finishes_the_node_without_a_cleanup_step() -> None:
    step = _gate_probe_answered({"ok": True, "message": "iptables: 12 chains removed", "steps": []})
    assert step.phase == "Done" and migration_of(step).phase == "Done"
    assert writes(step)[0].operation is None
    assert "cleanup in the gate: iptables: 12 chains removed" in step.message


def test_a_gate_probe_whose_flush_failed_rolls_the_node_back() -> None:
    step = _gate_probe_answered({"ok": False, "message": "iptables-restore: exit 1"})
    record = migration_of(step)
    assert step.phase == "RollingBack" and record.reason == "CleanupFailed"
    assert "iptables-restore: exit 1" in (record.message or "")


def test_a_gate_probe_that_did_not_flush_is_followed_by_the_cleanup_step() -> None:
    """kube-proxy had not synced when the agent looked (no flush), or an agent that predates the flush in the
    probe: the gate's pass leads to the Cleanup step as before."""
    answers: list[dict[str, Any] | None] = [None, {"steps": []}]  # none; one without `ok` (not this agent's shape)
    for answered in answers:
        step = _gate_probe_answered(answered)
        assert step.phase == "Cleanup" and operation_of(step).type == "Cleanup"


def test_the_cleanup_report_is_the_verification_when_it_proves_the_node() -> None:
    m = mig("Cleanup")
    op = Operation(id=f"{REV}.1.0.Cleanup.0", type="Cleanup", params={"removeModes": ["iptables"]})
    step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=_good_facts()))
    assert step is not None
    assert step.phase == "Done" and migration_of(step).phase == "Done"
    assert writes(step)[0].operation is None  # no Verify probe: one write, one round trip fewer


def test_a_cleanup_report_that_cannot_prove_the_node_falls_back_to_a_verify_probe() -> None:
    m = mig("Cleanup")
    op = Operation(id=f"{REV}.1.0.Cleanup.0", type="Cleanup", params={"removeModes": ["iptables"]})
    not_synced = _good_facts().model_copy(update={"sync_count": 0})
    for facts in (not_synced, None):
        step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=facts))
        assert step.phase == "Verify" and operation_of(step).id == f"{REV}.1.0.Verify.0"


def test_a_cleanup_report_that_shows_a_broken_node_rolls_back_as_a_failed_verify() -> None:
    m = mig("Cleanup")
    op = Operation(id=f"{REV}.1.0.Cleanup.0", type="Cleanup", params={"removeModes": ["iptables"]})
    wrong = _good_facts().model_copy(update={"proxy_mode": "iptables"})
    step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=wrong))
    assert step.phase == "RollingBack" and migration_of(step).reason == "VerifyWrongMode"


def test_the_cleanup_carries_the_gate_services_and_its_connects_decide() -> None:
    gate = {"probeServices": [{"namespace": "default", "name": "web", "port": 80}]}
    gated = mig("Gate")
    probe = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={"services": ["198.19.0.10:80"]})
    ips = {"default/web": "198.19.0.10"}
    base = inp(gated, label=REV, op=probe, last=done(probe, connects={"198.19.0.10:80": True}),
               facts=_good_facts(), gate=gate)
    step = machine.step(NodeInput(**{**base.__dict__, "service_ips": ips}))
    cleanup = writes(step)[0].operation
    assert cleanup is not None
    assert step.phase == "Cleanup" and cleanup.params["services"] == ["198.19.0.10:80"]

    def after(last: OperationStatus) -> machine.Step:
        b = inp(mig("Cleanup"), label=REV, op=cleanup, last=last, facts=_good_facts(), gate=gate)
        return machine.step(NodeInput(**{**b.__dict__, "service_ips": ips}))

    assert after(done(cleanup, connects={"198.19.0.10:80": True})).phase == "Done"
    # An agent from before the connect check reports none: probe again rather than judge without them.
    assert after(done(cleanup)).phase == "Verify"


def test_no_cleanup_when_mode_unchanged() -> None:
    m = mig("Gate", from_mode="nftables", from_revision="blue-old")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=_good_facts()))
    assert step.phase == "Done"


def test_gate_wait_probes_again_with_next_id() -> None:
    m = mig("Gate")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    syncing = _good_facts().model_copy(update={"sync_count": 0})
    step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=syncing, now_plus=5))
    assert step.phase == "Gate" and operation_of(step).id == f"{REV}.1.0.Gate.1"
    assert "rule syncs" in step.message
    timed_out = machine.step(inp(m, label=REV, op=op, last=done(op), facts=syncing, now_plus=121))
    assert timed_out.phase == "RollingBack" and migration_of(timed_out).reason == "GateTimeout"


def test_gate_fail_rolls_back_with_reason() -> None:
    m = mig("Gate")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    wrong = _good_facts().model_copy(update={"proxy_mode": "iptables"})
    step = machine.step(inp(m, label=REV, op=op, last=done(op), facts=wrong))
    assert step.phase == "RollingBack" and migration_of(step).reason == "WrongMode"
    assert writes(step)[0].revision is None  # the spec now points back at where the node came from


def test_rollback_waits_for_running_agent_operation_before_moving_label() -> None:
    op = Operation(id=f"{REV}.1.0.Cleanup.0", type="Cleanup")
    running = OperationStatus(id=op.id, type="Cleanup", state="Running")
    m = mig("RollingBack", rollback_step="Label", reason="CleanupTimeout")
    step = machine.step(inp(m, label=REV, op=op, last=running))
    assert step.actions == [] and "finish" in step.message
    step = machine.step(inp(m, label=REV, op=op, last=done(op)))
    label = [a for a in step.actions if isinstance(a, SetRevisionLabel)]
    assert label == [SetRevisionLabel(node="n1", revision=None, reason="RollingBack", labels=NO_REPLACEMENT)]


def test_rollback_to_a_previous_revision_and_uncordon_only_ours() -> None:
    m = mig("RollingBack", rollback_step="Pod", from_revision="blue-old", from_mode="iptables",
            cordoned_by_us=True, reverted_at=fmt(T0))
    old_ds = "kube-proxy-blue-old"
    assert machine.step(inp(m, label="blue-old", pods=[pod(old_ds, ready=False)])).phase == "RollingBack"
    step = machine.step(inp(m, label="blue-old", pods=[pod(old_ds)]))
    assert operation_of(step).type == "Cleanup"
    assert operation_of(step).params == {"removeModes": ["nftables"], "targetMode": "iptables"}
    gate = mig("RollingBack", rollback_step="Gate", from_revision="blue-old", cordoned_by_us=True,
               reverted_at=fmt(T0))
    op = Operation(id=f"{REV}.1.0.RollbackGate.0", type="Probe")
    facts = _good_facts().model_copy(update={"proxy_mode": "iptables"})
    step = machine.step(inp(gate, label="blue-old", op=op, last=done(op), facts=facts, unschedulable=True))
    assert any(isinstance(a, Uncordon) for a in step.actions)
    not_ours = gate.model_copy(update={"cordoned_by_us": False})
    step = machine.step(inp(not_ours, label="blue-old", op=op, last=done(op), facts=facts, unschedulable=True))
    assert step.phase == "RolledBack" and not any(isinstance(a, Uncordon) for a in step.actions)


def test_uncordon_phase_only_uncordons_what_we_cordoned() -> None:
    step = machine.step(inp(mig("Uncordon", cordoned_by_us=True), label=REV, unschedulable=True))
    assert step.actions == [Uncordon(node="n1", reason="Uncordoned")]
    step = machine.step(inp(mig("Uncordon", cordoned_by_us=False), label=REV, unschedulable=True))
    assert step.phase == "Done" and not any(isinstance(a, Uncordon) for a in step.actions)


def test_probe_services_resolved_to_cluster_ips() -> None:
    m = mig("Gate")
    gate = {"probeServices": [{"namespace": "default", "name": "web", "port": 80}]}
    base = inp(m, label=REV, gate=gate)
    unresolved = machine.step(base)
    assert operation_of(unresolved).params["services"] == []
    resolved = NodeInput(**{**base.__dict__, "service_ips": {"default/web": "198.19.0.10"}})
    assert operation_of(machine.step(resolved)).params["services"] == ["198.19.0.10:80"]


def test_probes_ask_the_agent_to_wait_for_the_mode_they_gate() -> None:
    forward = writes(machine.step(inp(mig("Gate"), label=REV, gate={"minSyncs": 2})))[0].operation
    assert forward is not None
    assert forward.params | {"services": []} == {"services": [], "awaitMode": "nftables", "awaitSyncs": 2,
                                                 "awaitSeconds": machine.AGENT_AWAIT_SECONDS,
                                                 "cleanup": {"removeModes": ["iptables"], "targetMode": "nftables"}}
    back = mig("RollingBack", rollback_step="Pod", from_mode="iptables")
    step = machine.step(inp(back, label=None, pods=[pod("kube-proxy")], extra_spec={"cleanup": {"staleRules": False}}))
    assert operation_of(step).params["awaitMode"] == "iptables"


def test_rollback_does_not_wait_for_a_read_only_probe_or_a_dead_agent() -> None:
    m = mig("RollingBack", rollback_step="Label", reason="GateTimeout")
    probe = Operation(id=f"{REV}.1.0.Gate.7", type="Probe")
    running_probe = OperationStatus(id=probe.id, type="Probe", state="Running")
    step = machine.step(inp(m, label=REV, op=probe, last=running_probe))
    assert SetRevisionLabel(node="n1", revision=None, reason="RollingBack", labels=NO_REPLACEMENT) in step.actions
    assert writes(step)[0].operation is None  # a restarted agent finds nothing to resume

    cleanup = Operation(id=f"{REV}.1.0.Cleanup.0", type="Cleanup")
    running = OperationStatus(id=cleanup.id, type="Cleanup", state="Running")
    alive = inp(m, label=REV, op=cleanup, last=running)
    alive.proxynode.status.heartbeat = fmt(T0)
    assert machine.step(alive).actions == []
    dead = inp(m, label=REV, op=cleanup, last=running, now_plus=600)
    dead.proxynode.status.heartbeat = fmt(T0)
    assert any(isinstance(a, SetRevisionLabel) for a in machine.step(dead).actions)


def test_a_drain_blocked_past_its_timeout_gives_the_node_back_and_fails_it_untouched() -> None:
    rollout = {"cordon": True, "drain": True, "drainTimeout": "30s"}
    cordoned = mig("Cordon", cordoned_by_us=True)
    waiting = machine.step(inp(cordoned, unschedulable=True, now_plus=29, rollout=rollout))
    assert isinstance(waiting.actions[0], Drain)
    late = machine.step(inp(cordoned, unschedulable=True, now_plus=31, rollout=rollout))
    assert late.phase == "Uncordon" and [type(a) for a in late.actions] == [SetMigration, Uncordon]
    assert not any(isinstance(a, Drain | SetRevisionLabel) for a in late.actions)
    giving_back = writes(late)[0].migration
    assert giving_back is not None
    assert giving_back.reason == "DrainTimeout" and "30s" in (giving_back.message or "")
    # Still cordoned (the uncordon has not landed): uncordon again, then fail.
    assert [type(a) for a in machine.step(inp(giving_back, unschedulable=True, rollout=rollout)).actions] == \
        [Uncordon]
    failed = machine.step(inp(giving_back, unschedulable=False, rollout=rollout))
    assert failed.phase == "Failed" and migration_of(failed).reason == "DrainTimeout"
    assert writes(failed)[0].mode == "iptables" and writes(failed)[0].revision is None  # where it was


def test_a_drain_timeout_never_uncordons_a_node_someone_else_cordoned() -> None:
    rollout = {"cordon": True, "drain": True, "drainTimeout": "30s"}
    theirs = mig("Cordon", cordoned_by_us=False)
    late = machine.step(inp(theirs, unschedulable=True, now_plus=31, rollout=rollout))
    assert not any(isinstance(a, Uncordon) for a in late.actions)
    assert machine.step(inp(writes(late)[0].migration, unschedulable=True, rollout=rollout)).phase == "Failed"


def test_an_agent_clock_ahead_does_not_hold_back_the_next_gate_probe() -> None:
    # The agent stamps finishedAt with its own clock. 30 s ahead of the operator, the result looks like it
    # comes from the future; the next probe must not wait until the operator's clock catches up (33 s,
    # more than half a typical gate timeout) but go out as if the result had just arrived.
    m = mig("Gate")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    syncing = _good_facts().model_copy(update={"sync_count": 0})
    ahead = done(op).model_copy(update={"finished_at": fmt(T0 + timedelta(seconds=31))})
    step = machine.step(inp(m, label=REV, op=op, last=ahead, facts=syncing, now_plus=1))
    assert step.phase == "Gate"
    issued = [w.operation.id for w in writes(step) if w.operation is not None]
    assert issued == [f"{REV}.1.0.Gate.1"] or (step.requeue_after is not None
                                               and step.requeue_after <= machine.PROBE_INTERVAL_SECONDS), step
    # However far ahead the agent is, the operator never sits longer than one probe interval on a result.
    later = machine.step(inp(m, label=REV, op=op, last=ahead, facts=syncing,
                             now_plus=1 + machine.PROBE_INTERVAL_SECONDS))
    assert [w.operation.id for w in writes(later) if w.operation is not None] == [f"{REV}.1.0.Gate.1"], later


def test_a_rollback_whose_switch_never_took_effect_accepts_the_kube_proxy_that_never_stopped() -> None:
    # Found by tests/reliability (API server restarted at Switch): the old pod was never replaced, the switch
    # timed out and rolled back, and the rollback gate called the untouched old kube-proxy "old" and failed it.
    m = mig("RollingBack", rollback_step="Gate", from_revision="blue-old", from_mode="iptables",
            switched_at=fmt(T0), reverted_at=fmt(T0 + timedelta(seconds=60)))
    op = Operation(id=f"{REV}.1.0.RollbackGate.0", type="Probe")
    t = (T0 - timedelta(seconds=50)).timestamp()  # started before the migration, never stopped
    never_stopped = KubeProxyFacts(proxy_mode="iptables", healthz_status=200, process_start_time=t,
                                   last_sync_timestamp=(T0 + timedelta(seconds=61)).timestamp(), sync_count=20,
                                   sync_failures=0, sync_duration_p99_seconds=0.1)
    step = machine.step(inp(m, label="blue-old", pods=[pod("kube-proxy-blue-old")], op=op, last=done(op),
                            facts=never_stopped, now_plus=62))
    assert step.phase == "RolledBack", step
    # A kube-proxy that restarted after the switch but before the revert is still judged since the revert.
    restarted = never_stopped.model_copy(update={"process_start_time": (T0 + timedelta(seconds=30)).timestamp()})
    step = machine.step(inp(m, label="blue-old", pods=[pod("kube-proxy-blue-old")], op=op, last=done(op),
                            facts=restarted, now_plus=62))
    assert step.phase == "RollingBack" and "before the switch" in step.message, step


# Cilium's kube-proxy replacement (issue 19): the node is handed over by labels, and no kube-proxy pod comes.

KPR_LABEL = "proxyshift.io/kube-proxy-replacement"


def test_a_switch_to_cilium_kpr_hands_the_node_to_cilium_in_the_revision_label_patch() -> None:
    m = mig("Preflight", to_mode="cilium-kpr")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    step = machine.step(inp(m, op=op, last=done(op), mode="cilium-kpr"))
    assert step.phase == "Switch"
    label = [a for a in step.actions if isinstance(a, SetRevisionLabel)]
    assert label == [SetRevisionLabel(node="n1", revision=REV, reason="Switching", labels=((KPR_LABEL, "cilium"),))]
    # No rule hold: nothing of kube-proxy's deletes the old rules before Cilium serves the node.
    assert not any(w.operation is not None and w.operation.type == "Hold" for w in writes(step))


def test_a_cilium_kpr_switch_waits_for_the_old_kube_proxy_to_go_and_for_no_new_one() -> None:
    m = mig("Switch", to_mode="cilium-kpr")
    waiting = machine.step(inp(m, label=REV, pods=[pod("kube-proxy")], mode="cilium-kpr"))
    assert waiting.phase == "Switch" and "old kube-proxy pod kube-proxy-x to go away" in waiting.message
    gone = machine.step(inp(m, label=REV, pods=[], mode="cilium-kpr"))
    assert gone.phase == "Gate"
    # The gate's probe waits for no kube-proxy: it reads Cilium's API, at the default socket, for the frontends.
    probe = operation_of(gone).params_as(ProbeParams)
    assert probe.await_mode is None and probe.replacement is not None
    assert probe.replacement.socket_path == "/var/run/cilium/cilium.sock"


def test_a_failed_cilium_kpr_node_gets_its_kube_proxy_back_and_loses_the_label() -> None:
    m = mig("RollingBack", rollback_step="Label", to_mode="cilium-kpr", reason="GateTimeout")
    step = machine.step(inp(m, label=REV, pods=[], mode="cilium-kpr"))
    label = [a for a in step.actions if isinstance(a, SetRevisionLabel)]
    assert label == [SetRevisionLabel(node="n1", revision=None, reason="RollingBack", labels=NO_REPLACEMENT)]
    pod_step = mig("RollingBack", rollback_step="Pod", to_mode="cilium-kpr", reverted_at=fmt(T0))
    # No timeout while the baseline kube-proxy comes back: there is nowhere safer to go.
    later = machine.step(inp(pod_step, label=None, pods=[], mode="cilium-kpr", now_plus=3600))
    assert later.phase == "RollingBack" and "waiting for a kube-proxy pod" in later.message
    back = machine.step(inp(pod_step, label=None, pods=[pod("kube-proxy")], mode="cilium-kpr"))
    assert operation_of(back).params == {"removeModes": ["cilium-kpr"], "targetMode": "iptables"}


def test_a_node_leaving_cilium_kpr_loses_the_label_with_its_move_and_gets_it_back_on_rollback() -> None:
    m = mig("Switch", from_revision="kpr-1", from_mode="cilium-kpr", to_mode="nftables")
    step = machine.step(inp(m, label="kpr-1", pods=[]))
    assert [a for a in step.actions if isinstance(a, SetRevisionLabel)] == [
        SetRevisionLabel(node="n1", revision=REV, reason="Switching", labels=NO_REPLACEMENT)]
    back = mig("RollingBack", rollback_step="Label", from_revision="kpr-1", from_mode="cilium-kpr",
               to_mode="nftables", reason="GateTimeout")
    step = machine.step(inp(back, label=REV, pods=[pod(f"kube-proxy-{REV}")]))
    assert [a for a in step.actions if isinstance(a, SetRevisionLabel)] == [
        SetRevisionLabel(node="n1", revision="kpr-1", reason="RollingBack", labels=((KPR_LABEL, "cilium"),))]
    # Back on Cilium's revision: done once the target's kube-proxy pod is gone (no pod of its own to wait for).
    pods_step = back.model_copy(update={"rollback_step": "Pod", "reverted_at": fmt(T0)})
    assert "go away" in machine.step(inp(pods_step, label="kpr-1", pods=[pod(f"kube-proxy-{REV}")])).message
    gone = machine.step(inp(pods_step, label="kpr-1", pods=[]))
    assert operation_of(gone).params == {"removeModes": ["nftables"], "targetMode": "cilium-kpr"}


def _on_cilium(node_input: NodeInput, facts: ReplacementFacts | None) -> NodeInput:
    """The node input with Cilium's account in the ProxyNode's status, as the agent's probe wrote it."""
    status = node_input.proxynode.status.model_copy(update={"replacement": facts})
    return dataclasses.replace(node_input, proxynode=node_input.proxynode.model_copy(update={"status": status}),
                               frontends=(("198.19.0.10:80/TCP",), 3))


CILIUM_KPR_OK = ReplacementFacts(agent_state="Ok", kube_proxy_replacement="True", enabled=True,
                                 cluster_ip_frontends=3)


def test_the_gate_of_a_cilium_kpr_node_judges_cilium_and_then_cleans_kube_proxys_objects() -> None:
    m = mig("Gate", to_mode="cilium-kpr")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    # kube-proxy's facts (there are none on such a node) do not matter; Cilium's account does.
    passed = machine.step(_on_cilium(inp(m, label=REV, pods=[], op=op, last=done(op), mode="cilium-kpr"),
                                     CILIUM_KPR_OK))
    assert passed.phase == "Cleanup"
    assert operation_of(passed).params == {"removeModes": ["iptables"], "targetMode": "cilium-kpr"}
    off = CILIUM_KPR_OK.model_copy(update={"enabled": False, "kube_proxy_replacement": "False"})
    waiting = machine.step(_on_cilium(inp(m, label=REV, pods=[], op=op, last=done(op), mode="cilium-kpr"), off))
    assert waiting.phase == "Gate" and "has not read the revision's node config" in waiting.message
    short = CILIUM_KPR_OK.model_copy(update={"cluster_ip_frontends": 2})
    late = machine.step(_on_cilium(inp(m, label=REV, pods=[], op=op, last=done(op), mode="cilium-kpr",
                                       now_plus=400), short))
    assert late.phase == "RollingBack" and migration_of(late).reason == "GateTimeout"
    assert "holds 2 ClusterIP frontends, the cluster's Services have 3" in (migration_of(late).message or "")


def test_a_gate_timeout_during_a_running_probe_names_what_the_last_answer_said() -> None:
    """The agent waits on the node (up to AGENT_AWAIT_SECONDS) for the replacement to prove itself; a timeout
    that lands while it waits still says why the node did not pass, from the answer before."""
    said = "Cilium answers but its kube-proxy replacement is 'False': its agent on the node has not read it"
    m = mig("Gate", to_mode="cilium-kpr", message=said)
    op = Operation(id=f"{REV}.1.0.Gate.3", type="Probe")
    late = machine.step(inp(m, label=REV, pods=[], op=op, last=done(op, state="Running"), mode="cilium-kpr",
                            now_plus=400))
    assert late.phase == "RollingBack" and migration_of(late).reason == "GateTimeout"
    assert said in (migration_of(late).message or "")
    # Before any answer there is nothing to name.
    first = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    early = machine.step(inp(mig("Gate", to_mode="cilium-kpr", message="switched"), label=REV, pods=[], op=first,
                             last=done(first, state="Running"), mode="cilium-kpr", now_plus=400))
    assert "waiting for the agent's probe" in (migration_of(early).message or "")


def test_a_rollback_onto_cilium_kpr_is_proven_by_cilium_too() -> None:
    back = mig("RollingBack", rollback_step="Gate", from_revision="kpr-1", from_mode="cilium-kpr",
               to_mode="nftables", reverted_at=fmt(T0))
    op = Operation(id=f"{REV}.1.0.RollbackGate.0", type="Probe")
    step = machine.step(_on_cilium(inp(back, label="kpr-1", pods=[], op=op, last=done(op)), CILIUM_KPR_OK))
    assert step.phase == "RolledBack"


MODE_NAMES = st.sampled_from(["iptables", "ipvs", "nftables", "cilium-kpr"])


@settings(max_examples=60, deadline=None)
@given(from_mode=MODE_NAMES, to_mode=MODE_NAMES, from_revision=st.sampled_from([None, "blue-old"]))
def test_the_replacement_label_always_follows_the_revision_the_node_is_moved_to(
        from_mode: str, to_mode: str, from_revision: str | None) -> None:
    """Forward or back, the label patch hands the node to Cilium exactly when its revision runs no kube-proxy:
    never a kube-proxy node with Cilium's label, never a Cilium node without it."""
    expected = {"cilium-kpr": ((KPR_LABEL, "cilium"),)}
    forward = machine.step(inp(mig("Switch", from_mode=from_mode, to_mode=to_mode, from_revision=from_revision),
                               label=from_revision, pods=[]))
    (switch,) = [a for a in forward.actions if isinstance(a, SetRevisionLabel)]
    assert (switch.revision, switch.labels) == (REV, expected.get(to_mode, NO_REPLACEMENT))
    back = machine.step(inp(mig("RollingBack", rollback_step="Label", from_mode=from_mode, to_mode=to_mode,
                                from_revision=from_revision, reason="GateTimeout"), label=REV, pods=[]))
    (undo,) = [a for a in back.actions if isinstance(a, SetRevisionLabel)]
    assert (undo.revision, undo.labels) == (from_revision, expected.get(from_mode, NO_REPLACEMENT))


def test_a_rollback_gate_timeout_names_what_the_last_probe_said() -> None:
    # The rollback keeps its own reason in `message`; the rounds' words go to probe_said, so a timeout that lands
    # while the agent holds a round open still says why the old kube-proxy did not pass.
    m = mig("RollingBack", rollback_step="Gate", reason="GateTimeout", message="gate: not proven within 2m",
            from_revision="blue-old", reverted_at=fmt(T0))
    first = Operation(id=f"{REV}.1.0.RollbackGate.0", type="Probe")
    unhealthy = _good_facts().model_copy(update={"proxy_mode": "iptables", "healthz_status": 503})
    step = machine.step(inp(m, label="blue-old", pods=[pod("kube-proxy-blue-old")], op=first, last=done(first),
                            facts=unhealthy, now_plus=1 + machine.PROBE_INTERVAL_SECONDS))
    (write,) = writes(step)
    assert write.operation is not None and write.operation.id == f"{REV}.1.0.RollbackGate.1"
    said = record_of(write).probe_said
    assert said and "503" in said, said
    assert record_of(write).message == "gate: not proven within 2m"  # the rollback's reason stays
    second = write.operation
    running = record_of(write)
    late = machine.step(inp(running, label="blue-old", pods=[pod("kube-proxy-blue-old")], op=second,
                            last=done(second, "Running"), facts=unhealthy, now_plus=3600))
    assert late.phase == "Failed", late
    failed = record_of(writes(late)[0])
    assert failed.reason == "RollbackGateFailed"
    assert f"{said} (at the last probe's answer)" in (failed.message or ""), failed.message
    assert failed.probe_said is None  # a finished record carries no round's words


def test_entering_a_phase_drops_the_last_phase_probe_words() -> None:
    m = mig("Gate", probe_said="kube-proxy has not synced since the switch")
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe")
    step = machine.step(inp(m, label=REV, pods=[pod("kube-proxy-" + REV)], op=op, last=done(op),
                            facts=_good_facts(), now_plus=30))
    assert step.phase != "Gate", step
    assert all(record_of(w).probe_said is None for w in writes(step))
