"""The BehaviourChanges condition: what the target mode changes for this cluster, told when a policy is applied."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from simulator import Sim, make_policy

from proxyshift.api.common import Condition
from proxyshift.controller.compat_report import CompatCache
from proxyshift.planner.planner import plan
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView
from proxyshift.planner.world import Event, RecordStatus, ServiceSide

pytestmark = pytest.mark.unit

BASELINE_CM = yaml.safe_load((Path(__file__).parents[1] / "fixtures/baseline/kube-proxy-configmap.yaml").read_text())
NODE_PORT = ServiceView(namespace="web", name="shop", type="NodePort", cluster_ips=("198.19.0.10",),
                        ports=(ServicePortView(name="http", protocol="TCP", port=80, node_port=30080),))
SIDE = ServiceSide(services={"web/shop": NODE_PORT},
                   endpoints=(EndpointView(service="web/shop", address="198.18.1.1", ready=True),))


def _condition(sim: Sim, policy: str, **spec: Any) -> tuple[Condition, list[Event]]:
    edit_spec = make_policy(policy, mode="nftables", **spec)
    sim.policies[policy] = edit_spec
    world = replace(sim.world(), services=SIDE)
    report = CompatCache().report(world, policy, BASELINE_CM)
    assert report is not None
    result = plan(replace(world, compat={policy: report}), policy)
    status = next(a.status for a in result.actions if isinstance(a, RecordStatus))
    return next(c for c in status.conditions if c.type == "BehaviourChanges"), \
        [a for a in result.actions if isinstance(a, Event)]


def test_a_move_to_nftables_names_the_nodeport_changes_and_the_service() -> None:
    sim = Sim.build({"node-1": {"pool": "blue"}}, [make_policy("p", mode="nftables")])
    condition, events = _condition(sim, "p")
    assert (condition.status, condition.reason) == ("True", "BehaviourChangesAhead")
    for words in ("LocalhostNodePorts (web/shop)", "NodePortAddresses (web/shop)", "proxyshift plan -f"):
        assert words in condition.message, condition.message
    assert any(e.type == "Warning" and e.reason == "BehaviourChangesAhead" for e in events)


def test_allowed_and_preserved_changes_are_not_told_as_ahead() -> None:
    sim = Sim.build({"node-1": {"pool": "blue"}}, [make_policy("p", mode="nftables")])
    condition, _ = _condition(sim, "p", gate={"behaviour": {"allowChanges": [
        "LocalhostNodePorts", "NodePortAddresses", "NodePortFirewall", "ConntrackInvalid"]}})
    assert (condition.status, condition.reason) == ("False", "NoBehaviourChanges"), condition.message


def test_without_a_report_the_condition_is_unknown() -> None:
    sim = Sim.build({"node-1": {"pool": "blue"}}, [make_policy("p", mode="nftables")])
    result = plan(sim.world(), "p")
    status = next(a.status for a in result.actions if isinstance(a, RecordStatus))
    condition = next(c for c in status.conditions if c.type == "BehaviourChanges")
    assert (condition.status, condition.reason) == ("Unknown", "NotAssessed")


def test_the_gate_s_probe_services_resolve_from_the_service_mirror() -> None:
    from proxyshift.controller.service_cache import probe_service_ips

    headless = ServiceView(namespace="web", name="db", headless=True)
    side = ServiceSide(services={"web/shop": NODE_PORT, "web/db": headless})
    policy = make_policy("p", gate={"probeServices": [{"namespace": "web", "name": "shop", "port": 80},
                                                      {"namespace": "web", "name": "db", "port": 5432},
                                                      {"namespace": "web", "name": "gone", "port": 80}]})
    assert probe_service_ips(side, policy) == {"web/shop": "198.19.0.10"}
