"""Which nodes a policy takes: a selector that matches nothing, and control-plane nodes (issue 8, bad input).

A control-plane node is left alone unless the policy says `controlPlaneNodes: Include`: a kube-proxy
that fails there cuts the control plane's own Service paths, and a selector as broad as {} must not
reach it by accident. The skip is visible (ControlPlaneSkipped condition, nodes.skippedControlPlane).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from simulator import Sim, make_policy

from proxyshift.planner.ownership import compute_ownership, selects
from proxyshift.planner.planner import plan
from proxyshift.planner.preview import preview
from proxyshift.planner.world import EnsureProxyNode, EnsureRevision, SetMigration, SetRevisionLabel

pytestmark = pytest.mark.unit

CP = "node-role.kubernetes.io/control-plane"


def nodes() -> dict[str, dict[str, str]]:
    return {"cp-1": {CP: "", "pool": "blue"}, "node-1": {"pool": "blue"}, "node-2": {"pool": "blue"},
            "legacy-master": {"node-role.kubernetes.io/master": "", "pool": "blue"}}


def condition(sim: Sim, policy: str, type_: str) -> tuple[str, str, str]:
    c = next(c for c in sim.policies[policy].status.conditions if c.type == type_)
    return c.status, c.reason, c.message


def test_a_selector_that_matches_no_node_changes_nothing_and_says_so() -> None:
    sim = Sim.build({"node-1": {"pool": "green"}}, [make_policy("p", selector={"matchLabels": {"pool": "typo"}})])
    sim.run()
    touching = [a for _, _, a in sim.log if isinstance(a, SetMigration | SetRevisionLabel | EnsureProxyNode)]
    assert touching == []
    st = sim.policies["p"].status
    assert (st.phase, st.progress, st.nodes.selected) == ("Ready", "0/0", 0)
    status, reason, message = condition(sim, "p", "Ready")
    assert (status, reason) == ("True", "NoNodesSelected")
    assert "matches no node" in message and "spec.nodeSelector" in message
    assert condition(sim, "p", "Progressing")[0] == "False"
    # And it stays quiet: no requeue loop once Ready.
    assert plan(sim.world(), "p").requeue_after_seconds is None


@pytest.mark.parametrize("selector", [{}, {"matchLabels": {"pool": "blue"}}], ids=["every-node", "pool"])
def test_control_plane_nodes_are_skipped_by_default(selector: dict[str, object]) -> None:
    sim = Sim.build(nodes(), [make_policy("p", selector=selector)])
    sim.run()
    assert sim.violations == []
    rev = sim.render(sim.policies["p"]).name
    assert {n: v.revision for n, v in sim.nodes.items()} == {"cp-1": None, "node-1": rev, "node-2": rev,
                                                              "legacy-master": None}
    touched = {a.node for _, _, a in sim.log if isinstance(a, SetMigration | SetRevisionLabel)}
    assert touched == {"node-1", "node-2"}
    st = sim.policies["p"].status
    assert (st.phase, st.progress, st.nodes.skipped_control_plane) == ("Ready", "2/2", 2)
    status, reason, message = condition(sim, "p", "ControlPlaneSkipped")
    assert (status, reason) == ("True", "ControlPlaneNodesSkipped")
    assert "cp-1" in message and "legacy-master" in message and "controlPlaneNodes: Include" in message
    # A person is told once, as a Warning Event.
    warnings = sim.events("ControlPlaneNodesSkipped")
    assert len(warnings) == 1 and warnings[0].type == "Warning"


def test_only_control_plane_nodes_selected_means_nothing_happens() -> None:
    sim = Sim.build({"cp-1": {CP: ""}}, [make_policy("p", selector={})])
    sim.run()
    assert [a for _, _, a in sim.log if isinstance(a, SetMigration | SetRevisionLabel)] == []
    status, reason, message = condition(sim, "p", "Ready")
    assert (status, reason) == ("True", "NoNodesSelected") and "control-plane" in message
    assert condition(sim, "p", "ControlPlaneSkipped")[0] == "True"


def test_include_migrates_control_plane_nodes_too() -> None:
    sim = Sim.build(nodes(), [make_policy("p", selector={}, extra_spec={"controlPlaneNodes": "Include"})])
    sim.run()
    rev = sim.render(sim.policies["p"]).name
    assert all(v.revision == rev for v in sim.nodes.values())
    assert sim.policies["p"].status.nodes.skipped_control_plane == 0
    assert condition(sim, "p", "ControlPlaneSkipped")[:2] == ("False", "NoControlPlaneNodes")


def test_a_node_becoming_control_plane_after_its_migration_is_left_as_it_is() -> None:
    # "Skip" means untouched: not migrated, and not taken back to the baseline either.
    sim = Sim.build({"node-1": {"pool": "blue"}}, [make_policy("p")])
    sim.run()
    rev = sim.nodes["node-1"].revision
    assert rev is not None
    sim.nodes["node-1"] = replace(sim.nodes["node-1"], labels={**sim.nodes["node-1"].labels, CP: ""})
    sim.log.clear()
    sim.run()
    assert sim.nodes["node-1"].revision == rev
    assert [a for _, _, a in sim.log if isinstance(a, SetRevisionLabel)] == []
    assert sim.proxynodes["node-1"].spec.policy is None  # released, so another Include policy may take it
    assert condition(sim, "p", "ControlPlaneSkipped")[0] == "True"


def test_an_including_newer_policy_gets_the_control_plane_node_an_older_one_skips() -> None:
    older = make_policy("older", selector={}, created="2026-11-30T09:00:00Z")
    newer = make_policy("newer", selector={"matchExpressions": [{"key": CP, "operator": "Exists"}]},
                        extra_spec={"controlPlaneNodes": "Include"})
    sim = Sim.build(nodes(), [older, newer])
    world = sim.world()
    own = compute_ownership(world)
    assert own["cp-1"].owner == "newer" and own["cp-1"].skipped_by == ("older",)
    assert own["node-1"].owner == "older"
    assert not selects(world.policies["older"], world.nodes["cp-1"].labels)
    sim.run()
    assert condition(sim, "newer", "Conflict")[0] == "False"
    assert sim.nodes["cp-1"].revision == sim.render(sim.policies["newer"]).name


def test_plan_preview_leaves_control_plane_nodes_out() -> None:
    sim = Sim.build(nodes(), [make_policy("p", selector={})])
    world = sim.world()
    assert [n for stage in preview(world, "p") for n in stage.nodes] == ["node-1", "node-2"]
    assert isinstance(plan(world, "p").actions[0], EnsureRevision)
