"""The fault suite's StepInjector without a cluster: it fires at the armed steps it sees, Verify included, and
an injector that saw nothing, or saw an armed step and fired nothing there, fails the run (issue 15, item 4)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from faults import VERIFY, StepInjector

pytestmark = pytest.mark.unit


class ScriptedKube:
    """The two reads the injector makes, answering with each node's current migration phase."""

    def __init__(self, phases: dict[str, str], fail: bool = False) -> None:
        self.phases, self.fail = dict(phases), fail
        self.lock = threading.Lock()

    def set(self, node: str, phase: str) -> None:
        with self.lock:
            self.phases[node] = phase

    def get(self, path: str, timeout: float = 0) -> dict[str, Any]:
        if self.fail:
            raise OSError("connection refused")
        with self.lock:
            if path.endswith("/proxynodes"):
                return {"items": [{"metadata": {"name": n},
                                   "spec": {"migration": {"phase": p, "attempt": 1, "toRevision": "r1",
                                                          "startedAt": "2026-12-02T00:00:00Z"}}}
                                  for n, p in self.phases.items()]}
            return {"items": [{"metadata": {"name": n, "uid": f"uid-{n}", "labels": {}}} for n in self.phases]}


def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_it_fires_at_verify_when_a_node_enters_it() -> None:
    kube = ScriptedKube({"n1": "Gate", "n2": "Pending"})
    calls: list[tuple[str, str]] = []
    injector = StepInjector(kube, ["n1", "n2"], lambda step, node: calls.append((step, node)) or "done",  # type: ignore[arg-type]
                            steps=("Cleanup", VERIFY)).start()
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
