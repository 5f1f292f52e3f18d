"""The state machine's use of the Service-behaviour matrix: taken with the preflight, compared in the gate."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from simulator import T0
from test_machine import REV, _good_facts, done, inp, mig, operation_of, pod, record_of, writes

from proxyshift.api.behaviour import (
    AddressRole,
    BehaviourCell,
    BehaviourMatrix,
    BehaviourParams,
    BehaviourTarget,
    ConntrackParams,
    NodeBehaviour,
    Outcome,
)
from proxyshift.api.diagnostics import DiagnoseRequest, DiagnoseService
from proxyshift.api.proxynode import Operation
from proxyshift.planner import machine
from proxyshift.planner.machine import NodeInput, Target
from proxyshift.planner.timeutil import fmt
from proxyshift.planner.world import Event

pytestmark = pytest.mark.unit

SAMPLE = BehaviourParams(targets=[BehaviourTarget(service="web/np", kind="NodePort", port=30080)],
                         node_ips=["198.18.0.11"])
CONNTRACK = ConntrackParams(service_cidrs=["198.19.0.0/16"])
PREFLIGHT_ID = f"{REV}.1.0.Preflight.0"


def cell(address: str, role: AddressRole, outcome: Outcome = "answered") -> BehaviourCell:
    return BehaviourCell(service="web/np", kind="NodePort", protocol="TCP", port=30080, address=address,
                         address_role=role, path="node", outcome=outcome,
                         endpoints=["198.18.1.1"] if outcome == "answered" else [])


BEFORE = BehaviourMatrix(operation_id=PREFLIGHT_ID, mode="iptables",
                         cells=[cell("198.18.0.11", "nodeIP"), cell("127.0.0.1", "localhost")])


def after(op_id: str, localhost: Outcome = "answered") -> BehaviourMatrix:
    return BehaviourMatrix(operation_id=op_id, mode="nftables",
                           cells=[cell("198.18.0.11", "nodeIP"), cell("127.0.0.1", "localhost", localhost)])


def with_behaviour(base: NodeInput, before: BehaviourMatrix | None, later: BehaviourMatrix | None) -> NodeInput:
    pn = base.proxynode.model_copy(deep=True)
    pn.status.behaviour = NodeBehaviour(before=before, after=later)
    return replace(base, proxynode=pn, behaviour=SAMPLE, conntrack=CONNTRACK)


def gate_step(n: int, later: BehaviourMatrix | None, before: BehaviourMatrix | None = BEFORE,
              differs_since: float | None = None, **policy: Any) -> machine.Step:
    """One gate step 30 s after T0; `differs_since`: seconds after T0 the gate first saw a difference."""
    op = Operation(id=f"{REV}.1.0.Gate.{n}", type="Probe",
                   params={"behaviour": SAMPLE.model_dump(by_alias=True, mode="json")})
    since = fmt(T0 + timedelta(seconds=differs_since)) if differs_since is not None else None
    base = inp(mig("Gate", behaviour_differs_since=since), label=REV, pods=[pod(f"kube-proxy-{REV}")], op=op,
               last=done(op), facts=_good_facts(), now_plus=30, **policy)
    return machine.step(with_behaviour(base, before, later))


def test_the_preflight_asks_for_the_matrix_and_only_when_there_is_a_sample() -> None:
    start = machine.start(replace(inp(), behaviour=SAMPLE), Target(REV, "nftables"), from_mode="iptables",
                          generation=1, retry_token=None)
    params = operation_of(start).params
    assert BehaviourParams.model_validate(params["behaviour"]) == SAMPLE
    plain = machine.start(inp(), Target(REV, "nftables"), from_mode="iptables", generation=1, retry_token=None)
    assert "behaviour" not in operation_of(plain).params


def test_the_gate_probe_carries_the_sample_and_the_conntrack_step_the_rollback_probe_only_conntrack() -> None:
    base = replace(inp(mig("Gate")), behaviour=SAMPLE, conntrack=CONNTRACK)
    gate = machine._probe_op(base, mig("Gate"), "Gate", 0)
    assert "behaviour" in gate.params and gate.params["conntrack"]["serviceCidrs"] == ["198.19.0.0/16"]
    back = machine._probe_op(base, mig("RollingBack"), "RollbackGate", 0)
    assert "behaviour" not in back.params and "conntrack" in back.params


def said(step: machine.Step) -> str:
    """What the step tells a person: its Events and its message."""
    return " | ".join([a.message for a in step.actions if isinstance(a, Event)] + [step.message])


def test_an_unchanged_matrix_passes_the_gate() -> None:
    step = gate_step(0, after(f"{REV}.1.0.Gate.0"))
    assert step.phase in ("Cleanup", "Done", "Uncordon"), step.message
    assert "2 Service cells answer as before" in said(step)


def test_a_difference_is_confirmed_for_a_while_then_rolls_the_node_back_naming_the_change() -> None:
    first = gate_step(0, after(f"{REV}.1.0.Gate.0", localhost="refused"), gate={"timeout": "2m"})
    assert first.phase == "Gate" and "LocalhostNodePorts" in first.message and "confirming for 30s" in first.message
    seen = writes(first)  # the next probe goes out with the moment the difference was first seen
    assert seen and record_of(seen[-1]).behaviour_differs_since == fmt(T0 + timedelta(seconds=30))
    # Still there 10 s later: not yet confirmed (a Service down for a reason of its own recovers).
    early = gate_step(1, after(f"{REV}.1.0.Gate.1", localhost="refused"), differs_since=20)
    assert early.phase == "Gate"
    second = gate_step(1, after(f"{REV}.1.0.Gate.1", localhost="refused"), differs_since=0)
    assert second.phase == "RollingBack"
    m = writes(second)[0].migration
    assert m is not None
    assert m.reason == "BehaviourChanged"
    assert m.message is not None
    assert "127.0.0.1" in m.message and "refused" in m.message and "LocalhostNodePorts" in m.message


def test_an_allowed_change_passes_and_says_so() -> None:
    step = gate_step(1, after(f"{REV}.1.0.Gate.1", localhost="refused"), differs_since=0,
                     gate={"behaviour": {"allowChanges": ["LocalhostNodePorts"]}})
    assert step.phase in ("Cleanup", "Done", "Uncordon"), step.message
    assert "allowed changes: LocalhostNodePorts" in said(step)


def test_an_agent_without_the_matrix_is_not_held_to_it() -> None:
    older = gate_step(1, None, before=None)
    assert older.phase in ("Cleanup", "Done", "Uncordon") and "not recorded before the switch" in said(older)
    stale = gate_step(1, after(f"{REV}.1.0.Gate.0", localhost="refused"), differs_since=0)  # an earlier round's
    assert stale.phase in ("Cleanup", "Done", "Uncordon") and "no Service behaviour after" in said(stale)


# populate_by_name: pydantic takes the field's name; mypy knows only its alias, clusterIPs.
DISTRIBUTION = DiagnoseRequest(id="", services=[DiagnoseService(  # type: ignore[call-arg]
                                                                namespace="web", name="shop",
                                                                cluster_ips=["198.19.0.10"], endpoints=["198.18.1.1",
                                                                                                        "198.18.1.2"])])


def test_the_distribution_is_recorded_with_the_preflight_and_at_done_and_carried_between() -> None:
    start = machine.start(replace(inp(), distribution=DISTRIBUTION), Target(REV, "nftables"), from_mode="iptables",
                          generation=1, retry_token=None)
    before = writes(start)[0].diagnose
    assert before is not None and before.record == "before" and before.id.endswith(".before")
    assert [s.name for s in before.services] == ["shop"]
    # A step in between replaces the spec whole: the unanswered request goes along unchanged.
    pn_with_request = inp(mig("Gate")).proxynode.model_copy(deep=True)
    pn_with_request.spec.diagnose = before
    between = machine._forward_write(replace(inp(mig("Gate")), proxynode=pn_with_request), mig("Gate"), None)
    assert between.diagnose == before
    done = machine._done(replace(inp(mig("Uncordon")), proxynode=pn_with_request, distribution=DISTRIBUTION),
                         mig("Uncordon"), "ok")
    after = writes(done)[0].diagnose
    assert after is not None and after.record == "after" and after.id.endswith(".after") and after.id != before.id


def test_the_gate_tells_what_the_conntrack_step_deleted_and_its_failure() -> None:
    op = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={"conntrack": CONNTRACK.model_dump(by_alias=True)})

    def gate_with(report: dict[str, Any]) -> machine.Step:
        return machine.step(inp(mig("Gate"), label=REV, pods=[pod(f"kube-proxy-{REV}")], op=op,
                                last=done(op, conntrack=report),
                                facts=_good_facts(), now_plus=30))

    rescued = gate_with({"scanned": 40, "deletedTcp": 31, "deletedUdp": 0, "entries": []})
    assert rescued.phase in ("Cleanup", "Done", "Uncordon")
    assert "deleted 31 TCP SYN_SENT and 0 UDP un-NATed conntrack entries" in said(rescued)
    assert "conntrack" not in said(gate_with({"scanned": 3}))
    failed = gate_with({"error": "conntrack: not found on PATH"})
    assert failed.phase in ("Cleanup", "Done", "Uncordon"), "a failed step is told, it does not fail the gate"
    assert "the conntrack step failed: conntrack: not found on PATH" in said(failed)
