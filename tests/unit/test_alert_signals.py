"""The facts the alerts need (planner/signals.py) and the gauges that carry them (controller/metrics.py).

The scenarios run the real planner in the simulator, so the signals are read from the same
statuses and ProxyNode records a live operator would see.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import pytest
from prometheus_client import REGISTRY
from simulator import Faults, Sim, make_policy

from proxyshift.api.proxynode import NodeMigration, ProxyNode
from proxyshift.controller import metrics
from proxyshift.planner.signals import node_signals, policy_signals
from proxyshift.planner.timeutil import parse
from proxyshift.planner.world import RemoveFinalizer

pytestmark = pytest.mark.unit


def blue(n: int) -> dict[str, dict[str, str]]:
    return {f"node-{i}": {"pool": "blue"} for i in range(1, n + 1)}


def delete(sim: Sim, name: str) -> None:
    p = sim.policies[name]
    stamp = sim.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    sim.policies[name] = p.model_copy(update={"metadata": dict(p.metadata, deletionTimestamp=stamp)})


def newest_phase_change(sim: Sim, policy: str) -> float:
    stamps = [parse(m.phase_since) for pn in sim.proxynodes.values()
              if pn.spec.policy == policy and (m := pn.spec.migration) is not None]
    return max(s.timestamp() for s in stamps if s is not None)


def test_a_finished_rollout_is_ready_and_its_progress_is_the_last_phase_change() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    signals = policy_signals(sim.world(), "p", [])
    assert signals is not None
    assert signals.conditions["Ready"] and not signals.conditions["Degraded"] and not signals.revert_halted
    assert signals.last_progress == newest_phase_change(sim, "p")
    assert set(signals.conditions) >= {"Ready", "Progressing", "Degraded", "Paused", "Conflict"}


def test_a_halted_rollout_is_degraded_and_its_progress_stops() -> None:
    sim = Sim.build(blue(3), [make_policy("p")], faults=Faults(sync_failures={("node-1", "nftables")}))
    sim.run(max_steps=400, until=lambda: sim.policies["p"].status.phase == "Degraded" and sim.phase("node-1")
            == "RolledBack")
    sim.tick()
    sim.step()  # node-2's preflight, run ahead, goes back to Pending: the halt's last phase change
    assert sim.phase("node-2") in (None, "Pending")
    halted_at = policy_signals(sim.world(), "p", [])
    assert halted_at is not None and halted_at.conditions["Degraded"] and not halted_at.conditions["Ready"]
    for _ in range(30):
        sim.tick(60)
        sim.step()
    later = policy_signals(sim.world(), "p", [])
    assert later is not None and later.last_progress == halted_at.last_progress
    assert later.last_progress is not None and (sim.now.timestamp() - later.last_progress) >= 30 * 60
    assert not later.revert_halted  # not being deleted


def test_a_revert_that_fails_on_a_node_is_halted_and_a_plan_s_own_writes_are_progress() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    # Going back to the baseline fails on node-1: its iptables kube-proxy counts sync failures.
    sim.faults.sync_failures.add(("node-1", "iptables"))
    sim.tick(3600)
    delete(sim, "p")
    world = sim.world()
    from proxyshift.planner.planner import plan

    first = plan(world, "p")
    signals = policy_signals(world, "p", first.actions)
    assert signals is not None and signals.last_progress == sim.now.timestamp()  # the deletion began now
    sim.run(max_steps=600, until=lambda: sim.policies["p"].status.phase == "Degraded"
            and sim.phase("node-1") == "RolledBack")
    assert "p" not in sim.finalized
    halted = policy_signals(sim.world(), "p", [])
    assert halted is not None and halted.revert_halted and halted.conditions["Degraded"]
    # The runbook's way out: fix the node, then a new retry value resumes the walk back.
    sim.faults.sync_failures.clear()
    p = sim.policies["p"]
    sim.policies["p"] = p.model_copy(update={"metadata": dict(p.metadata, annotations={"proxyshift.io/retry": "1"})})
    sim.run(max_steps=600, until=lambda: "p" in sim.finalized)
    assert "p" in sim.finalized and all(v.revision is None for v in sim.nodes.values())


def test_a_halted_revert_given_up_with_orphan_finishes() -> None:
    sim = Sim.build(blue(2), [make_policy("p")])
    sim.run()
    sim.faults.sync_failures.add(("node-1", "iptables"))
    delete(sim, "p")
    sim.run(max_steps=600, until=lambda: sim.policies["p"].status.phase == "Degraded"
            and sim.phase("node-1") == "RolledBack")
    p = sim.policies["p"]
    spec = p.spec.model_copy(update={"deletion_policy": "Orphan"})
    sim.policies["p"] = p.model_copy(update={"spec": spec})
    sim.run(max_steps=100, until=lambda: "p" in sim.finalized)
    assert "p" in sim.finalized


def test_an_orphan_deletion_is_never_a_halted_revert() -> None:
    sim = Sim.build(blue(1), [make_policy("p", extra_spec={"deletionPolicy": "Orphan"})],
                    faults=Faults(sync_failures={("node-1", "nftables")}))
    sim.run(max_steps=400, until=lambda: sim.policies["p"].status.phase == "Degraded")
    delete(sim, "p")
    signals = policy_signals(sim.world(), "p", [])
    assert signals is not None and signals.conditions["Degraded"] and not signals.revert_halted


def test_a_policy_the_world_does_not_hold_has_no_signals() -> None:
    sim = Sim.build(blue(1), [])
    assert policy_signals(sim.world(), "gone", []) is None


def proxynode(spec: Mapping[str, object] | None = None, status: Mapping[str, object] | None = None) -> ProxyNode:
    return ProxyNode.model_validate({"metadata": {"name": "n1"}, "spec": spec or {}, "status": status or {}})


BEAT = {"heartbeat": "2026-11-30T12:00:00Z"}


def beat_seconds() -> float:
    """BEAT's heartbeat as Unix seconds."""
    at = parse(BEAT["heartbeat"])
    assert at is not None
    return at.timestamp()


@pytest.mark.parametrize(("spec", "status", "baseline", "target", "mismatch"), [
    # a node no policy ever held runs the baseline
    ({}, {**BEAT, "observedMode": "iptables"}, "iptables", "iptables", False),
    ({}, {**BEAT, "observedMode": "ipvs"}, "iptables", "iptables", True),
    ({}, {**BEAT, "observedMode": "ipvs"}, None, "", False),  # baseline not read yet: not judged
    # a migrated node runs its revision's mode
    ({"policy": "p", "revision": "p-1", "mode": "nftables", "migration": {"phase": "Done"}},
     {**BEAT, "observedMode": "nftables"}, "iptables", "nftables", False),
    ({"policy": "p", "revision": "p-1", "mode": "nftables", "migration": {"phase": "Done"}},
     {**BEAT, "observedMode": "iptables"}, "iptables", "nftables", True),
    # kube-proxy not answering /proxyMode on a settled node is a mismatch too
    ({"policy": "p", "revision": "p-1", "mode": "nftables", "migration": {"phase": "Done"}},
     BEAT, "iptables", "nftables", True),
    # mid-migration the modes differ by design
    ({"policy": "p", "revision": "p-1", "mode": "nftables", "migration": {"phase": "Gate"}},
     {**BEAT, "observedMode": "iptables"}, "iptables", "nftables", False),
    # a rolled-back node's target is where it came from
    ({"policy": "p", "mode": "iptables", "migration": {"phase": "RolledBack"}},
     {**BEAT, "observedMode": "iptables"}, "iptables", "iptables", False),
    # an agent that never reported: nothing to compare
    ({}, {}, "iptables", "iptables", False),
])
def test_node_mode_mismatch(spec: dict[str, object], status: dict[str, object], baseline: str | None,
                            target: str, mismatch: bool) -> None:
    signals = node_signals(proxynode(spec, status), baseline)
    assert (signals.target_mode, signals.mode_mismatch) == (target, mismatch)


def test_node_heartbeat_is_unix_seconds_or_none() -> None:
    assert node_signals(proxynode(status=BEAT), "iptables").heartbeat == beat_seconds()
    assert node_signals(proxynode(status={"heartbeat": "not a time"}), "iptables").heartbeat is None
    assert node_signals(proxynode(), "iptables").heartbeat is None


# ---- the gauges ----


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_record_plan_exports_the_policy_signals_and_forgets_them_with_the_finalizer() -> None:
    sim = Sim.build(blue(2), [make_policy("sig-p")])
    sim.run()
    world = sim.world()
    metrics.record_plan("sig-p", world, [])
    assert sample("proxyshift_policy_ready", policy="sig-p") == 1
    assert sample("proxyshift_policy_condition", policy="sig-p", condition="Ready") == 1
    assert sample("proxyshift_policy_condition", policy="sig-p", condition="Degraded") == 0
    assert sample("proxyshift_policy_revert_halted", policy="sig-p") == 0
    assert sample("proxyshift_policy_last_progress_timestamp_seconds", policy="sig-p") == \
        newest_phase_change(sim, "sig-p")
    assert sample("proxyshift_rollbacks_total", policy="sig-p") == 0  # born at 0, so increase() sees the first
    metrics.record_plan("sig-p", world, [RemoveFinalizer(policy="sig-p", reason="Reverted", message="")])
    for name, labels in [("proxyshift_policy_ready", {}), ("proxyshift_policy_revert_halted", {}),
                         ("proxyshift_policy_condition", {"condition": "Ready"}),
                         ("proxyshift_policy_last_progress_timestamp_seconds", {}),
                         ("proxyshift_nodes", {"phase": "Done"})]:
        assert sample(name, policy="sig-p", **labels) is None, name


def test_forget_policy_drops_its_gauges_only() -> None:
    sim = Sim.build(blue(1), [make_policy("sig-a"), make_policy("sig-b", selector={"matchLabels": {"x": "y"}})])
    sim.run()
    metrics.record_plan("sig-a", sim.world(), [])
    metrics.record_plan("sig-b", sim.world(), [])
    metrics.forget_policy("sig-a")
    assert sample("proxyshift_policy_ready", policy="sig-a") is None
    assert sample("proxyshift_policy_ready", policy="sig-b") is not None
    metrics.forget_policy("sig-b")


def test_record_proxynode_sets_replaces_and_removes_the_node_series() -> None:
    name, series = "sig-node", metrics.ProxyNodeSeries()
    done = {"policy": "p", "revision": "p-1", "mode": "nftables", "migration": {"phase": "Done"}}
    series.record(name, proxynode(done, {**BEAT, "observedMode": "iptables"}), "iptables")
    assert sample("proxyshift_proxynode_heartbeat_timestamp_seconds", node=name) == beat_seconds()
    assert sample("proxyshift_proxynode_mode_mismatch", node=name, observed_mode="iptables",
                  target_mode="nftables") == 1
    series.record(name, proxynode(done, {**BEAT, "observedMode": "nftables"}), "iptables")
    assert sample("proxyshift_proxynode_mode_mismatch", node=name, observed_mode="iptables",
                  target_mode="nftables") is None  # the old label set is gone, not left at 1
    assert sample("proxyshift_proxynode_mode_mismatch", node=name, observed_mode="nftables",
                  target_mode="nftables") == 0
    series.record(name, None, "iptables")
    assert sample("proxyshift_proxynode_heartbeat_timestamp_seconds", node=name) is None
    assert sample("proxyshift_proxynode_mode_mismatch", node=name, observed_mode="nftables",
                  target_mode="nftables") is None


def test_a_migration_record_with_a_later_phase_is_progress_now() -> None:
    sim = Sim.build(blue(1), [make_policy("p")])
    sim.step()
    world = sim.world()
    from proxyshift.planner.world import SetMigration

    later = sim.now + timedelta(hours=2)
    stamp = later.strftime("%Y-%m-%dT%H:%M:%SZ")
    action = SetMigration(node="node-1", policy="p", revision=None, mode=None, scheduler=None, operation=None,
                          migration=NodeMigration(phase="Preflight", phase_since=stamp))
    signals = policy_signals(world, "p", [action])
    assert signals is not None and signals.last_progress == later.timestamp()


def test_the_wiring_exports_proxynodes_from_the_mirror_and_follows_the_baseline() -> None:
    from proxyshift.controller.fleet import PROXYNODE_MIRROR, Fleet
    from proxyshift.controller.mirror import Mirror
    from proxyshift.controller.wakeups import Wakers

    fleet = Fleet(Wakers())
    mirror = Mirror(PROXYNODE_MIRROR, list, lambda _: None, fleet.proxynode_changed)
    fleet.mirrors[PROXYNODE_MIRROR] = mirror
    inventory = proxynode({}, {**BEAT, "observedMode": "ipvs"})
    mirror._apply("sig-wired", inventory)  # what the watch thread hands to the event loop
    assert sample("proxyshift_proxynode_heartbeat_timestamp_seconds", node="sig-wired") is not None
    assert sample("proxyshift_proxynode_mode_mismatch", node="sig-wired", observed_mode="ipvs",
                  target_mode="iptables") is None  # the baseline is not known yet
    fleet.baseline_changed("ipvs")
    assert sample("proxyshift_proxynode_mode_mismatch", node="sig-wired", observed_mode="ipvs",
                  target_mode="ipvs") == 0
    fleet.baseline_changed("iptables")
    assert sample("proxyshift_proxynode_mode_mismatch", node="sig-wired", observed_mode="ipvs",
                  target_mode="iptables") == 1
    mirror._apply("sig-wired", None)
    assert sample("proxyshift_proxynode_heartbeat_timestamp_seconds", node="sig-wired") is None


def test_a_policy_s_gauges_go_when_its_loop_ends() -> None:
    sim = Sim.build(blue(1), [make_policy("sig-loop")])
    sim.run()
    with metrics.exported("sig-loop"):
        metrics.record_plan("sig-loop", sim.world(), [])
        assert sample("proxyshift_policy_ready", policy="sig-loop") == 1
    assert sample("proxyshift_policy_ready", policy="sig-loop") is None
