"""spec.rollout.conntrackCleanup: every probe after a switch carries the conntrack step, unless turned off."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from simulator import Sim, make_policy

from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView
from proxyshift.planner.world import ServiceSide

pytestmark = pytest.mark.unit

SHOP = ServiceView(namespace="web", name="shop", type="NodePort", cluster_ips=("198.19.0.10",),
                   ports=(ServicePortView(name="http", protocol="TCP", port=80, node_port=30080),))
SIDE = ServiceSide(services={"web/shop": SHOP}, service_cidrs=("198.19.0.0/16",),
                   endpoints=(EndpointView(service="web/shop", address="198.18.1.1", ready=True),))


def _probe_params(**rollout: Any) -> list[dict[str, Any]]:
    sim = Sim.build({"node-1": {"pool": "blue"}}, [make_policy("p", mode="nftables", rollout=rollout)])
    plain_world = sim.world
    sim.world = lambda: replace(plain_world(), services=SIDE)  # type: ignore[method-assign]  # the test swaps the world
    sim.run()
    assert sim.phase("node-1") == "Done"
    ops = [getattr(a, "operation", None) for _, _, a in sim.log]
    return [op.params for op in ops if op is not None and op.type == "Probe"]


def test_every_probe_after_the_switch_carries_the_conntrack_step_by_default() -> None:
    probes = _probe_params()
    assert probes
    for params in probes:
        assert params["conntrack"]["serviceCidrs"] == ["198.19.0.0/16"]
        assert params["conntrack"]["nodePorts"] == [30080]


def test_conntrack_cleanup_false_leaves_conntrack_alone() -> None:
    probes = _probe_params(conntrackCleanup=False)
    assert probes
    assert all("conntrack" not in params for params in probes)
