"""The typed operator-agent contract (api/proxynode.py) across one version of skew.

fixtures/contract_v0.json holds the params and results as the operator and agent wrote them before
the typed models (captured from that code). An agent one version older reads what this operator
writes, and this operator reads what that agent writes; the same both ways round. Unknown keys are
ignored (and kept in the raw dict), missing ones defaulted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, get_args

import pytest
from test_agent_loop import CLEAN, IPT_LEFT, FakeAPI, FakeNode, make_agent, node_obj
from test_agent_loop_behaviour import BEHAVIOUR, CONNTRACK, FakeChecks
from test_machine import REV, _good_facts, done, inp, mig, pod, writes

from proxyshift.agent.loop import RUNNERS
from proxyshift.api.behaviour import BehaviourParams, ConntrackParams
from proxyshift.api.proxynode import (
    OPERATION_TYPES,
    PARAMS_MODELS,
    RESULT_MODELS,
    CleanupParams,
    CleanupResult,
    HoldParams,
    Operation,
    OperationStatus,
    OperationType,
    PreflightParams,
    PreflightResult,
    ProbeParams,
    ProbeResult,
    ProxyNode,
    ProxyNodeSpec,
)
from proxyshift.controller.executor import ACTION_HANDLERS
from proxyshift.planner import machine
from proxyshift.planner import world as w
from proxyshift.planner.machine import NodeInput, Target

pytestmark = pytest.mark.unit

V0 = json.loads((Path(__file__).parent / "fixtures" / "contract_v0.json").read_text())
# Fixture name -> the operation type it is a params or result of.
PARAMS_TYPES: dict[str, OperationType] = {"Preflight": "Preflight", "PreflightFull": "Preflight", "Hold": "Hold",
                                          "Probe": "Probe", "Cleanup": "Cleanup"}


def test_every_operation_type_has_params_a_result_and_an_agent_runner() -> None:
    assert set(PARAMS_MODELS) == set(RESULT_MODELS) == set(RUNNERS) == set(OPERATION_TYPES)
    assert all(model.operation_type == t for t, model in PARAMS_MODELS.items())
    assert all(model.operation_type == t for t, model in RESULT_MODELS.items())


def test_every_planner_action_has_an_executor_handler() -> None:
    actions = {cls for cls in vars(w).values() if isinstance(cls, type) and issubclass(cls, w.Action)} - {w.Action}
    assert actions == set(ACTION_HANDLERS)


@pytest.mark.parametrize("name", sorted(PARAMS_TYPES))
def test_the_previous_params_read_and_write_back_unchanged(name: str) -> None:
    wire = V0["params"][name]
    op = Operation(id=f"m1.{name}.0", type=PARAMS_TYPES[name], params=copy.deepcopy(wire))
    typed = op.typed_params()
    assert isinstance(typed, PARAMS_MODELS[op.type])
    # What this operator writes for the same request is byte for byte what the older one wrote.
    assert Operation.request(op.id, typed).to_k8s() == op.to_k8s()


def _planned() -> dict[str, dict[str, Any]]:
    """The params this planner writes for the inputs the fixtures were captured with."""
    gate = {"probeServices": [{"namespace": "default", "name": "web", "port": 80}]}
    ips = {"default/web": "198.19.0.10"}
    sample, conntrack = BehaviourParams.model_validate(BEHAVIOUR), ConntrackParams.model_validate(CONNTRACK)

    def full(i: NodeInput) -> NodeInput:
        return NodeInput(**{**i.__dict__, "service_ips": ips, "behaviour": sample, "conntrack": conntrack})

    def first_op(step: machine.Step) -> Operation:
        ops = [a.operation for a in writes(step) if a.operation is not None]
        return ops[0]

    out: dict[str, dict[str, Any]] = {}
    start = machine.start(inp(), Target(REV, "nftables"), from_mode="iptables", generation=3, retry_token="a")
    preflight_params = first_op(start).to_k8s()["params"]
    # New since v0: the rule hold made by a passed preflight (iptables -> nftables without cordon). An older agent
    # ignores the key and reports no hold, and the switch asks for a Hold of its own as before: the "Hold" capture.
    assert preflight_params.pop("hold") == {"fromMode": "iptables", "toMode": "nftables",
                                            "ttlSeconds": int(machine.hold_ttl(inp(), ahead=True).total_seconds())}
    out["Preflight"] = preflight_params
    policy: dict[str, Any] = {"gate": {**gate, "behaviour": {"allowChanges": ["ForeignIPVSFlush"]}}, "mode": "ipvs",
              "extra_spec": {"preflight": {"loadModules": True, "extraModules": ["nf_nat"]},
                             "ipvs": {"scheduler": "rr"}}}
    start = machine.start(full(inp(**policy)), Target(REV, "ipvs", "rr"), from_mode="iptables", generation=3,
                          retry_token="a")
    out["PreflightFull"] = first_op(start).to_k8s()["params"]
    preflight = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    out["Hold"] = first_op(machine.step(inp(mig("Preflight"), op=preflight, last=done(preflight)))).to_k8s()["params"]
    switched = machine.step(full(inp(mig("Switch"), label=REV, pods=[pod(f"kube-proxy-{REV}")], gate=gate)))
    probe_params = first_op(switched).to_k8s()["params"]
    # New since v0: the flush inside the gate's probe (cleanup.inGate). An older agent ignores the key and
    # reports no flush, and the Cleanup step follows the gate as before: the "Cleanup" capture below.
    assert probe_params.pop("cleanup") == {"removeModes": ["iptables"], "targetMode": "nftables"}
    out["Probe"] = probe_params
    probe = Operation(id=f"{REV}.1.0.Gate.0", type="Probe", params={"services": ["198.19.0.10:80"]})
    gated = inp(mig("Gate"), label=REV, op=probe, last=done(probe, connects={"198.19.0.10:80": True}),
                facts=_good_facts(), gate=gate)
    out["Cleanup"] = first_op(machine.step(NodeInput(**{**gated.__dict__, "service_ips": ips}))).to_k8s()["params"]
    return out


def test_an_agent_one_version_older_gets_the_params_it_knows() -> None:
    """The state machine, given the inputs of the capture, writes exactly the previous wire dicts."""
    assert _planned() == V0["params"]


def _run(params: dict[str, Any], type_: str, **kw: Any) -> dict[str, Any]:
    api = FakeAPI(node_obj({"id": f"m1.{type_}.0", "type": type_, "params": copy.deepcopy(params)}))
    agent = make_agent(api, **kw)
    assert isinstance(agent.effects, FakeNode)
    agent.effects.checks = FakeChecks()
    agent.handle(api.get("n1"))
    last = dict(api.obj["status"]["lastOperation"])
    last.pop("startedAt"), last.pop("finishedAt")
    return last


def test_an_operator_one_version_older_gets_the_results_it_knows() -> None:
    """This agent, run on the previous params with the capture's fake node, reports the previous results."""
    assert _run(V0["params"]["PreflightFull"], "Preflight") == V0["results"]["Preflight"]
    assert _run(V0["params"]["Hold"], "Hold") == V0["results"]["Hold"]
    assert _run(V0["params"]["Probe"], "Probe") == V0["results"]["Probe"]
    cleanup = V0["params"]["Cleanup"] | {"services": ["198.19.0.10:443", "198.19.0.11:80"]}
    assert _run(cleanup, "Cleanup", inventory=IPT_LEFT) == V0["results"]["Cleanup"]


@pytest.mark.parametrize("name", sorted(V0["results"]))
def test_the_previous_results_read_into_the_result_models(name: str) -> None:
    status = OperationStatus.model_validate(V0["results"][name])
    result = status.result_as(RESULT_MODELS[status.type])  # type: ignore[index]  # every V0 type is an OperationType
    wire = V0["results"][name].get("details", {})
    if name == "ProbeConnectsList":  # the first agents' list of connects reads as the map
        assert result.to_details() == {"connects": {"198.19.0.10:80": True, "198.19.0.11:80": "timeout"}}
    else:  # a null in a merge patch is no key at all: the model leaves it out too
        assert result.to_details() == {k: v for k, v in wire.items() if v is not None}


def test_the_operator_judges_an_older_agents_report_as_before() -> None:
    found = OperationStatus.model_validate(V0["results"]["PreflightForeignIPVS"])
    assert machine.foreign_ipvs_accepted(found) == ["TCP 198.18.5.1:80 rr", "FWM 7 sh"]
    probe = OperationStatus.model_validate(V0["results"]["Probe"]).result_as(ProbeResult)
    assert probe.conntrack is not None
    assert probe.connects == {"198.19.0.10:80": "connection refused"} and probe.conntrack.deleted_tcp == 1
    recovered = OperationStatus.model_validate(V0["results"]["CleanupRecovered"]).result_as(CleanupResult)
    assert recovered.recovered and recovered.remaining == {"iptables": 1} and recovered.connects is None


def test_unknown_params_are_ignored_by_the_models_and_kept_on_the_spec() -> None:
    newer = {**V0["params"]["Cleanup"], "dryRunFirst": True, "budget": {"seconds": 3}}
    spec = ProxyNodeSpec.model_validate({"operation": {"id": "m1.Cleanup.0", "type": "Cleanup", "params": newer},
                                         "migration": {"phase": "SomePhaseOfANewerOperator"}})
    assert spec.operation is not None
    assert spec.operation.params_as(CleanupParams) == CleanupParams(
        remove_modes=["iptables"], target_mode="nftables", services=["198.19.0.10:80"])
    assert spec.to_k8s()["operation"]["params"] == newer  # a whole-spec write does not drop them
    # ... and the agent runs it, and a phase it does not know does not stop it.
    assert _run(newer, "Cleanup")["state"] == "Succeeded"


def test_missing_params_and_results_are_defaulted() -> None:
    assert ProbeParams.model_validate({}) == ProbeParams(services=[], await_mode=None, await_syncs=1, await_seconds=0)
    assert HoldParams.model_validate({}).ttl_seconds == 600
    assert PreflightParams.model_validate({"mode": "nftables"}).extra_modules == []
    # None: the agent did not report it (older than the field); the operator tells that from empty.
    assert CleanupResult.model_validate({}).connects is None
    assert PreflightResult.model_validate({}).foreign_ipvs is None


def test_a_malformed_result_field_reads_as_not_reported_and_the_rest_still_counts() -> None:
    status = OperationStatus(id="m1.Probe.0", type="Probe", state="Succeeded",
                             details={"connects": {"198.19.0.10:80": True}, "conntrack": "garbage"})
    result = status.result_as(ProbeResult)
    assert result.conntrack is None and result.connects == {"198.19.0.10:80": True}


def test_a_params_model_of_another_type_is_refused() -> None:
    op = Operation.request("m1.Hold.0", HoldParams(from_mode="iptables", to_mode="nftables", ttl_seconds=60))
    assert op.type == "Hold" and op.params == {"fromMode": "iptables", "toMode": "nftables", "ttlSeconds": 60}
    with pytest.raises(TypeError, match="a Hold operation carries HoldParams"):
        op.params_as(CleanupParams)


def test_a_cleanup_without_services_reports_no_connects() -> None:
    """The older operator's Cleanup without services: no connects in the report, as that operator expects."""
    last = _run({"removeModes": ["iptables"], "targetMode": "nftables"}, "Cleanup", inventory=CLEAN)
    assert last["state"] == "Succeeded" and "connects" not in last["details"]


def test_phase_and_mode_are_one_literal_each() -> None:
    from proxyshift.agent import ownership
    from proxyshift.api import policy, proxynode

    assert policy.NodePhase is proxynode.Phase and policy.ProxyMode is proxynode.Mode
    assert ownership.Mode is proxynode.Mode and get_args(proxynode.Mode) == ownership.MODES
    assert proxynode.IN_FLIGHT | machine.TERMINAL | {"Pending"} == set(proxynode.PHASES)
    migration = ProxyNode.model_validate({"spec": {"migration": {"phase": "Gate"}}}).spec.migration
    assert migration is not None and migration.phase == "Gate"
