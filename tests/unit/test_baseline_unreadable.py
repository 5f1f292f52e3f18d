"""A baseline kube-proxy ConfigMap that cannot be read stops the rollout with a condition, not a crash."""

from __future__ import annotations

from dataclasses import replace

import pytest
from simulator import Sim, make_policy

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.controller.snapshot import current_revisions
from proxyshift.planner.planner import plan
from proxyshift.planner.world import Event, RecordStatus, SetMigration

pytestmark = pytest.mark.unit

BROKEN = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: [iptables\n"


def test_a_yaml_syntax_error_is_a_value_error_naming_the_line() -> None:
    with pytest.raises(ValueError, match=r"not valid YAML: .*line 3"):
        KubeProxyConfiguration.from_yaml(BROKEN)


def test_rendering_on_a_broken_baseline_gives_the_policy_an_error_instead_of_raising() -> None:
    configmap = {"metadata": {"name": "kube-proxy"}, "data": {"config.conf": BROKEN}}
    daemonset = {"metadata": {"name": "kube-proxy"}, "spec": {"template": {"spec": {"containers": []}}}}
    targets, errors = current_revisions({"p": make_policy("p")}, configmap, daemonset)
    assert targets == {} and "not valid YAML" in errors["p"] and "line 3" in errors["p"]


def test_the_policy_turns_degraded_with_the_reason_and_no_node_starts() -> None:
    sim = Sim.build({"node-1": {"pool": "blue"}, "node-2": {"pool": "blue"}}, [make_policy("p")])
    message = "cannot render a revision from the baseline kube-proxy: kube-proxy config.conf is not valid YAML"
    world = replace(sim.world(), current_revisions={}, render_errors={"p": message})
    result = plan(world, "p")
    assert not [a for a in result.actions if isinstance(a, SetMigration)]
    status = next(a.status for a in result.actions if isinstance(a, RecordStatus))
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert status.phase == "Degraded"
    assert (degraded.status, degraded.reason) == ("True", "BaselineUnreadable") and "not valid YAML" in degraded.message
    assert (ready.status, ready.reason) == ("False", "BaselineUnreadable")
    warnings = [a for a in result.actions if isinstance(a, Event) and a.type == "Warning"]
    assert any(e.reason == "BaselineUnreadable" and "not valid YAML" in e.message for e in warnings)
