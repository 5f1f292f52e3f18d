"""The agent loop's behaviour probe and conntrack step (issue 13), against the fake ProxyNode API."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_agent_loop import FACTS, FakeAPI, FakeNode, fake_node, make_agent, node_obj

from proxyshift.agent.flush.base import FlushReport
from proxyshift.agent.hold import HoldReport
from proxyshift.api.behaviour import (
    BehaviourCell,
    BehaviourMatrix,
    BehaviourParams,
    ConntrackParams,
    ConntrackReport,
)
from proxyshift.api.proxynode import ProxyNode

pytestmark = pytest.mark.unit

BEHAVIOUR = {"targets": [{"service": "d/web", "kind": "ClusterIP", "port": 80, "address": "198.19.0.10"}],
             "nodeIps": ["198.18.1.2"], "podProbe": "198.18.2.5:9810"}
CONNTRACK = {"serviceCidrs": ["198.19.0.0/16"], "nodePorts": [30080]}


class FakeChecks:
    def __init__(self, *, pod_error: str | None = None) -> None:
        self.calls: list[str] = []
        self.pod_error = pod_error

    def behaviour(self, params: BehaviourParams, *, mode: str | None, operation_id: str) -> BehaviourMatrix:
        self.calls.append(f"behaviour {mode} {operation_id} {[t.service for t in params.targets]}")
        cell = BehaviourCell(service="d/web", kind="ClusterIP", protocol="TCP", port=80, address="198.19.0.10",
                             address_role="clusterIP", path="node", outcome="answered", endpoints=["198.18.3.4"])
        return BehaviourMatrix(operation_id=operation_id, mode=mode, duration_seconds=0.12, cells=[cell],
                               pod_path_error=self.pod_error)

    def conntrack(self, params: ConntrackParams) -> ConntrackReport:
        self.calls.append(f"conntrack {params.service_cidrs}")
        return ConntrackReport(scanned=3, deleted_tcp=1, entries=["tcp 198.18.1.2:40000 -> 198.19.0.10:80"])


def run_op(op: dict, checks: FakeChecks, status: dict | None = None) -> ProxyNode:
    api = FakeAPI(node_obj(op, status))
    agent = make_agent(api)
    assert isinstance(agent.effects, FakeNode)
    agent.effects.checks = checks
    agent.facts = FACTS
    agent.handle(api.get("n1"))
    return ProxyNode.model_validate(api.obj)


def test_preflight_with_behaviour_writes_the_before_matrix_and_clears_an_old_after() -> None:
    checks = FakeChecks()
    old = {"behaviour": {"after": {"operationId": "old.Probe.3", "cells": []}}}
    node = run_op({"id": "m1.Preflight.0", "type": "Preflight", "params": {"mode": "nftables",
                                                                            "behaviour": BEHAVIOUR}}, checks, old)
    assert checks.calls == ["behaviour nftables m1.Preflight.0 ['d/web']"]
    assert node.status.behaviour is not None
    assert node.status.behaviour.before is not None
    assert node.status.behaviour.before.cells[0].endpoints == ["198.18.3.4"]
    assert node.status.behaviour.after is None
    last = node.status.last_operation
    assert last is not None
    assert last.state == "Succeeded" and "behaviour: 1/1 cells answered" in last.message


def test_a_failed_preflight_records_no_matrix() -> None:
    from proxyshift.agent.preflight import Missing, PreflightReport, ToolVersions

    checks = FakeChecks()
    api = FakeAPI(node_obj({"id": "m1.Preflight.0", "type": "Preflight",
                            "params": {"mode": "ipvs", "behaviour": BEHAVIOUR}}))
    agent = make_agent(api, preflight=lambda mode, scheduler, **kw: PreflightReport(
        mode=mode, scheduler=scheduler, kernel_release="6.1", modules={}, tools=ToolVersions(),
        missing=[Missing("kernel module ip_vs", "needed", "modprobe ip_vs")]))
    assert isinstance(agent.effects, FakeNode)
    agent.effects.checks = checks
    agent.handle(api.get("n1"))
    node = ProxyNode.model_validate(api.obj)
    # The matrix is taken while the preflight runs (it only reads), and dropped when the preflight fails:
    # an untouched node has no "before" to compare with.
    assert node.status.last_operation is not None
    assert node.status.behaviour is None and node.status.last_operation.state == "Failed"
    assert "behaviour" not in node.status.last_operation.message


def test_probe_runs_the_conntrack_step_then_the_behaviour_probe_after_the_wait() -> None:
    checks = FakeChecks(pod_error="probe server 198.18.2.5:9810: connection refused")
    before = {"behaviour": {"before": {"operationId": "m1.Preflight.0", "cells": []}}}
    node = run_op({"id": "m1.Probe.1", "type": "Probe",
                   "params": {"awaitMode": "nftables", "awaitSeconds": 5, "behaviour": BEHAVIOUR,
                              "conntrack": CONNTRACK}}, checks, before)
    assert checks.calls == ["conntrack ['198.19.0.0/16']", "behaviour nftables m1.Probe.1 ['d/web']"]
    behaviour = node.status.behaviour
    assert behaviour is not None
    assert behaviour.before is not None
    assert behaviour.before.operation_id == "m1.Preflight.0"  # the Probe leaves "before" alone
    assert behaviour.after is not None
    assert behaviour.after.pod_path_error is not None
    assert behaviour.after.operation_id == "m1.Probe.1" and behaviour.after.pod_path_error.startswith("probe")
    last = node.status.last_operation
    assert last is not None
    assert last.details["conntrack"] == {"scanned": 3, "deletedTcp": 1, "deletedUdp": 0,
                                         "entries": ["tcp 198.18.1.2:40000 -> 198.19.0.10:80"], "truncated": False}
    assert "conntrack: 1 TCP and 0 UDP" in last.message and "pod path: probe server" in last.message


def test_a_gate_probe_runs_conntrack_and_connects_beside_the_flush_and_the_matrix_last() -> None:
    checks = FakeChecks()
    api = FakeAPI(node_obj({"id": "m1.Probe.1", "type": "Probe", "params": {
        "awaitMode": "nftables", "awaitSeconds": 5, "services": ["198.19.0.10:443"], "behaviour": BEHAVIOUR,
        "conntrack": CONNTRACK, "cleanup": {"removeModes": ["iptables"], "targetMode": "nftables"}}}))
    agent = make_agent(api)
    node = fake_node(agent)
    node.checks = checks
    events: list[str] = []
    conntrack_began = threading.Event()
    conntrack, behaviour = checks.conntrack, checks.behaviour
    cleanup, connect, inventory = node.cleanup, node.connect, node.inventory

    def conntrack_beside(params: ConntrackParams) -> ConntrackReport:
        conntrack_began.set()
        events.append("conntrack")
        return conntrack(params)

    def flush_waiting(remove: list[str], target: str | None) -> tuple[FlushReport, HoldReport]:
        # Returns once the conntrack step has begun: run one after the other, this would wait out its 5 s.
        events.append(f"flush (conntrack began: {conntrack_began.wait(5)})")
        return cleanup(remove, target)

    def recorded(name: str, seam: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return seam(*args, **kwargs)
        return call

    # The test swaps these seams for ones that record each call.
    checks.conntrack, checks.behaviour = conntrack_beside, recorded("behaviour", behaviour)  # type: ignore[method-assign]
    node.cleanup, node.connect = flush_waiting, recorded("connect", connect)  # type: ignore[method-assign]  # swapped
    node.inventory = recorded("inventory", inventory)  # type: ignore[method-assign]  # swapped, recording
    agent.handle(api.get("n1"))
    assert "flush (conntrack began: True)" in events
    assert events.index("conntrack") < events.index("connect")  # the gap's un-NATed entries go first
    # The matrix judges the node as it stays: after the flush and the inventory read after it, last.
    flushed = events.index("flush (conntrack began: True)")
    assert "inventory" in events[flushed:] and events[-1] == "behaviour" and events.count("behaviour") == 1
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None and last.state == "Succeeded"
    assert last.details["connects"] == {"198.19.0.10:443": True} and last.details["cleanup"]["ok"] is True
    assert last.details["conntrack"]["deletedTcp"] == 1


def test_a_new_after_matrix_clears_the_old_ones_pod_path_error() -> None:
    old = {"behaviour": {"after": {"operationId": "m1.Probe.1", "podPathError": "refused", "cells": []}}}
    node = run_op({"id": "m1.Probe.2", "type": "Probe", "params": {"behaviour": BEHAVIOUR}}, FakeChecks(), old)
    assert node.status.behaviour is not None
    assert node.status.behaviour.after is not None
    assert node.status.behaviour.after.operation_id == "m1.Probe.2"
    assert node.status.behaviour.after.pod_path_error is None


def test_an_old_operator_sending_neither_sees_no_change() -> None:
    checks = FakeChecks()
    node = run_op({"id": "m1.Probe.1", "type": "Probe", "params": {"services": ["198.19.0.10:443"]}}, checks)
    assert checks.calls == [] and node.status.behaviour is None
    assert node.status.last_operation is not None
    assert node.status.last_operation.details == {"connects": {"198.19.0.10:443": True}}
    pre = run_op({"id": "m1.Preflight.0", "type": "Preflight", "params": {"mode": "nftables"}}, checks)
    assert pre.status.last_operation is not None
    assert checks.calls == [] and pre.status.behaviour is None and "behaviour" not in pre.status.last_operation.message


def test_bad_behaviour_params_fail_the_operation_with_a_reason() -> None:
    node = run_op({"id": "m1.Probe.1", "type": "Probe", "params": {"behaviour": {"targets": [{"port": 0}]}}},
                  FakeChecks())
    last = node.status.last_operation
    assert last is not None
    assert last.state == "Failed" and "ValidationError" in last.message
