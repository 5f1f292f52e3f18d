"""Property tests: random fleets, policies, faults and user actions through the simulator.

Safety is checked at every step by the simulator (see Sim._check_action, check_invariants,
check_pods and check_holds): never more nodes in flight than maxUnavailable, never an action on a node outside the
selector or owned by an older policy or in flight for another one, never a start while paused,
never a label naming a revision that does not exist (so every node always has exactly one
revision or the baseline, and a kube-proxy DaemonSet whose pod runs there), never a rule hold kept by a
node whose record no longer names the hold's migration in flight, never a switch that claims a hold the
agent does not keep.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simulator import Faults, Sim, edit, make_policy

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.executor import in_waves
from proxyshift.planner.planner import plan
from proxyshift.planner.world import Action, SetMigration, World

pytestmark = pytest.mark.unit

PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pools = st.sampled_from(["blue", "green"])
selectors = st.one_of(
    st.builds(lambda pool: {"matchLabels": {"pool": pool}}, pools),
    st.just({}),
    st.just({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["blue", "green"]}]}),
)
max_unavailable = st.one_of(st.integers(1, 3), st.sampled_from(["10%", "34%", "50%", "100%"]))
stage_lists = st.one_of(
    st.none(),
    st.just([{"nodes": 1, "pause": "30s"}, {"percent": 100}]),
    st.just([{"percent": 25}, {"percent": 60, "pause": "10s"}, {"percent": 100}]),
)


@st.composite
def policies(draw: st.DrawFn, count: int) -> list[ProxyPolicy]:
    result = []
    for i in range(count):
        rollout: dict[str, Any] = {"maxUnavailable": draw(max_unavailable), "cordon": draw(st.booleans())}
        stages = draw(stage_lists)
        if stages:
            rollout["stages"] = stages
        result.append(make_policy(
            f"pol{i}", draw(st.sampled_from(["nftables", "iptables"])), draw(selectors),
            created=f"2026-11-30T0{draw(st.integers(0, 3))}:00:00Z", rollout=rollout,
        ))
    return result


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, dict[str, str]]:
    n = draw(st.integers(1, 9))
    return {f"node-{i}": {"pool": draw(pools)} for i in range(1, n + 1)}


def faults_for(draw: st.DrawFn, nodes: list[str]) -> Faults:
    some = st.sets(st.sampled_from(nodes), max_size=2)
    modes = st.sampled_from(["nftables", "iptables"])
    return Faults(
        preflight_fail=draw(some),
        crash={(n, draw(modes)) for n in draw(some)},
        wrong_mode={(n, "nftables") for n in draw(some)},
        sync_failures={(n, draw(modes)) for n in draw(some)},
        cleanup_fail=draw(some),
        hold_fail=draw(some),
        restart_prepared=draw(some),
        agent_dead=draw(st.sets(st.sampled_from(nodes), max_size=1)),
    )


def set_paused(sim: Sim, name: str, paused: bool) -> None:
    edit(sim, name, rollout={**sim.policies[name].spec.to_k8s().get("rollout", {}), "paused": paused})


def change_mode(sim: Sim, name: str) -> None:
    p = sim.policies[name]
    spec = p.spec.to_k8s()
    spec["mode"] = "iptables" if spec["mode"] == "nftables" else "nftables"
    meta = dict(p.metadata, generation=int(p.metadata.get("generation", 1)) + 1)
    sim.policies[name] = ProxyPolicy.model_validate({"metadata": meta, "spec": spec, "status": p.status.to_k8s()})


def user_action(sim: Sim, draw: st.DrawFn) -> None:
    kind = draw(st.sampled_from(["pause", "resume", "mode", "relabel", "add", "remove", "delete", "retry", "none"]))
    live = sorted(n for n in sim.policies if n not in sim.finalized)
    if not live:
        return
    target = draw(st.sampled_from(live))
    if kind == "pause":
        set_paused(sim, target, True)
    elif kind == "resume":
        set_paused(sim, target, False)
    elif kind == "mode":
        change_mode(sim, target)
    elif kind == "relabel" and sim.nodes:
        node = draw(st.sampled_from(sorted(sim.nodes)))
        view = sim.nodes[node]
        sim.nodes[node] = replace(view, labels={**view.labels, "pool": draw(pools)})
    elif kind == "add":
        name = f"node-{len(sim.nodes) + 100}"
        if name not in sim.nodes:
            from proxyshift.planner.world import NodeView

            sim.nodes[name] = NodeView(name, {"pool": draw(pools)})
            sim.proxynodes[name] = sim._new_proxynode(name)
            sim.pods[name] = [sim._new_pod(name, "kube-proxy", ready=True)]
    elif kind == "remove" and len(sim.nodes) > 1:
        node = draw(st.sampled_from(sorted(sim.nodes)))
        for table in (sim.nodes, sim.proxynodes, sim.pods):
            table.pop(node, None)
    elif kind == "delete":
        p = sim.policies[target]
        sim.policies[target] = p.model_copy(update={"metadata": dict(p.metadata,
                                                                     deletionTimestamp="2026-11-30T13:00:00Z")})
    elif kind == "retry":
        p = sim.policies[target]
        token = str(draw(st.integers(0, 1000)))
        meta = dict(p.metadata, annotations={"proxyshift.io/retry": token})
        sim.policies[target] = p.model_copy(update={"metadata": meta})


def crash_while_performing(sim: Sim, name: str, world: World, actions: list[Action], after_others: frozenset[str],
                           draw: Any) -> None:
    """What a crash leaves, as the executor performs a plan: each node's steps in order but the nodes side
    by side, so any subset of the nodes got any prefix of their steps (the nodes granted a slot another
    node's Done frees in the same plan only once every other node's steps succeeded); the policy's own steps (revisions,
    status, finalizer) run only after every node's steps succeeded, and a crash may cut those short too."""
    waves, policy_steps = in_waves(actions, after_others)
    every_node_done = True
    for wave in waves:
        if not every_node_done:
            break  # a late grant's steps run only after every other node's succeeded
        for group in wave:
            done = draw(st.integers(0, len(group)))
            for action in group[:done]:
                sim.apply(name, action, world)
            every_node_done = every_node_done and done == len(group)
    if every_node_done:
        for action in policy_steps[: draw(st.integers(0, len(policy_steps)))]:
            sim.apply(name, action, world)


@PROPS
@given(data=st.data())
def test_safety_under_random_faults_and_user_actions(data: st.DataObject) -> None:
    nodes = data.draw(fleets())
    pols = data.draw(policies(data.draw(st.integers(1, 3))))
    # DataObject.draw is a DrawFn (its label defaults to None); hypothesis types it as a plain method.
    sim = Sim.build(nodes, pols, faults=faults_for(data.draw, sorted(nodes)))  # type: ignore[arg-type]
    for i in range(160):
        if i % 20 == 10:
            user_action(sim, data.draw)  # type: ignore[arg-type]  # a DrawFn, as above
        crash = data.draw(st.integers(0, 9)) == 0
        if crash:  # the operator dies part-way through performing a plan
            name = data.draw(st.sampled_from(sorted(sim.policies)))
            if name not in sim.finalized:
                world = sim.world()
                planned = plan(world, name)
                crash_while_performing(sim, name, world, planned.actions, planned.after_others, data.draw)
                sim.check_invariants()
        else:
            sim.step()
        sim.tick(data.draw(st.sampled_from([1.0, 1.0, 5.0, 30.0])))
    assert sim.violations == [], sim.violations[:5]


@PROPS
@given(data=st.data())
def test_rollout_without_faults_converges_to_ready(data: st.DataObject) -> None:
    nodes = data.draw(fleets())
    pols = data.draw(policies(data.draw(st.integers(1, 2))))
    sim = Sim.build(nodes, pols)
    sim.run(max_steps=1500, tick=2.0)
    sim.step()
    assert sim.violations == [], sim.violations[:5]
    for name, p in sim.policies.items():
        st_ = p.status
        assert st_.phase in ("Ready", "Conflict"), (name, st_.phase, st_.progress, st_.in_flight)
        assert st_.nodes.updated == st_.nodes.selected
        rev = sim.render(p).name
        owned = [n for n, pn in sim.proxynodes.items() if pn.spec.policy == name]
        assert all(sim.nodes[n].revision == rev for n in owned)


@PROPS
@given(data=st.data())
def test_revert_deletion_always_finishes_on_the_baseline(data: st.DataObject) -> None:
    nodes = data.draw(fleets())
    (pol,) = data.draw(policies(1))
    sim = Sim.build(nodes, [pol])
    sim.run(max_steps=data.draw(st.integers(0, 60)))
    p = sim.policies[pol.name]
    sim.policies[pol.name] = p.model_copy(update={"metadata": dict(p.metadata,
                                                                   deletionTimestamp="2026-11-30T13:00:00Z")})
    sim.run(max_steps=1500, tick=2.0, until=lambda: pol.name in sim.finalized)
    assert pol.name in sim.finalized
    assert all(v.revision is None for v in sim.nodes.values()) and sim.revisions == {}
    assert not any(v.unschedulable for v in sim.nodes.values())
    assert sim.violations == [], sim.violations[:5]


# ---- the rule hold made with the preflight, while the node waits Prepared ----

def _held_fleet(n: int = 5, **rollout: Any) -> Sim:
    pol = make_policy("pol0", "nftables", {"matchLabels": {"pool": "blue"}},
                      rollout={"maxUnavailable": 1, "preflightAhead": True, **rollout})
    return Sim.build({f"node-{i}": {"pool": "blue"} for i in range(1, n + 1)}, [pol])


def _switches(sim: Sim, held: bool) -> list[str]:
    return [e.node or "" for e in sim.events("Switching") if ("rules held since the preflight" in e.message) is held]


def test_nodes_waiting_prepared_hold_their_rules_and_switch_without_a_hold_round_trip() -> None:
    sim = _held_fleet()
    prepared_with_hold: set[str] = set()
    for _ in range(600):
        sim.step()
        sim.tick(1.0)
        prepared_with_hold |= {n for n in sim.nodes if sim.phase(n) == "Prepared" and n in sim.holds}
        if sim.settled():
            break
    assert sim.settled() and sim.violations == [], sim.violations[:5]
    assert len(prepared_with_hold) >= 3  # the ahead preflights held while another node gated
    assert sorted(_switches(sim, held=True)) == sorted(sim.nodes) and _switches(sim, held=False) == []
    assert not any(w.operation is not None and w.operation.type == "Hold" for w in sim.actions(SetMigration))
    assert sim.holds == {}


def test_from_nftables_the_hold_is_made_at_the_switch_only() -> None:
    """The proxyshift-hold nft table would hook before the live kube-proxy's and serve every connection from a
    snapshot while the node waits: from nftables the preflight asks for no hold, every switch asks its own."""
    pol = make_policy("pol0", "iptables", {"matchLabels": {"pool": "blue"}},
                      rollout={"maxUnavailable": 1, "preflightAhead": True})
    sim = Sim.build({f"node-{i}": {"pool": "blue"} for i in range(1, 4)}, [pol], baseline_mode="nftables")
    sim.run(max_steps=600)
    assert sim.settled() and sim.violations == [], sim.violations[:5]
    assert _switches(sim, held=True) == [] and sorted(_switches(sim, held=False)) == sorted(sim.nodes)
    holds = [w.node for w in sim.actions(SetMigration) if w.operation is not None and w.operation.type == "Hold"]
    assert sorted(holds) == sorted(sim.nodes)


def test_a_kube_proxy_restart_while_prepared_ends_the_hold_and_the_switch_says_so_and_holds_again() -> None:
    sim = _held_fleet(3)
    sim.faults.restart_prepared = {"node-2"}
    sim.run(max_steps=600)
    assert sim.settled() and sim.violations == [], sim.violations[:5]
    assert "node-2" in sim.restarted
    assert [e.node for e in sim.events("RuleHoldLost")] == ["node-2"]
    assert "node-2" not in _switches(sim, held=True) and "node-2" in _switches(sim, held=False)
    holds = [w.node for w in sim.actions(SetMigration) if w.operation is not None and w.operation.type == "Hold"]
    assert holds == ["node-2"]


@pytest.mark.parametrize(("leave", "reason"), [("pause", "Paused"), ("halt", "Halted"), ("relabel", "Superseded"),
                                               ("delete", "Superseded"), ("expire", "PreflightExpired")])
def test_a_prepared_node_that_leaves_without_switching_keeps_no_hold(leave: str, reason: str) -> None:
    sim = _held_fleet(4)
    if leave == "halt":
        sim.faults.crash = {("node-1", "nftables")}  # node-1's switch fails: its rollback halts the rollout

    def prepared_and_held() -> bool:
        return any(sim.phase(n) == "Prepared" and n in sim.holds for n in sim.nodes)

    sim.run(max_steps=300, until=prepared_and_held)
    held = sorted(n for n in sim.nodes if sim.phase(n) == "Prepared" and n in sim.holds)
    assert held
    if leave == "pause":
        set_paused(sim, "pol0", True)
    elif leave == "relabel":
        for n in held:
            sim.nodes[n] = replace(sim.nodes[n], labels={"pool": "green"})
    elif leave == "delete":
        p = sim.policies["pol0"]
        sim.policies["pol0"] = p.model_copy(update={"metadata": dict(p.metadata,
                                                                     deletionTimestamp="2026-11-30T13:00:00Z")})
    elif leave == "expire":
        sim.faults.agent_dead = {"node-1"}  # node-1's gate probe goes unanswered: no slot comes free in time
    for _ in range(300):
        sim.step()
        sim.tick(1.0)
        if any(e.node in held and e.reason == reason for e in sim.events()) and not any(n in sim.holds for n in held):
            break
    assert sim.violations == [], sim.violations[:5]
    told = sorted({(e.node or "", e.reason) for e in sim.events()})
    assert {e.node for e in sim.events(reason)} >= set(held), (leave, told)
    assert not any(n in sim.holds for n in held), (leave, held, sim.holds)
