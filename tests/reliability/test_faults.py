"""Faults during a migration, each fired at every node step of ONE migration (issue 8, item 1).

Pool blue (2 nodes) moves iptables -> nftables with cordon+drain and a gate that connects to a
ClusterIP. A StepInjector fires the fault once as a node enters each step (Preflight, Cordon,
Switch, Gate, Cleanup, Uncordon, and Verify whenever a node enters it; test_a_fault_in_verify makes
one do so); continuous TCP probers run through the ClusterIP from all three nodes. An injector that
never saw the nodes, or saw a node in an armed step without firing there (and without being busy
with the previous fault), fails the run. Every run must end with:

- the policy Ready, or Degraded with a reason (which one is expected is per fault, below);
- a running kube-proxy on every node, answering /proxyMode;
- no node switched twice within one attempt (switchedAt and revision-label history);
- no kube-proxy rules of a mode other than the node's current one;
- every traffic outage through the ClusterIP shorter than the gate timeout, and traffic answering
  from every node at the end;
- every failed connection charged to the step its node was in, and no node's visit of a step charged
  more than the fault's loss budget (loss_budget.py, the table docs/reliability.md states).

Each run appends one JSON line (fault, steps fired, outcome, outages, lost_by_step) to the report file
(PROXYSHIFT_RELIABILITY_REPORT, default <cluster>/logs/reliability.jsonl); docs/reliability.md
is written from it.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import realtime_offset
from faults import (
    ALL_NODES,
    ALL_STEPS,
    BLUE,
    VERIFY,
    Faults,
    KubeProxyCrashLoop,
    StepInjector,
    agent_pid,
    check_end_state,
    explaining_log_lines,
    loss_facts,
    record,
    service_answers_everywhere,
)
from loss_budget import budget_of

from proxyshift.api.proxynode import IN_FLIGHT
from tests.support.operator_harness import Harness, migration, policy

pytestmark = pytest.mark.reliability

GATE_TIMEOUT = 60
# A crash loop that starts after the gate passed is only seen as probes that fail until the gate times out.
CRASHLOOP_GATE_TIMEOUT = 30
END_TIMEOUT = 600
CLOCK_SKEW_SECONDS = 30
# Why a node may roll back when its Node object was deleted mid-migration: its re-registered Node is migrated
# from scratch, and a step times out waiting for the pods the new Node is still starting. Which step depends on
# their start-up time, so the set, not one reason (docs/reliability.md, "Node deleted").
NODE_DELETE_REASONS = frozenset({"SwitchTimeout", "KubeProxyCrashLooping", "GateTimeout", "CleanupTimeout"})
MAX_ROUNDS = 5  # migrations per fault at most, to hit every step (see test_fault_at_every_step)
MAX_VERIFY_TRIES = 3  # migrations at most to make a node enter Verify (test_a_fault_in_verify)


def fault_policy(name: str, service: Any, gate_timeout: int = GATE_TIMEOUT, nodes: list[str] = BLUE,
                 cleanup_in_gate: bool = True, cordon: bool = True) -> dict[str, Any]:
    # pool blue, or both pools (blue, green) when the run needs every node
    selector = {"nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["blue", "green"]}]}}
    return policy(name, "nftables", pool="blue" if nodes == BLUE else None, **({} if nodes == BLUE else selector),
                  rollout={"maxUnavailable": 1, "cordon": cordon, "drain": cordon},
                  cleanup={"inGate": cleanup_in_gate},
                  gate={"timeout": f"{gate_timeout}s", "minSyncs": 1,
                        "probeServices": [{"namespace": service.namespace, "name": service.name,
                                           "port": service.port}]})


def settled(h: Harness, name: str, nodes: list[str] = BLUE) -> tuple[str, dict[str, Any]] | None:
    """("Ready"|"Degraded", condition) once the policy says so and none of its nodes is in flight; Ready only
    counts once every node exists and is Done (a deleted Node is briefly not part of the pool at all)."""
    for type_ in ("Ready", "Degraded"):
        cond = h.condition(name, type_)
        body = h.get(name) or {}
        fresh = (body.get("status") or {}).get("observedGeneration") == body["metadata"].get("generation")
        if cond and cond.get("status") == "True" and fresh:
            pns = h.proxynodes()
            phases = [migration(pns[n]).get("phase") if n in pns else None for n in nodes]
            if type_ == "Ready" and any(p != "Done" for p in phases):
                continue
            if not any(p in IN_FLIGHT for p in phases):
                return type_, cond
    return None


def wait_settled(h: Harness, name: str, timeout: float = END_TIMEOUT, nodes: list[str] = BLUE
                 ) -> tuple[str, dict[str, Any]]:
    try:
        return h.wait_for(lambda: settled(h, name, nodes), timeout, f"{name} Ready or Degraded", interval=1.0)
    except BaseException:
        print(h.describe(name))
        raise


def migrate_under(h: Harness, cluster: Any, kube: Any, test_service: Any, tcp_probe: Callable[..., Any],
                  continuous_prober: Callable[..., Any], name: str, fault: Callable[[str, str], str] | None,
                  loss: str, steps: tuple[str, ...] = ALL_STEPS, before_end: Callable[[], None] | None = None,
                  kick: Callable[[], object] | None = None, gate_timeout: int = GATE_TIMEOUT,
                  nodes: list[str] = BLUE, max_per_node: int | None = None, cleanup_in_gate: bool = True,
                  cordon: bool = True) -> tuple[str, dict[str, Any], StepInjector, dict[str, Any], dict[str, Any]]:
    """One blue iptables -> nftables migration with `fault` fired at each of `steps`; invariants checked.

    `loss` names the fault's row of the loss budget (loss_budget.FAULTS): every failed connection is charged to
    its node's step against it (facts `lost_by_step`, `over_budget`; `_record` asserts). `kick` starts the
    migration instead of applying the policy (a retry of an existing one). `cleanup_in_gate` false: the flush
    is a Cleanup step of its own after the gate (the default flushes inside the gate's probe, no Cleanup).
    `cordon` false: no cordon or drain, so each node's preflight makes its rule hold and runs ahead while the
    node before it gates (docs/planner.md, "Prepared")."""
    service_answers_everywhere(h, tcp_probe, test_service)
    probers = {n: continuous_prober(n, test_service.cluster_ip, test_service.port, interval=0.1) for n in ALL_NODES}
    injector = StepInjector(kube, nodes, fault, steps, max_per_node).start()
    started = time.monotonic()
    if kick is None:
        h.apply(fault_policy(name, test_service, gate_timeout, nodes, cleanup_in_gate, cordon))
    else:
        kick()
    outcome, cond = wait_settled(h, name, nodes=nodes)
    seconds = time.monotonic() - started
    history = injector.stop()
    if before_end is not None:
        before_end()
    results = {n: p.stop() for n, p in probers.items()}
    failures = {n: p.failures for n, p in probers.items()}
    facts = check_end_state(h, name, history, tcp_probe, test_service, failures, gate_timeout)
    facts["budget"] = loss
    facts.update(loss_facts(history, failures, nodes, budget_of(loss),
                            probe_timeout=max(p.timeout for p in probers.values())))
    facts["seconds"] = round(seconds, 1)
    facts["traffic"] = {n: {"ok": r.ok, "failed": r.failed} for n, r in results.items()}
    return outcome, cond, injector, facts, {n: r for n, r in results.items()}


def _row(fault: str, outcome: str, cond: dict[str, Any], injector: StepInjector, facts: dict[str, Any]
         ) -> dict[str, Any]:
    return {"fault": fault, "at": datetime.now(UTC).isoformat(timespec="seconds"), "outcome": outcome,
            "reason": cond.get("reason"), "message": (cond.get("message") or "")[:300],
            "fired": [{"step": f.step, "node": f.node, "seconds": round(f.seconds, 1), "detail": f.detail}
                      for f in injector.fired],
            **facts}


def _record(cluster: Any, row: dict[str, Any]) -> None:
    """Append the run's row to the report, then hold it to its fault's loss budget: every visit of a step by a
    node lost at most what docs/reliability.md's budget says (recorded first, so a run over budget is evidence
    in the report too)."""
    record(cluster, row)
    assert not row["over_budget"], _over_budget(cluster, row)


def _over_budget(cluster: Any, row: dict[str, Any]) -> str:
    """The failure message: each visit over budget, the node's timeline, and what its agent and kube-proxy logged
    about holds and their Node (a CI run keeps nothing else of the node)."""
    state_dir = cluster.require_local("the nodes' logs")
    return "\n".join(
        [f"{row['fault']}: connections lost beyond the loss budget ({row['budget']}):"] +
        [f"  {o['node']} {o['step']} (attempt {o['attempt']}): lost {o['lost']}, budget {o['budget']}; failed at "
         f"{', '.join(o['failures'])}" for o in row["over_budget"]] +
        [f"  lost by step {row['lost_by_step']}; timeline {row.get('timeline')}"] +
        [f"  {node} log: {line}" for node in sorted({o["node"] for o in row["over_budget"]})
         for line in explaining_log_lines(state_dir, node)])


def _retry(h: Harness, name: str, token: str, nodes: list[str] = BLUE) -> None:
    """Set the retry annotation of a halted rollout and wait for a new attempt to start."""
    before = {n: migration(pn).get("attempt") for n, pn in h.proxynodes().items() if n in nodes}
    h.patch(name, {"metadata": {"annotations": {"proxyshift.io/retry": token}}})
    # The policy stays Degraded until the retry is taken (the annotation is no new generation).
    h.wait_for(lambda: any(migration(pn).get("attempt") != before.get(n) and
                           migration(pn).get("phase") not in ("RolledBack", "Failed")
                           for n, pn in h.proxynodes().items() if n in nodes), 120, f"retry {token} to start",
               interval=0.2)


def _wait_nodes_registered(h: Harness, timeout: float = 120.0) -> None:
    """Every node exists again: a deleted Node is registered anew by the node simulator ~25 s later."""
    def registered() -> bool:
        return set(ALL_NODES) <= {n.metadata.name for n in h.core.list_node().items if n.metadata}
    h.wait_for(registered, timeout, f"nodes {ALL_NODES} registered", interval=1.0)


@pytest.fixture(autouse=True)
def uncordon_after(harness: Harness) -> Iterator[None]:
    """A node left cordoned by a failed run (a Failed node stays cordoned by design) would make every later
    run fail on it; give the nodes back after each test, once its assertions have run."""
    yield
    _wait_nodes_registered(harness)
    for node in ALL_NODES:
        if harness.unschedulable(node):
            harness.core.patch_node(node, {"spec": {"unschedulable": False}})


def _prepared_fault(faults: Faults, name: str, cluster: Any) -> Callable[[str, str], str]:
    """The fault by its name, the cluster made ready for it (agent-kill: new agent pods)."""
    if name == "agent-kill":
        _fresh_agent_pods(cluster)
    return {"operator-kill": faults.operator_kill, "agent-kill": faults.agent_kill,
            "apiserver-restart": faults.apiserver_restart, "etcd-pause": faults.etcd_pause,
            "node-delete": faults.node_delete, "probe-unreachable": faults.probe_block}[name]


def _fresh_agent_pods(cluster: Any) -> None:
    """Replace every agent pod with a new one before a run that kills agents.

    The node simulator counts restarts per pod and backs off like the kubelet (immediate, 10 s, 20 s, 40 s,
    80 s, ...; reset only after 10 min up). Without new pods the kills of the runs before carry over: in CI
    the fifth kill of ps-node-1's agent within 10 minutes fell in Verify, its 80 s back-off outlasted the 60 s
    gate timeout and the node rolled back. A new pod starts with no restarts, as does an agent that has not
    crashed for 10 minutes: each run's kills then cost what its own comment says."""
    from localcluster import install

    cluster.kubectl("-n", install.AGENT_NAMESPACE, "rollout", "restart", f"daemonset/{install.AGENT_DAEMONSET}")
    cluster.kubectl("-n", install.AGENT_NAMESPACE, "rollout", "status", f"daemonset/{install.AGENT_DAEMONSET}",
                    "--timeout=180s", timeout=200)


class CrashLoops:
    """The target revision's kube-proxy crash-looping on a node from the step it is started at."""

    def __init__(self, h: Harness, state_dir: Path) -> None:
        self.h, self.state_dir = h, state_dir
        self.loops: list[KubeProxyCrashLoop] = []

    def start(self, step: str, node: str) -> str:
        revision = migration(self.h.proxynodes()[node]).get("toRevision")
        assert revision, f"{node} has no target revision at {step}"
        self.loops.append(KubeProxyCrashLoop(self.state_dir, node, revision).start())
        return f"kube-proxy of {revision} on {node} SIGKILLed whenever it starts"

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop()

    def kills(self) -> int:
        return sum(loop.kills for loop in self.loops)

    def clear(self) -> None:
        self.loops.clear()


# The faults the rollout must absorb without failing a node: Ready is the only acceptable end.
ABSORBED = ("operator-kill", "apiserver-restart", "etcd-pause", "agent-kill", "probe-unreachable")


@pytest.mark.parametrize("fault_name", [*ABSORBED, "node-delete"])
def test_fault_at_every_step(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                             tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any],
                             fault_name: str) -> None:
    h = harness
    state_dir = cluster.require_local("fault injection")
    faults = Faults(h, kube, state_dir, ALL_NODES)
    fault = _prepared_fault(faults, fault_name, cluster)
    name = f"rel-{fault_name}"
    # The node simulator backs off restarts like the kubelet (immediate, 10 s, 20 s, 40 s, ...; reset after
    # 10 min up): seven kills of one agent within a minute would be a crash loop, not seven kills. So the
    # agent-kill run migrates all three nodes and kills each node's agent at most three times.
    nodes, per_node = (ALL_NODES, 3) if fault_name == "agent-kill" else (BLUE, None)
    # A step can pass unseen while the fault fired at the one before is still under way (a migration of two
    # nodes takes ~10 s here, an operator restart ~3 s). Then the policy flips back and forth, each
    # migration firing only at the steps still missing, until every step was hit: each migration is one
    # more run under the same fault, and every end state is checked.
    # A node deleted mid-rollout may fail its gate and roll back (its re-registered kube-proxy answered
    # /healthz 503 past the 60 s timeout in one run of four): the rollout halts Degraded with the reason, and
    # a retry with the same mode goes on to the steps not yet hit.
    # Verify is armed besides until the fault fired there: a healthy migration does not enter it (the cleanup's
    # report verifies the node), but a fault at Cleanup can make it (the probe blocked, the agent killed).
    missing, mode, rounds, retry, verify_fired = list(ALL_STEPS), "nftables", 0, False, False
    while missing and rounds < MAX_ROUNDS:
        kick: Callable[[], object] | None = None
        if retry:
            kick = functools.partial(_retry, h, name, f"round-{rounds}", nodes)
        elif rounds:
            kick = functools.partial(h.patch, name, {"spec": {"mode": mode,
                                                              "cleanup": {"inGate": "Cleanup" not in missing}}})
        try:
            # While Cleanup is still to be hit the flush is a step of its own (cleanup.inGate false, as on
            # ipvs and Cilium moves); the migrations after it flush inside the gate (the default).
            outcome, cond, injector, facts, _ = migrate_under(h, cluster, kube, test_service, tcp_probe,
                                                              continuous_prober, name, fault, fault_name,
                                                              steps=(*missing, *(() if verify_fired else (VERIFY,))),
                                                              kick=kick, before_end=faults.unblock_all,
                                                              nodes=nodes, max_per_node=per_node,
                                                              cleanup_in_gate="Cleanup" not in missing)
        finally:
            faults.unblock_all()
        rounds += 1
        _record(cluster, _row(fault_name if rounds == 1 else f"{fault_name} (migration {rounds}, to {mode})",
                              outcome, cond, injector, facts))
        if fault_name == "agent-kill":
            h.wait_for(lambda: all(agent_pid(state_dir, n) for n in ALL_NODES), 120, "every agent running again")
        fired = {f.step for f in injector.fired}
        missing = [step for step in missing if step not in fired]
        # Entered and armed, the injector free: it must have fired there.
        assert injector.unfired(VERIFY) == [], f"{fault_name}: {injector.unfired(VERIFY)} entered Verify and " \
                                               f"the injector fired nothing there: {facts['phases']}"
        verify_fired = verify_fired or VERIFY in fired
        # The pool that does not move must not notice: its kube-proxy never changed (docs/reliability.md).
        untouched = [n for n in ALL_NODES if n not in nodes]
        assert all(facts["traffic"][n]["failed"] == 0 for n in untouched), facts["traffic"]
        if fault_name in ABSORBED:
            assert facts["switches"] == {n: int(n in nodes) for n in ALL_NODES}, facts["switches"]
            assert outcome == "Ready", f"{fault_name}: expected Ready, got {outcome}: {cond}"
            assert all(facts["modes"][n] == mode for n in nodes), facts["modes"]
            assert all(not h.unschedulable(n) for n in ALL_NODES), "a node was left cordoned"
        else:
            # A Node deleted mid-step comes back as a new Node whose kube-proxy restarts from the baseline: a
            # node that then rolls back does so because its kube-proxy did not come up in time, never for
            # anything else (docs/reliability.md).
            odd = {n: why for n, why in facts["reasons"].items() if why.split(":")[0] not in NODE_DELETE_REASONS}
            assert outcome == "Ready" or (cond.get("reason") and facts["reasons"] and not odd), (cond, facts["reasons"])
            _wait_nodes_registered(h)
        retry = outcome != "Ready"
        if not retry:
            mode = "iptables" if mode == "nftables" else "nftables"
    assert not missing, f"the fault did not fire at {missing} in {rounds} migrations: {facts['phases']}"


AHEAD_STEPS = ("Preflight", "Switch", "Gate")


@pytest.mark.parametrize("fault_name", ["agent-kill", "operator-kill"])
def test_a_fault_while_the_preflight_holds_ahead(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                                                tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any],
                                                fault_name: str) -> None:
    """Without cordon the rule hold is made by the node's preflight, which runs while the node before it gates
    (Prepared), and the switch claims it; the cordoned runs above make it at the switch. The fault fires as a
    node enters Preflight (the hold being made), Switch (claimed) and Gate (released at the target's sync):
    the rollout must end Ready with one switch per node, every loss within the fault's budget, no rule hold
    left on any node, and every other end-state invariant."""
    h = harness
    state_dir = cluster.require_local("fault injection")
    faults = Faults(h, kube, state_dir, ALL_NODES)
    fault = _prepared_fault(faults, fault_name, cluster)
    name = f"rel-ahead-{fault_name}"
    # A short step (Switch) can pass on both nodes while an operator restart is under way: then the pool goes
    # back to iptables with no fault (from nftables the hold is made at the switch, not what this test is
    # about) and forward again with the fault at the steps still missing, as test_fault_at_every_step does.
    missing, rounds = list(AHEAD_STEPS), 0
    while missing and rounds < MAX_ROUNDS:
        kick: Callable[[], object] | None = None
        if rounds:
            back, why, idle, back_facts, _ = migrate_under(
                h, cluster, kube, test_service, tcp_probe, continuous_prober, name, None, fault_name,
                kick=functools.partial(h.patch, name, {"spec": {"mode": "iptables"}}), cordon=False)
            _record(cluster, _row(f"{fault_name} (back to iptables, no fault)", back, why, idle, back_facts))
            assert back == "Ready", why
            kick = functools.partial(h.patch, name, {"spec": {"mode": "nftables"}})
        try:
            outcome, cond, injector, facts, _ = migrate_under(h, cluster, kube, test_service, tcp_probe,
                                                              continuous_prober, name, fault, fault_name,
                                                              steps=tuple(missing), kick=kick,
                                                              before_end=faults.unblock_all, cordon=False)
        finally:
            faults.unblock_all()
        rounds += 1
        _record(cluster, _row(f"{fault_name} (hold made by the preflight, no cordon, migration {rounds})", outcome,
                              cond, injector, facts))
        if fault_name == "agent-kill":
            h.wait_for(lambda: all(agent_pid(state_dir, n) for n in ALL_NODES), 120, "every agent running again")
        assert outcome == "Ready", f"{fault_name}: expected Ready, got {outcome}: {cond}"
        assert facts["switches"] == {n: int(n in BLUE) for n in ALL_NODES}, facts["switches"]
        assert all(facts["modes"][n] == "nftables" for n in BLUE), facts["modes"]
        missing = [step for step in missing if step not in {f.step for f in injector.fired}]
    assert not missing, f"the fault did not fire at {missing} in {rounds} migrations: {facts['phases']}"


def test_target_kube_proxy_crash_looping(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                                         tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any]) -> None:
    """The target revision's kube-proxy crash-loops from a step on: the node rolls back, the policy turns
    Degraded with the reason, the old kube-proxy serves again. Then a retry arms the next step."""
    h = harness
    state_dir = cluster.require_local("fault injection")
    name = "rel-crashloop"
    loops = CrashLoops(h, state_dir)

    def retry(token: str) -> Callable[[], None]:
        return lambda: _retry(h, name, token)

    rows = []
    # Before Switch there is no target pod to crash: the loop would start with it, as at Switch. From Verify on
    # the gate has already passed: a crash loop then is not seen (docs/reliability.md, "found").
    for i, step in enumerate(("Switch", "Gate")):
        try:
            outcome, cond, injector, facts, _ = migrate_under(
                h, cluster, kube, test_service, tcp_probe, continuous_prober, name, loops.start,
                f"kube-proxy-crashloop@{step}", (step,),
                before_end=loops.stop, kick=retry(str(i)) if i else None, gate_timeout=CRASHLOOP_GATE_TIMEOUT)
        finally:
            loops.stop()
        row = _row(f"kube-proxy-crashloop@{step}", outcome, cond, injector, facts)
        row["kills"] = loops.kills()
        loops.clear()
        _record(cluster, row)
        rows.append(row)
        assert [f.step for f in injector.fired] == [step], injector.fired
        assert outcome == "Degraded" and cond.get("reason"), cond
        node = injector.fired[0].node
        assert facts["modes"][node] == "iptables", f"{node} not back on its old mode: {facts['modes']}"
        assert migration(h.proxynodes()[node]).get("phase") == "RolledBack"
    # The fault gone, a retry completes the rollout.
    outcome, cond, injector, facts, _ = migrate_under(h, cluster, kube, test_service, tcp_probe, continuous_prober,
                                                      name, None, "kube-proxy-crashloop/retry", kick=retry("done"),
                                                      gate_timeout=CRASHLOOP_GATE_TIMEOUT)
    _record(cluster, _row("kube-proxy-crashloop/retry", outcome, cond, injector, facts))
    assert outcome == "Ready", cond


@pytest.mark.parametrize("fault_name", ["operator-kill", "apiserver-restart", "agent-kill"])
def test_a_fault_while_a_node_rolls_back(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                                         tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any],
                                         fault_name: str) -> None:
    """The target kube-proxy crash-loops from Switch, so the node rolls back; the fault fires the moment the
    node enters RollingBack. The rollback must still end RolledBack on the old mode, the policy Degraded with
    the rollback's reason, and every end-state invariant must hold."""
    h = harness
    state_dir = cluster.require_local("fault injection")
    fault = _prepared_fault(Faults(h, kube, state_dir, ALL_NODES), fault_name, cluster)
    loops = CrashLoops(h, state_dir)

    def crash_then_fault(step: str, node: str) -> str:
        return loops.start(step, node) if step == "Switch" else fault(step, node)

    try:
        outcome, cond, injector, facts, _ = migrate_under(
            h, cluster, kube, test_service, tcp_probe, continuous_prober, f"rel-rollback-{fault_name}",
            crash_then_fault, f"{fault_name} while rolling back", ("Switch", "RollingBack"), before_end=loops.stop,
            gate_timeout=CRASHLOOP_GATE_TIMEOUT)
    finally:
        loops.stop()
    _record(cluster, _row(f"{fault_name} while rolling back", outcome, cond, injector, facts))
    fired = [(f.step, f.node) for f in injector.fired]
    assert [step for step, _ in fired] == ["Switch", "RollingBack"], fired
    assert fired[0][1] == fired[1][1], f"the fault fired on another node than the rollback: {fired}"
    node = fired[0][1]
    assert outcome == "Degraded" and cond.get("reason"), cond
    pn = migration(h.proxynodes()[node])
    assert pn.get("phase") == "RolledBack", f"{node} ended {pn.get('phase')}: {facts['reasons']}"
    # Which one depends on where the kills catch the new kube-proxy: never Ready (restarts counted, or the
    # switch times out) or Ready between kills (the gate times out).
    assert pn.get("reason") in ("KubeProxyCrashLooping", "SwitchTimeout", "GateTimeout"), facts["reasons"]
    assert facts["modes"][node] == "iptables", f"{node} not back on its old mode: {facts['modes']}"
    assert all(not h.unschedulable(n) for n in ALL_NODES), "a node was left cordoned"


@pytest.mark.parametrize("fault_name", ["operator-kill", "apiserver-restart", "agent-kill"])
def test_a_fault_in_verify(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                           tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any],
                           fault_name: str) -> None:
    """kube-proxy's metrics and health ports are dropped inside the node the moment it enters Cleanup (its
    agent frozen meanwhile, Faults.probe_block_at_cleanup), so the agent's report after its flush cannot
    verify the node (kube-proxy unreachable) and the node enters Verify; the fault fires the moment it does.
    The Verify probe passes once the block lifts (20 s): the rollout must end Ready, one switch per node,
    with every end-state invariant, as for the fault at any other step.

    The block still races the agent (a watch event against the agent's own): a report that beat it leaves
    Verify out, and the policy flips back and tries again, at most MAX_VERIFY_TRIES times."""
    h = harness
    state_dir = cluster.require_local("fault injection")
    faults = Faults(h, kube, state_dir, ALL_NODES)
    fault = _prepared_fault(faults, fault_name, cluster)

    def block_then_fault(step: str, node: str) -> str:
        return faults.probe_block_at_cleanup(step, node) if step == "Gate" else fault(step, node)

    name, mode = f"rel-verify-{fault_name}", "nftables"
    kick: Callable[[], object] | None = None
    for tries in range(1, MAX_VERIFY_TRIES + 1):
        try:
            outcome, cond, injector, facts, _ = migrate_under(
                h, cluster, kube, test_service, tcp_probe, continuous_prober, name, block_then_fault,
                f"{fault_name} in Verify", ("Gate", VERIFY), before_end=faults.unblock_all, kick=kick,
                cleanup_in_gate=False)  # Verify follows only a Cleanup step of its own
        finally:
            faults.unblock_all()
        _record(cluster, _row(f"{fault_name} in Verify" + (f" (migration {tries}, to {mode})" if tries > 1 else ""),
                              outcome, cond, injector, facts))
        assert outcome == "Ready", f"{fault_name} in Verify: expected Ready, got {outcome}: {cond}"
        assert facts["switches"] == {n: int(n in BLUE) for n in ALL_NODES}, facts["switches"]
        assert all(facts["modes"][n] == mode for n in BLUE), facts["modes"]
        assert all(not h.unschedulable(n) for n in ALL_NODES), "a node was left cordoned"
        assert all(facts["traffic"][n]["failed"] == 0 for n in ALL_NODES if n not in BLUE), facts["traffic"]
        assert injector.unfired(VERIFY) == [], f"entered Verify, nothing fired there: {facts['phases']}"
        if any(f.step == VERIFY for f in injector.fired):
            break
        mode = "iptables" if mode == "nftables" else "nftables"
        kick = functools.partial(h.patch, name, {"spec": {"mode": mode}})
    fired = [(f.step, f.node) for f in injector.fired]
    assert [step for step, _ in fired] == ["Gate", VERIFY], \
        f"no node entered Verify in {tries} migrations: fired {fired}, phases {facts['phases']}"
    assert fired[0][1] == fired[1][1], f"Verify entered on another node than the blocked one: {fired}"


def _set_agent_env(h: Harness, cluster: Any, env: list[dict[str, Any]],
                   strategy: dict[str, Any] | None = None) -> None:
    """Replace the env of the agent DaemonSet's container (whole), and its update strategy when given, and wait
    for the agents to roll."""
    from localcluster import install

    patch: list[dict[str, Any]] = [{"op": "replace", "path": "/spec/template/spec/containers/0/env", "value": env}]
    if strategy is not None:
        patch.append({"op": "replace", "path": "/spec/updateStrategy", "value": strategy})
    cluster.kubectl("-n", install.AGENT_NAMESPACE, "patch", "daemonset", install.AGENT_DAEMONSET,
                    "--type=json", "-p", json.dumps(patch))
    cluster.kubectl("-n", install.AGENT_NAMESPACE, "rollout", "status", f"daemonset/{install.AGENT_DAEMONSET}",
                    "--timeout=180s", timeout=200)


def _heartbeats_ahead(h: Harness, timeout: float = 150.0) -> dict[str, float]:
    """How far ahead of our clock each agent's next heartbeat is, read the moment it appears.

    An agent writes its heartbeat with its own clock every status interval (60 s); read at once, a new
    one is as far ahead as the agent's clock is, less the write and the poll (< 1 s here)."""
    def beats() -> dict[str, str | None]:
        return {n: (pn.get("status") or {}).get("heartbeat") for n, pn in h.proxynodes().items() if n in ALL_NODES}

    old, ahead = beats(), dict[str, float]()
    deadline = time.monotonic() + timeout
    while len(ahead) < len(ALL_NODES) and time.monotonic() < deadline:
        for node, beat in beats().items():
            if node not in ahead and beat and beat != old.get(node):
                ahead[node] = datetime.fromisoformat(beat.replace("Z", "+00:00")).timestamp() - time.time()
        time.sleep(0.25)
    assert len(ahead) == len(ALL_NODES), f"no new heartbeat within {timeout:g}s from {set(ALL_NODES) - set(ahead)}"
    return ahead


def test_clock_skew_between_operator_and_agent(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                                               tcp_probe: Callable[..., Any],
                                               continuous_prober: Callable[..., Any]) -> None:
    """Every agent's wall clock runs 30 s ahead of the operator's (an LD_PRELOAD shim in the agent process)."""
    h = harness
    state_dir = cluster.require_local("clock skew")
    shim = realtime_offset.build()
    original = json.loads(cluster.kubectl("-n", "proxyshift-system", "get", "daemonset", "proxyshift-agent",
                                          "-o", "json").stdout)
    container = original["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "agent", container["name"]
    original_env = container.get("env") or []
    original_strategy = original["spec"]["updateStrategy"]
    # Every agent restarted at once, there and back: no migration runs while they roll, and one at a time
    # (the DaemonSet's 10%) each waits for the one before to turn Ready, a fixed cost of this test twice over.
    all_at_once = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}
    _set_agent_env(h, cluster, [*original_env, *realtime_offset.environment(shim, CLOCK_SKEW_SECONDS)], all_at_once)
    try:
        for node in ALL_NODES:
            pid = agent_pid(state_dir, node)
            assert pid and realtime_offset.OFFSET_ENV in Path(f"/proc/{pid}/environ").read_bytes().decode(
                errors="replace"), node
        skew_seen = _heartbeats_ahead(h)
        assert all(20 < s < 40 for s in skew_seen.values()), f"agent heartbeats not ~30 s ahead: {skew_seen}"
        outcome, cond, injector, facts, _ = migrate_under(h, cluster, kube, test_service, tcp_probe,
                                                          continuous_prober, "rel-clock-skew", None, "clock-skew")
    finally:
        try:
            _set_agent_env(h, cluster, original_env)
        finally:
            # The strategy alone changes no pod: nothing rolls.
            _set_agent_env(h, cluster, original_env, original_strategy)
            shutil.rmtree(shim.parent, ignore_errors=True)
    facts["agent_clock_ahead_s"] = {n: round(v, 1) for n, v in sorted(skew_seen.items())}
    _record(cluster, _row(f"clock-skew +{CLOCK_SKEW_SECONDS}s", outcome, cond, injector, facts))
    assert outcome == "Ready", cond
    assert all(facts["modes"][n] == "nftables" for n in BLUE)
    # Skew must not turn the gate into a crawl: the probe rounds are paced by the operator's clock.
    assert facts["seconds"] < 2 * 120, f"the migration took {facts['seconds']}s under clock skew"
