"""Rollout rules of the planner, driven through the scenario simulator."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from simulator import Faults, Sim, edit, make_policy

from proxyshift.planner.machine import UNTOUCHED
from proxyshift.planner.planner import plan, resolve_max_unavailable, stage_targets
from proxyshift.planner.preview import preview
from proxyshift.planner.world import (
    DeleteRevision,
    EnsureRevision,
    Event,
    NodeView,
    RecordStatus,
    RemoveFinalizer,
    SetMigration,
    SetRevisionLabel,
)

pytestmark = pytest.mark.unit


def blue(n: int, prefix: str = "node-") -> dict[str, dict[str, str]]:
    return {f"{prefix}{i}": {"pool": "blue"} for i in range(1, n + 1)}


def annotate(sim: Sim, name: str, key: str, value: str) -> None:
    p = sim.policies[name]
    meta = dict(p.metadata, annotations={**(p.metadata.get("annotations") or {}), key: value})
    sim.policies[name] = p.model_copy(update={"metadata": meta})


def delete(sim: Sim, name: str) -> None:
    p = sim.policies[name]
    sim.policies[name] = p.model_copy(update={"metadata": dict(p.metadata, deletionTimestamp="2026-11-30T13:00:00Z")})


def starts(sim: Sim) -> list[str]:
    """Nodes in the order their migrations were started."""
    return [a.node for _, _, a in sim.log
            if isinstance(a, SetMigration) and a.migration is not None and a.migration.phase == "Preflight"
            and a.operation is not None and a.operation.id.endswith("Preflight.0")]


def condition(sim: Sim, policy: str, type_: str) -> tuple[str, str, str]:
    c = next(c for c in sim.policies[policy].status.conditions if c.type == type_)
    return c.status, c.reason, c.message


def test_rollout_converges_in_natural_name_order() -> None:
    sim = Sim.build(blue(11), [make_policy("p")])
    sim.run()
    assert sim.violations == []
    rev = sim.render(sim.policies["p"]).name
    assert all(v.revision == rev for v in sim.nodes.values())
    assert starts(sim) == [f"node-{i}" for i in range(1, 12)]
    st = sim.policies["p"].status
    assert (st.phase, st.progress, st.observed_generation, st.current_revision) == ("Ready", "11/11", 1, rev)
    assert condition(sim, "p", "Ready")[:2] == ("True", "RolloutComplete")
    assert condition(sim, "p", "Progressing")[0] == "False"
    assert st.in_flight == [] and st.failed == []


def test_revision_is_ensured_before_any_node_moves() -> None:
    """The first plan creates the revision; a node's preflight may start beside it (it reads the node only),
    but no node is switched while its revision does not exist: a slow creation keeps it Prepared."""
    sim = Sim.build(blue(2), [make_policy("p")])
    first = plan(sim.world(), "p")
    assert isinstance(first.actions[0], EnsureRevision)
    assert first.actions[0].reason == "RevisionCreated"
    started = [a.migration.phase for a in first.actions if isinstance(a, SetMigration) and a.migration]
    assert started == ["Preflight"]
    for _ in range(6):  # the revision's creation is held back: the preflight passes meanwhile
        world = sim.world()
        for action in plan(world, "p").actions:
            assert not isinstance(action, SetRevisionLabel), action
            if not isinstance(action, EnsureRevision):
                sim.apply("p", action, world)
        sim.tick()
    assert sim.phase("node-1") == "Prepared" and not sim.revisions
    sim.run()
    assert sim.violations == [] and {sim.phase(n) for n in ("node-1", "node-2")} == {"Done"}


def test_an_existing_revision_is_applied_again_quietly_on_every_plan() -> None:
    """Server-side apply writes nothing while the revision matches its rendering, so the planner asks for it
    on every plan (a baseline image change reaches the revision) without an Event or a wakeup each time."""
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.step()
    rev = sim.render(sim.policies["p"]).name
    assert rev in sim.revisions
    again = plan(sim.world(), "p")
    ensures = [a for a in again.actions if isinstance(a, EnsureRevision)]
    assert ensures == [EnsureRevision(policy="p", revision=rev, existing=True)]
    assert ensures[0].reason == ""  # the executor announces only actions with a reason


@pytest.mark.parametrize(("value", "total", "expected"), [(1, 10, 1), (3, 10, 3), ("25%", 10, 2), ("1%", 10, 1),
                                                          ("100%", 7, 7), ("50%", 0, 1)])
def test_max_unavailable_resolution(value: int | str, total: int, expected: int) -> None:
    assert resolve_max_unavailable(value, total) == expected


def _in_flight_phases_per_step(sim: Sim, steps: int = 200) -> list[list[str]]:
    """The in-flight nodes' phases after each plan, until the rollout settles."""
    seen = []
    for _ in range(steps):
        sim.step()
        seen.append([pn.spec.migration.phase for pn in sim.proxynodes.values() if pn.spec.migration is not None
                     and pn.spec.migration.phase not in ("Done", "Failed", "RolledBack", "Pending")])
        if sim.settled():
            break
        sim.tick()
    return seen


def test_max_unavailable_percent_runs_nodes_in_parallel() -> None:
    sim = Sim.build(blue(8), [make_policy("p", rollout={"maxUnavailable": "50%"})])
    seen = _in_flight_phases_per_step(sim)
    peak = max(sum(ph not in UNTOUCHED for ph in phases) for phases in seen)
    peak_ahead = max(sum(ph in UNTOUCHED for ph in phases) for phases in seen)
    # 4 nodes switched at once; 4 more ran their preflight ahead meanwhile (rollout.preflightAhead).
    assert (peak, peak_ahead) == (4, 4) and sim.violations == []


def test_the_next_node_s_preflight_runs_during_this_node_s_gate_and_it_switches_after() -> None:
    sim = Sim.build(blue(3), [make_policy("p")])
    sim.run(until=lambda: sim.phase("node-1") == "Gate")
    sim.run(max_steps=50, until=lambda: sim.phase("node-2") == "Prepared")
    assert sim.phase("node-2") == "Prepared" and sim.phase("node-1") not in ("Done", None)
    assert sim.phase("node-3") is None  # maxUnavailable 1: one node ahead, not two
    sim.run()
    labels = [a.node for a in sim.actions(SetRevisionLabel)]
    assert labels == ["node-1", "node-2", "node-3"] and sim.violations == []



@pytest.mark.parametrize(("cleanup", "last"), [({}, "Gate"), ({"inGate": False}, "Cleanup")])
def test_the_plan_that_finishes_a_node_switches_the_prepared_one_after_it(cleanup: dict[str, Any], last: str) -> None:
    """The slot a node's Done frees goes to the Prepared node in the same plan, whose steps come after
    every other node's (Plan.after_others): one plan cycle per node sooner, never two nodes touched. A node
    finishes from its Gate when the probe flushed (cleanup.inGate), else from its Cleanup step."""
    sim = Sim.build(blue(3), [make_policy("p", extra_spec={"cleanup": cleanup})])
    sim.run(max_steps=200, until=lambda: sim.phase("node-1") == last and sim.phase("node-2") == "Prepared")
    assert (sim.phase("node-1"), sim.phase("node-2")) == (last, "Prepared")
    for _ in range(10):  # until the agent has answered the probe or the cleanup
        sim.tick()
        result = sim.step()["p"]
        if sim.phase("node-1") != last:
            break
    assert result.after_others == frozenset({"node-2"})
    assert (sim.phase("node-1"), sim.phase("node-2")) == ("Done", "Switch")
    touched = [i for i, a in enumerate(result.actions) if isinstance(a, SetMigration) and a.node == "node-2"]
    finished = [i for i, a in enumerate(result.actions) if isinstance(a, SetMigration) and a.node == "node-1"]
    assert finished and touched and max(finished) < min(touched)
    sim.run()
    assert sim.violations == [] and sim.phase("node-3") == "Done"



def test_the_plan_that_finishes_the_last_node_records_the_policy_ready() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    for _ in range(200):
        sim.step()
        if sim.phase("node-2") == "Done":
            break
        sim.tick()
    status = sim.policies["p"].status
    assert sim.phase("node-2") == "Done" and status.phase == "Ready" and status.progress == "2/2"
    assert not status.in_flight and sim.violations == []



@pytest.mark.parametrize(("faults", "phase"), [
    (Faults(preflight_fail={"node-1"}), "Failed"),
    (Faults(sync_failures={("node-1", "nftables")}), "RollingBack"),
])
def test_the_plan_in_which_a_node_fails_records_the_policy_degraded(faults: Faults, phase: str) -> None:
    """The status describes the nodes as the plan leaves them: no plan passes with the node failed (or
    rolling back) and the policy not yet Degraded."""
    sim = Sim.build(blue(2), [make_policy("p")], faults=faults)
    for _ in range(200):
        sim.step()
        if sim.phase("node-1") == phase:
            break
        sim.tick()
    status = sim.policies["p"].status
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert sim.phase("node-1") == phase and status.phase == "Degraded" and degraded.status == "True"
    assert "node-1" in degraded.message or "rolling back" in degraded.message


def test_without_preflight_ahead_every_node_in_flight_counts() -> None:
    sim = Sim.build(blue(8), [make_policy("p", rollout={"maxUnavailable": "50%", "preflightAhead": False})])
    peak = max(len(phases) for phases in _in_flight_phases_per_step(sim))
    assert peak == 4 and sim.violations == [] and sim.phase("node-8") == "Done"
    assert not [e for e in sim.events() if e.reason in ("Paused", "Halted", "PreflightExpired")]


def test_stages_pause_between_them() -> None:
    rollout = {"stages": [{"nodes": 1, "pause": "10m"}, {"percent": 50, "pause": "5m"}, {"percent": 100}]}
    sim = Sim.build(blue(6), [make_policy("p", rollout=rollout)])
    assert stage_targets(sim.policies["p"], 6) == [1, 3, 6]
    sim.run(until=lambda: sim.policies["p"].status.stage == 1)
    done_at = sim.now
    st = sim.policies["p"].status
    assert st.progress == "1/6" and st.stage == 1
    # Nothing new starts during the 10m pause.
    sim.run(max_steps=590, until=lambda: len(starts(sim)) > 1)
    assert len(starts(sim)) == 1 or sim.now >= done_at + timedelta(minutes=10)
    sim.run(max_steps=2000, until=lambda: len(starts(sim)) > 1)
    assert sim.now >= done_at + timedelta(minutes=10)
    sim.run(max_steps=3000, tick=5)
    assert sim.policies["p"].status.phase == "Ready" and sim.policies["p"].status.stage == 2
    assert [e.reason for e in sim.events() if e.node is None].count("StageCompleted") == 2
    assert sim.violations == []


def test_pause_between_nodes() -> None:
    sim = Sim.build(blue(2), [make_policy("p", rollout={"pauseBetweenNodes": "1m"})])
    sim.run(until=lambda: sim.phase("node-1") == "Done")
    finished = sim.now
    sim.run(max_steps=1000, until=lambda: sim.phase("node-2") is not None)
    assert sim.now >= finished + timedelta(minutes=1)


def test_paused_lets_in_flight_finish_and_starts_nothing() -> None:
    sim = Sim.build(blue(3), [make_policy("p")])
    sim.run(until=lambda: sim.phase("node-1") == "Gate")
    edit(sim, "p", rollout={"paused": True})
    sim.run(max_steps=100)
    # node-2's preflight ran ahead during node-1's gate; paused, it goes back to Pending untouched.
    assert sim.phase("node-1") == "Done" and sim.phase("node-2") in (None, "Pending")
    assert not [a for a in sim.actions(SetRevisionLabel) if a.node == "node-2"]
    assert sim.policies["p"].status.phase == "Paused"
    assert condition(sim, "p", "Paused")[:2] == ("True", "RolloutPaused")
    assert plan(sim.world(), "p").requeue_after_seconds is None
    edit(sim, "p", rollout={"paused": False})
    sim.run()
    assert sim.policies["p"].status.phase == "Ready" and sim.violations == []


def test_older_policy_wins_and_newer_reports_conflict() -> None:
    nodes = blue(3) | {"node-9": {"pool": "blue", "zone": "a"}}
    older = make_policy("old", "nftables", created="2026-11-30T09:00:00Z")
    newer = make_policy("new", "iptables", {"matchLabels": {"zone": "a"}}, created="2026-11-30T11:00:00Z")
    sim = Sim.build(nodes, [newer, older])
    sim.run()
    assert sim.nodes["node-9"].revision == sim.render(older).name
    status, reason, message = condition(sim, "new", "Conflict")
    assert (status, reason) == ("True", "NodesOwnedByOlderPolicy") and "node-9" in message and "old" in message
    assert sim.policies["new"].status.conflicting_nodes == ["node-9"]
    assert sim.policies["new"].status.nodes.selected == 0
    assert condition(sim, "old", "Conflict")[0] == "False"
    assert sim.violations == []


def test_same_timestamp_breaks_ties_by_name() -> None:
    a = make_policy("a", "nftables")
    b = make_policy("b", "iptables")
    sim = Sim.build(blue(1), [b, a])
    sim.run()
    assert sim.nodes["node-1"].revision == sim.render(a).name


def test_nodes_appearing_and_disappearing_mid_rollout() -> None:
    sim = Sim.build(blue(3), [make_policy("p")])
    sim.run(until=lambda: sim.phase("node-1") == "Done")
    sim.nodes["node-4"] = NodeView("node-4", {"pool": "blue"})
    sim.proxynodes["node-4"] = sim._new_proxynode("node-4")
    sim.pods["node-4"] = [sim._new_pod("node-4", "kube-proxy", ready=True)]
    del sim.nodes["node-3"], sim.proxynodes["node-3"], sim.pods["node-3"]
    sim.run()
    st = sim.policies["p"].status
    assert st.progress == "3/3" and sim.nodes["node-4"].revision is not None and sim.violations == []


def test_node_without_proxynode_gets_one_first() -> None:
    sim = Sim.build(blue(2), [make_policy("p")], create_proxynodes=False)
    sim.run()
    assert sim.policies["p"].status.progress == "2/2" and sim.violations == []


def test_spec_change_mid_rollout_moves_everyone_to_the_new_revision() -> None:
    sim = Sim.build(blue(4), [make_policy("p", "nftables")])
    old = sim.render(sim.policies["p"]).name
    sim.run(until=lambda: sim.phase("node-2") == "Gate")
    edit(sim, "p", mode="ipvs")
    new = sim.render(sim.policies["p"]).name
    world = sim.world()
    first = plan(world, "p")
    assert any(isinstance(a, EnsureRevision) and a.revision == new for a in first.actions)
    sim.run(max_steps=800)
    assert all(v.revision == new for v in sim.nodes.values())
    assert any(isinstance(a, DeleteRevision) and a.revision == old for a in sim.actions(DeleteRevision))
    assert old not in sim.revisions and sim.violations == []
    # node-2 was mid-gate: it finished on the old revision, then moved again.
    node2 = [a.revision for a in sim.actions(SetRevisionLabel) if a.node == "node-2"]
    assert node2 == [old, new]


def test_failure_halts_until_retry_annotation() -> None:
    faults = Faults(sync_failures={("node-2", "nftables")})
    sim = Sim.build(blue(4), [make_policy("p")], faults=faults)
    sim.run()
    sim.step()
    st = sim.policies["p"].status
    assert st.phase == "Degraded" and [f.name for f in st.failed] == ["node-2"]
    assert st.failed[0].phase == "RolledBack" and st.failed[0].reason == "SyncFailures"
    # halted: nothing after the failure was switched (node-3's preflight, run ahead, went back to Pending)
    assert sim.phase("node-3") in (None, "Pending")
    assert not [a for a in sim.actions(SetRevisionLabel) if a.node in ("node-3", "node-4")]
    assert sim.nodes["node-2"].revision is None  # back on the baseline
    status, reason, message = condition(sim, "p", "Degraded")
    assert (status, reason) == ("True", "NodeRolledBack") and "proxyshift.io/retry" in message
    assert any(e.reason == "SyncFailures" and e.type == "Warning" for e in sim.events())
    # Stays halted.
    for _ in range(30):
        sim.step()
        sim.tick(10)
    assert sim.phase("node-3") in (None, "Pending")
    sim.faults.sync_failures.clear()
    annotate(sim, "p", "proxyshift.io/retry", "1")
    sim.run()
    sim.step()
    assert sim.policies["p"].status.phase == "Ready" and sim.policies["p"].status.retry_token == "1"
    assert condition(sim, "p", "Degraded")[0] == "False" and sim.violations == []


def test_spec_generation_change_also_retries() -> None:
    sim = Sim.build(blue(2), [make_policy("p")], faults=Faults(preflight_fail={"node-1"}))
    sim.run()
    sim.step()
    assert sim.policies["p"].status.phase == "Degraded" and sim.nodes["node-1"].revision is None
    sim.faults.preflight_fail.clear()
    edit(sim, "p", gate={"timeout": "3m"})  # same revision, new generation
    sim.run()
    assert sim.policies["p"].status.phase == "Ready"


def test_condition_transition_time_kept_while_status_unchanged() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    before = {c.type: c.last_transition_time for c in sim.policies["p"].status.conditions}
    sim.tick(300)
    result = plan(sim.world(), "p")
    assert not any(isinstance(a, RecordStatus) for a in result.actions)  # nothing changed: no write
    assert {c.type: c.last_transition_time for c in sim.policies["p"].status.conditions} == before


def test_delete_with_revert_returns_every_node_to_baseline() -> None:
    sim = Sim.build(blue(3), [make_policy("p")])
    sim.run()
    rev = sim.render(sim.policies["p"]).name
    delete(sim, "p")
    sim.run(max_steps=600, until=lambda: "p" in sim.finalized)
    assert "p" in sim.finalized
    assert all(v.revision is None for v in sim.nodes.values())
    assert [a.revision for a in sim.actions(DeleteRevision)] == [rev] and sim.revisions == {}
    assert all(pn.spec.policy is None for pn in sim.proxynodes.values())
    assert sim.violations == []


def test_delete_mid_rollout_lets_in_flight_finish_then_reverts() -> None:
    sim = Sim.build(blue(3), [make_policy("p", rollout={"paused": False})])
    sim.run(until=lambda: sim.phase("node-2") == "Switch")
    delete(sim, "p")
    sim.run(max_steps=600, until=lambda: "p" in sim.finalized)
    assert "p" in sim.finalized and all(v.revision is None for v in sim.nodes.values())
    assert sim.violations == []


def test_delete_with_orphan_leaves_labels_and_revisions() -> None:
    sim = Sim.build(blue(2), [make_policy("p", extra_spec={"deletionPolicy": "Orphan"})])
    sim.run()
    rev = sim.render(sim.policies["p"]).name
    delete(sim, "p")
    sim.step()
    assert "p" in sim.finalized
    assert all(v.revision == rev for v in sim.nodes.values()) and rev in sim.revisions
    assert all(pn.spec.policy is None for pn in sim.proxynodes.values())
    assert not sim.actions(DeleteRevision)


def test_node_leaving_the_pool_goes_back_to_baseline() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    sim.nodes["node-2"] = replace(sim.nodes["node-2"], labels={**sim.nodes["node-2"].labels, "pool": "green"})
    sim.run(until=lambda: sim.proxynodes["node-2"].spec.policy is None)
    assert sim.nodes["node-2"].revision is None and sim.policies["p"].status.progress == "1/1"
    assert sim.violations == []


def test_operator_crash_between_actions_is_survived() -> None:
    """Perform only the first k actions of some plans (a crash), then carry on: same end state."""
    sim = Sim.build(blue(3), [make_policy("p", rollout={"cordon": True})])
    for i in range(400):
        world = sim.world()
        result = plan(world, "p")
        cut = len(result.actions) if i % 3 else max(0, len(result.actions) // 2)
        for action in result.actions[:cut]:
            sim.apply("p", action, world)
        sim.check_invariants()
        if sim.settled() and sim.policies["p"].status.phase == "Ready":
            break
        sim.tick()
    assert sim.policies["p"].status.progress == "3/3"
    assert not any(v.unschedulable for v in sim.nodes.values()) and sim.violations == []


def test_every_step_has_an_event() -> None:
    sim = Sim.build(blue(1), [make_policy("p", rollout={"cordon": True})])
    sim.run()
    reasons = [e.reason for e in sim.events() if e.node == "node-1"]
    assert reasons == ["MigrationStarted", "Cordoned", "Switching", "Gate", "GatePassed", "Migrated"]
    assert any(isinstance(a, Event) and a.node is None and a.reason == "RolloutComplete" for a in sim.events())


def test_status_stays_small_at_5000_nodes() -> None:
    long = "x" * 40
    nodes = {f"ip-10-0-{i // 250}-{i % 250}.{long}.compute.internal": {"pool": "blue"} for i in range(5000)}
    sim = Sim.build(nodes, [make_policy("p", rollout={"maxUnavailable": "10%"})])
    sim.step()
    sim.tick()
    result = plan(sim.world(), "p")
    record = next(a for a in result.actions if isinstance(a, RecordStatus))
    assert record.status.nodes.selected == 5000 and record.status.nodes.in_flight == 500
    size = len(json.dumps(record.status.to_k8s()))
    assert len(record.status.in_flight) == 20 and size < 12 * 1024, size


def test_preview_lists_stages_and_predicted_preflight_failures() -> None:
    rollout = {"stages": [{"nodes": 1, "pause": "10m"}, {"percent": 50}, {"percent": 100}]}
    sim = Sim.build(blue(6) | {"other": {"pool": "green"}}, [make_policy("p", "ipvs", rollout=rollout)])
    pn = sim.proxynodes["node-3"]
    pn.status.modules = ["nf_conntrack", "ip_vs", "ip_vs_rr"]
    pn.status.tools = {"ipset": "7.19", "iptables": "1.8.10"}
    stages = preview(sim.world(), "p")
    assert [(s.stage, s.nodes, s.pause) for s in stages] == [
        (1, ["node-1"], "10m"), (2, ["node-2", "node-3"], None), (3, ["node-4", "node-5", "node-6"], None)]
    assert "node-3" not in stages[1].preflight_failures
    assert "ip_vs" in " ".join(stages[1].preflight_failures["node-2"])


def test_nothing_for_unknown_policy_and_finalized_sim() -> None:
    sim = Sim.build(blue(1), [make_policy("p")])
    assert plan(sim.world(), "nope").actions == []
    delete(sim, "p")
    sim.step()
    assert any(isinstance(a, RemoveFinalizer) for a in sim.actions(RemoveFinalizer))


def test_untouched_preflight_is_abandoned_when_the_spec_changes() -> None:
    sim = Sim.build(blue(2), [make_policy("p", "nftables")], faults=Faults(agent_dead={"node-1"}))
    sim.run(until=lambda: sim.phase("node-1") == "Preflight")
    old = sim.render(sim.policies["p"]).name
    edit(sim, "p", mode="iptables")
    sim.faults.agent_dead.clear()
    sim.run(max_steps=400)
    reasons = [e.reason for e in sim.events() if e.node == "node-1"]
    assert "Superseded" in reasons
    assert not any(a.revision == old for a in sim.actions(SetRevisionLabel))  # never switched to the old one
    assert sim.policies["p"].status.phase == "Ready"


def test_not_ready_nodes_are_skipped_and_keep_their_place() -> None:
    sim = Sim.build(blue(3), [make_policy("p")])
    sim.nodes["node-1"] = replace(sim.nodes["node-1"], ready=False)
    sim.run(max_steps=200, until=lambda: sim.phase("node-3") == "Done")
    assert sim.phase("node-1") is None and starts(sim) == ["node-2", "node-3"]
    sim.nodes["node-1"] = replace(sim.nodes["node-1"], ready=True)
    sim.run()
    assert sim.policies["p"].status.progress == "3/3"


def test_conflict_lists_stay_bounded() -> None:
    nodes = blue(60)
    older = make_policy("old", created="2026-11-30T09:00:00Z")
    newer = make_policy("new", "iptables", {}, created="2026-11-30T11:00:00Z")
    sim = Sim.build(nodes, [older, newer])
    sim.step()
    st = sim.policies["new"].status
    assert st.nodes.conflicting == 60 and len(st.conflicting_nodes) == 20
    status, _, message = condition(sim, "new", "Conflict")
    assert status == "True" and "and 55 more" in message and len(message) <= 400


def test_orphan_deletion_waits_for_in_flight_nodes() -> None:
    sim = Sim.build(blue(2), [make_policy("p", extra_spec={"deletionPolicy": "Orphan"})])
    sim.run(until=lambda: sim.phase("node-1") == "Gate")
    delete(sim, "p")
    sim.step()
    assert "p" not in sim.finalized
    sim.run(max_steps=100, until=lambda: "p" in sim.finalized)
    assert "p" in sim.finalized and sim.phase("node-1") is None  # released after finishing
    assert sim.nodes["node-1"].revision is not None and sim.nodes["node-2"].revision is None
    assert sim.violations == []


def test_preview_predicts_nftables_kernel_and_nft_problems() -> None:
    sim = Sim.build(blue(2), [make_policy("p", "nftables")])
    sim.proxynodes["node-2"].status.kernel_release = "5.4.0-150-generic"
    sim.proxynodes["node-2"].status.tools = {"nft": "0.9.3", "iptables": "1.8.4"}
    (stage,) = preview(sim.world(), "p")
    assert stage.nodes == ["node-1", "node-2"] and list(stage.preflight_failures) == ["node-2"]
    problems = " ".join(stage.preflight_failures["node-2"])
    assert "5.13" in problems and "1.0.1" in problems


def test_finalizer_removal_is_the_last_action_and_no_status_follows() -> None:
    sim = Sim.build(blue(1), [make_policy("p")])
    sim.run()
    delete(sim, "p")
    for _ in range(300):
        result = plan(sim.world(), "p")
        if any(isinstance(a, RemoveFinalizer) for a in result.actions):
            assert isinstance(result.actions[-1], RemoveFinalizer)
            assert not any(isinstance(a, RecordStatus) for a in result.actions)
            return
        world = sim.world()
        for action in result.actions:
            sim.apply("p", action, world)
        sim.tick()
    raise AssertionError("the deletion never finished")


def test_a_migrated_node_whose_kube_proxy_crash_loops_makes_the_policy_degraded_without_a_rollback() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    assert sim.policies["p"].status.phase == "Ready"
    labels = {n: v.revision for n, v in sim.nodes.items()}
    (pod,) = [p for p in sim.pods["node-2"] if not p.deleting]
    sim.pods["node-2"] = [replace(pod, ready=False, restarts=2)]
    sim.step()
    assert condition(sim, "p", "Degraded")[0] == "False"  # a restart or two is not a crash loop
    sim.pods["node-2"] = [replace(pod, ready=False, restarts=5)]
    sim.step()
    status, reason, message = condition(sim, "p", "Degraded")
    assert (status, reason) == ("True", "KubeProxyCrashLooping") and "node-2" in message and "node-1" not in message
    assert sim.policies["p"].status.phase == "Degraded"
    assert condition(sim, "p", "Ready")[0] == "True"  # the rollout itself is complete
    assert {n: v.revision for n, v in sim.nodes.items()} == labels  # nothing was moved
    sim.pods["node-2"] = [replace(pod, ready=True, restarts=5)]
    sim.step()
    assert condition(sim, "p", "Degraded")[:2] == ("False", "AsExpected")


def test_the_plan_tells_how_many_nodes_the_policy_moves() -> None:
    # The executor sizes its Events by it (PROXYSHIFT_NODE_EVENTS=auto).
    sim = Sim.build(blue(3), [make_policy("p")])
    assert plan(sim.world(), "p").details["nodes"] == 3
