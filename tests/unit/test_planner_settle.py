"""A spec edited in quick succession does not move nodes on every edit (issue 8: "no flapping").

Once the spec renders to another revision, no node starts until it has rendered to the same revision
for SETTLE_SECONDS; nodes already past their switch finish, untouched preflights are abandoned. The
first revision of a policy starts at once (nothing to settle).
"""

from __future__ import annotations

import pytest
from simulator import Sim, edit, make_policy

from proxyshift.planner.planner import SETTLE_SECONDS, plan
from proxyshift.planner.world import DeleteRevision, EnsureRevision, SetMigration, SetRevisionLabel

pytestmark = pytest.mark.unit

SCHEDULERS = ["rr", "wrr", "lc"]


def nodes(n: int) -> dict[str, dict[str, str]]:
    return {f"node-{i}": {"pool": "blue"} for i in range(1, n + 1)}


def label_history(sim: Sim) -> dict[str, list[str | None]]:
    history: dict[str, list[str | None]] = {n: [None] for n in sim.nodes}
    for _, _, a in sim.log:
        if isinstance(a, SetRevisionLabel) and history[a.node][-1] != a.revision:
            history[a.node].append(a.revision)
    return history


def preflight_starts(sim: Sim) -> list[tuple[float, str]]:
    t0 = sim.log[0][0]
    return [((when - t0).total_seconds(), a.node) for when, _, a in sim.log
            if isinstance(a, SetMigration) and a.migration is not None and a.migration.phase == "Preflight"
            and a.operation is not None and a.operation.id.endswith("Preflight.0")]


def test_the_first_revision_starts_at_once() -> None:
    sim = Sim.build(nodes(2), [make_policy("p", "ipvs")])
    sim.step()  # revision ensured
    sim.tick(1)
    sim.step()
    assert [n for _, n in preflight_starts(sim)] == ["node-1"]
    assert sim.policies["p"].status.revision_since is None


def test_an_edit_holds_new_starts_for_the_settle_time_then_the_rollout_goes_on() -> None:
    # Without the lookahead nothing else is in flight when node-1 is done (with it, the plan that finishes
    # node-1 switches node-2 at once, and the loop then polls that node, not the settle time).
    sim = Sim.build(nodes(3), [make_policy("p", "ipvs", rollout={"preflightAhead": False})])
    sim.run(until=lambda: sim.nodes["node-1"].revision is not None and sim.phase("node-1") == "Done")
    edit(sim, "p", ipvs={"scheduler": "wrr"})
    edited_at = sim.now
    sim.step()
    status = sim.policies["p"].status
    assert status.revision_since is not None
    progressing = next(c for c in status.conditions if c.type == "Progressing")
    assert "no node starts until it is unchanged" in progressing.message, progressing.message
    # The wake-up is the end of the settle time, not a poll.
    assert plan(sim.world(), "p").requeue_after_seconds == pytest.approx(SETTLE_SECONDS, abs=1.5)
    sim.run()
    assert sim.violations == []
    rev = sim.render(sim.policies["p"]).name
    assert all(v.revision == rev for v in sim.nodes.values())
    later = [(t, n) for t, n in preflight_starts(sim) if sim.log[0][0].timestamp() + t >= edited_at.timestamp()]
    first = min(t for t, _ in later)
    assert first >= (edited_at - sim.log[0][0]).total_seconds() + SETTLE_SECONDS - 1, later


@pytest.mark.parametrize("every", [1, 3], ids=["every-second", "every-3s"])
def test_a_spec_edited_in_quick_succession_does_not_move_nodes_on_every_edit(every: int) -> None:
    # Every 3 s matters: the simulated agent answers a preflight within 2 s, so without the settle time a
    # node would get past its switch between two edits and then follow each of them, as measured live.
    sim = Sim.build(nodes(4), [make_policy("p", "ipvs")])
    sim.run(until=lambda: sim.nodes["node-1"].revision is not None)  # node-1 switched: past the point of return
    edits = [SCHEDULERS[i % 3] for i in range(1, 16)]  # wrr, lc, rr, wrr, ... ending on lc
    for scheduler in edits:
        edit(sim, "p", ipvs={"scheduler": scheduler})
        for _ in range(every):
            sim.step()
            sim.tick(1)
    # During the storm no node started: node-1 finished what it had begun, nobody else moved.
    assert [n for _, n in preflight_starts(sim)] == ["node-1"]
    assert all(sim.nodes[n].revision is None for n in ("node-2", "node-3", "node-4"))
    sim.run()
    assert sim.violations == []
    final = sim.render(sim.policies["p"]).name
    assert all(v.revision == final for v in sim.nodes.values())
    history = label_history(sim)
    # One switch per node to the final revision; node-1 also had the one it was in the middle of.
    assert [len(h) - 1 for n, h in sorted(history.items())] == [2, 1, 1, 1], history
    assert {r.name for r in sim.revisions.values()} == {final}
    # One revision per distinct spec: none deleted while the spec kept changing, so none created twice.
    lifecycle: dict[str, list[str]] = {}
    for _, _, a in sim.log:
        if isinstance(a, EnsureRevision | DeleteRevision):
            kind = "ensure" if isinstance(a, EnsureRevision) else "delete"
            if lifecycle.setdefault(a.revision, [])[-1:] != [kind]:
                lifecycle[a.revision].append(kind)
    # (Four: the initial spec without an ipvs block renders apart from the explicit rr.)
    assert len(lifecycle) == 4 and all(steps in (["ensure"], ["ensure", "delete"])
                                       for steps in lifecycle.values()), lifecycle
