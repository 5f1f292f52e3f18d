"""The fault suite's StepInjector without a cluster: it fires at the armed steps it sees, Verify included, and
an injector that saw nothing, or saw an armed step and fired nothing there, fails the run (issue 15, item 4); and
the node log lines a run over its loss budget names in its failure."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faults import VERIFY, StepInjector, explaining_log_lines
from loss_budget import DELETED

pytestmark = pytest.mark.unit


class ScriptedKube:
    """The two reads the injector makes, answering with each node's current migration phase."""

    def __init__(self, phases: dict[str, str], fail: bool = False) -> None:
        self.phases, self.fail = dict(phases), fail
        self.attempts = dict.fromkeys(phases, 1)
        self.uids: dict[str, str | None] = {n: f"uid-{n}" for n in phases}  # the Node's uid; None: the Node is deleted
        # The uid the node's ProxyNode is owned by; None: no ProxyNode.
        self.owners: dict[str, str | None] = dict(self.uids)
        self.lock = threading.Lock()

    def set(self, node: str, phase: str, attempt: int = 1) -> None:
        with self.lock:
            self.phases[node], self.attempts[node] = phase, attempt

    def delete(self, node: str, *, keep_proxynode: bool = False) -> None:
        """The Node deleted; its ProxyNode with it, unless the garbage collector has not got to it yet."""
        with self.lock:
            self.uids[node] = None
            if not keep_proxynode:
                self.owners[node] = None

    def register(self, node: str, uid: str, phase: str = "Pending", attempt: int = 0) -> None:
        """The Node registered again (a new uid) and its new ProxyNode created."""
        with self.lock:
            self.uids[node] = self.owners[node] = uid
            self.phases[node], self.attempts[node] = phase, attempt

    def get(self, path: str, timeout: float = 0) -> dict[str, Any]:
        if self.fail:
            raise OSError("connection refused")
        with self.lock:
            if path.endswith("/proxynodes"):
                return {"items": [{"metadata": {"name": n, "ownerReferences": [{"kind": "Node", "uid": owner}]},
                                   "spec": {"migration": {"phase": self.phases[n], "attempt": self.attempts[n],
                                                          "toRevision": "r1", "startedAt": "2026-12-02T00:00:00Z"}}}
                                  for n, owner in self.owners.items() if owner is not None]}
            return {"items": [{"metadata": {"name": n, "uid": uid, "labels": {}}}
                              for n, uid in self.uids.items() if uid is not None]}


def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_it_fires_at_verify_when_a_node_enters_it() -> None:
    kube = ScriptedKube({"n1": "Gate", "n2": "Pending"})
    calls: list[tuple[str, str]] = []

    def record(step: str, node: str) -> str:
        calls.append((step, node))
        return "done"

    injector = StepInjector(kube, ["n1", "n2"], record, steps=("Cleanup", VERIFY)).start()
    kube.set("n1", "Cleanup")
    _until(lambda: calls == [("Cleanup", "n1")])
    kube.set("n1", VERIFY)
    _until(lambda: len(calls) == 2)
    kube.set("n1", "Done")
    _until(lambda: injector.looks > 5)
    injector.stop()
    assert calls == [("Cleanup", "n1"), (VERIFY, "n1")]
    assert injector.entered(VERIFY) == ["n1"]
    assert injector.unfired(VERIFY) == []


def test_a_node_in_verify_while_the_last_fault_still_runs_is_excused_and_recorded() -> None:
    kube = ScriptedKube({"n1": "Cleanup"})
    release = threading.Event()

    def slow(step: str, node: str) -> str:
        release.wait(5)
        return "slow"

    injector = StepInjector(kube, ["n1"], slow, steps=("Cleanup", VERIFY)).start()
    _until(lambda: len(injector.fired) == 1)
    kube.set("n1", VERIFY)
    _until(lambda: injector.busy_at == [(VERIFY, "n1")])
    kube.set("n1", "Done")
    release.set()
    injector.stop()
    assert [f.step for f in injector.fired] == ["Cleanup"]
    assert injector.unfired(VERIFY) == []


def test_a_node_seen_in_an_armed_step_without_a_firing_is_reported() -> None:
    # One look, no firing loop: what an injector that looked away would leave behind.
    injector = StepInjector(ScriptedKube({"n1": VERIFY}), ["n1"], lambda step, node: "x", steps=(VERIFY,))
    injector._observe()
    assert injector.unfired(VERIFY) == ["n1"]
    # Not armed (a run without Verify in its steps): nothing owed.
    plain = StepInjector(ScriptedKube({"n1": VERIFY}), ["n1"], lambda step, node: "x", steps=("Gate",))
    plain._observe()
    assert plain.unfired(VERIFY) == []


def test_an_injector_that_never_saw_the_nodes_fails_the_run() -> None:
    injector = StepInjector(ScriptedKube({"n1": "Gate"}, fail=True), ["n1"], None).start()
    time.sleep(0.2)
    with pytest.raises(AssertionError, match="never saw the nodes"):
        injector.stop()


def test_a_fault_that_cannot_be_injected_fails_the_run() -> None:
    def broken(step: str, node: str) -> str:
        raise RuntimeError("no such process")

    injector = StepInjector(ScriptedKube({"n1": "Gate"}), ["n1"], broken, steps=("Gate",)).start()
    _until(lambda: injector.errors)
    with pytest.raises(RuntimeError, match="no such process"):
        injector.stop()


def _steps(injector: StepInjector, node: str) -> list[tuple[int, str]]:
    return [(seen.attempt, seen.step) for seen in injector.history.timeline[node]]


def test_the_timeline_records_each_change_with_the_looks_around_it() -> None:
    kube = ScriptedKube({"n1": "Pending"})
    injector = StepInjector(kube, ["n1"], None)
    before = time.time()
    injector._observe()
    kube.set("n1", "Switch")
    injector._observe()
    injector._observe()  # no change: nothing recorded
    kube.set("n1", "Switch", attempt=2)
    injector._observe()
    after = time.time()
    timeline = injector.history.timeline["n1"]
    assert _steps(injector, "n1") == [(1, "Pending"), (1, "Switch"), (2, "Switch")]
    assert timeline[0].since is None
    for earlier, later in itertools.pairwise(timeline):
        # Entered after the previous look began and seen by the end of the look that recorded it.
        assert earlier.at <= later.at and later.since is not None and before <= later.since <= later.at <= after
    assert injector.history.phases["n1"] == [(1, "Pending"), (1, "Switch"), (2, "Switch")]


def test_a_deleted_node_is_deleted_until_its_new_node_switches() -> None:
    kube = ScriptedKube({"n1": "Gate", "n2": "Pending"})
    injector = StepInjector(kube, ["n1", "n2"], None)
    injector._observe()
    kube.delete("n1", keep_proxynode=True)  # the old ProxyNode still there: it is not the (absent) Node's
    injector._observe()
    kube.delete("n1")
    injector._observe()
    kube.register("n1", "uid-n1-again")
    injector._observe()
    kube.set("n1", "Preflight")
    injector._observe()
    kube.set("n1", "Cordon")
    injector._observe()
    kube.set("n1", "Switch")
    injector._observe()
    kube.set("n1", "Done")
    injector._observe()
    assert _steps(injector, "n1") == [(1, "Gate"), (0, DELETED), (1, "Switch"), (1, "Done")]
    assert _steps(injector, "n2") == [(1, "Pending")]
    # The ProxyNode phases stay what the ProxyNodes said.
    assert injector.history.phases["n1"] == [(1, "Gate"), (0, "Pending"), (1, "Preflight"), (1, "Cordon"),
                                             (1, "Switch"), (1, "Done")]
    # A new ProxyNode not yet owned by the new Node: still deleted.
    kube.register("n2", "uid-n2-again")
    with kube.lock:
        kube.owners["n2"] = "uid-n2"
    injector._observe()
    assert _steps(injector, "n2") == [(1, "Pending"), (0, DELETED)]


def test_a_failure_message_carries_the_nodes_hold_and_node_lines_in_time_order(tmp_path: Path) -> None:
    logs = tmp_path / "nodes" / "ps-node-2" / "logs"
    logs.mkdir(parents=True)
    (logs / "proxyshift-agent-abc_agent.log").write_text(
        "2026-12-05 22:16:39,268 INFO proxyshift.agent: operation x.Hold.0 Succeeded: rule hold install: 9 chains\n"
        "2026-12-05 22:16:40,001 INFO proxyshift.agent: heartbeat written\n"
        "2026-12-05 22:17:36,668 INFO proxyshift.agent: rule hold release: 9 chains removed\n")
    (logs / "kube-proxy-rev-xyz_kube-proxy.log").write_text(
        'I1205 22:16:39.505000    7 node.go:218] "Node is being deleted" node="ps-node-2"\n'
        'I1205 22:16:39.600000    7 proxier.go:1] "syncProxyRules complete"\n')
    (logs / "proxyshift-probe-q_probe.log").write_text("2026-12-05 22:16:39,300 rule hold of someone else\n")
    assert explaining_log_lines(tmp_path, "ps-node-2") == [
        "proxyshift-agent-abc: 2026-12-05 22:16:39,268 INFO proxyshift.agent: operation x.Hold.0 Succeeded: "
        "rule hold install: 9 chains",
        'kube-proxy-rev-xyz: I1205 22:16:39.505000    7 node.go:218] "Node is being deleted" node="ps-node-2"',
        "proxyshift-agent-abc: 2026-12-05 22:17:36,668 INFO proxyshift.agent: rule hold release: 9 chains removed",
    ]
    assert explaining_log_lines(tmp_path, "ps-node-9") == []
