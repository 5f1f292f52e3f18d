"""The loss budget and the attribution of failed connections to steps, without a cluster (issue 15, item 4)."""

from __future__ import annotations

import pytest
from loss_budget import (
    ALLOWANCES,
    BUDGET,
    BUDGETS,
    COLUMNS,
    DELETED,
    FAULTS,
    STEPS,
    UNSEEN,
    UNTOUCHED,
    Seen,
    attribute,
    budget_of,
    visits,
)

from proxyshift.api.proxynode import PHASES

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0  # a wall time; the steps below are seconds after it


def timeline(*steps: tuple[float, str], attempt: int = 1) -> list[Seen]:
    """Steps seen at T0 + s, each look 50 ms after the one before it."""
    return [Seen(T0 + at, T0 + at - 0.05 if i else None, attempt, step) for i, (at, step) in enumerate(steps)]


MIGRATION = timeline((0, "Pending"), (1, "Preflight"), (2, "Cordon"), (3, "Switch"), (6, "Gate"), (9, "Cleanup"),
                     (10, "Uncordon"), (10.2, "Done"))


def fail(*at: float) -> list[tuple[float, str]]:
    return [(T0 + a, "TimeoutError") for a in at]


def test_a_failure_inside_a_step_is_charged_there() -> None:
    a = attribute({"n1": fail(4.0)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {"Switch": 1}}
    assert a.over_budget() == []


def test_a_failure_just_after_a_step_ended_is_charged_to_it_while_it_has_budget() -> None:
    # Recorded 0.5 s into Gate: the connection began up to 1 s earlier, in Switch, whose budget takes it.
    a = attribute({"n1": fail(6.5)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {"Switch": 1}}
    assert a.over_budget() == []
    # Without budget anywhere it stays where the node was when it was recorded, and is reported.
    b = attribute({"n1": fail(6.5)}, {"n1": MIGRATION}, {"n1"}, {})
    assert b.lost_by_step() == {"n1": {"Gate": 1}}
    assert [(o["step"], o["lost"], o["budget"]) for o in b.over_budget()] == [("Gate", 1, 0)]


def test_a_failure_far_from_any_budgeted_step_is_over_budget_with_its_time() -> None:
    a = attribute({"n1": fail(8.0)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1})
    [over] = a.over_budget()
    assert (over["node"], over["step"], over["attempt"], over["lost"], over["budget"]) == ("n1", "Gate", 1, 1, 0)
    assert over["failures"] and over["failures"][0].endswith("TimeoutError (Gate)")


def test_two_failures_in_one_visit_of_a_step_with_budget_one_are_one_too_many() -> None:
    a = attribute({"n1": fail(3.5, 5.5)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {"Switch": 2}}
    [over] = a.over_budget()
    assert (over["step"], over["lost"], over["budget"], len(over["failures"])) == ("Switch", 2, 1, 2)


def test_the_budget_is_per_visit_a_second_attempt_has_its_own() -> None:
    two = [*timeline((0, "Switch"), (2, "RollingBack"), (4, "RolledBack")),
           *timeline((10, "Preflight"), (11, "Switch"), (13, "Gate"), (15, "Done"), attempt=2)]
    # the second attempt's first look follows the first attempt's last one
    two[3] = Seen(T0 + 10, T0 + 9.95, 2, "Preflight")
    a = attribute({"n1": fail(1.0, 12.0)}, {"n1": two}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {"Switch": 2}}
    assert a.over_budget() == []


def test_a_failure_is_placed_where_it_leaves_room_for_the_next() -> None:
    # The first failure (3.5 s) overlaps the end of Cordon and Switch, the second (4.2 s) only Switch. Charging
    # the first to Switch, the step it was recorded in, would leave the second over budget: it goes to Cordon.
    a = attribute({"n1": fail(3.5, 4.2)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1, "Cordon": 1})
    assert a.over_budget() == []
    assert [(round(c.at - T0, 2), c.visit.step) for c in a.charges] == [(3.5, "Cordon"), (4.2, "Switch")]
    # Without room in Cordon the second is one too many in Switch.
    b = attribute({"n1": fail(3.5, 4.2)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1})
    assert [(o["step"], o["lost"]) for o in b.over_budget()] == [("Switch", 2)]


def test_a_step_the_injector_saw_late_spans_its_blind_time() -> None:
    # The API was down from 3 s to 8 s: Switch was first seen at 8 s, after a look that started at 2.95 s and
    # still saw Cordon. A failure at 4 s may be Switch's.
    blind = [Seen(T0, None, 1, "Cordon"), Seen(T0 + 8, T0 + 2.95, 1, "Switch"), Seen(T0 + 9, T0 + 8.95, 1, "Gate")]
    a = attribute({"n1": fail(4.0)}, {"n1": blind}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {"Switch": 1}}
    assert a.over_budget() == []


def test_failures_outside_the_pool_are_untouched_and_never_within_budget() -> None:
    a = attribute({"n1": [], "n3": fail(4.0)}, {"n1": MIGRATION, "n3": MIGRATION}, {"n1"},
                  {"Switch": 1, UNTOUCHED: 5})
    assert a.lost_by_step() == {"n3": {UNTOUCHED: 1}}
    assert [(o["node"], o["step"], o["lost"], o["budget"]) for o in a.over_budget()] == [("n3", UNTOUCHED, 1, 0)]
    # The table itself never gives the untouched pool anything.
    assert all(row[UNTOUCHED] == 0 for row in BUDGET.values())
    b = attribute({"n3": fail(4.0)}, {}, {"n1"}, BUDGET["agent-kill"])
    assert [(o["node"], o["step"], o["lost"], o["budget"]) for o in b.over_budget()] == [("n3", UNTOUCHED, 1, 0)]


def test_a_pool_node_the_injector_never_saw_is_charged_to_nothing_it_knows() -> None:
    a = attribute({"n1": fail(4.0)}, {}, {"n1"}, {"Switch": 1})
    assert a.lost_by_step() == {"n1": {UNSEEN: 1}}
    assert [o["step"] for o in a.over_budget()] == [UNSEEN]


def test_steps_sharing_a_budget_share_it_within_one_attempt() -> None:
    shared = [("Switch", "Gate")]
    # One connection lost in Switch and one in Gate of the same attempt: one too many for the pair.
    a = attribute({"n1": fail(4.0, 8.0)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1, "Gate": 1}, shared)
    assert a.lost_by_step() == {"n1": {"Switch": 1, "Gate": 1}}
    [over] = a.over_budget()
    assert (over["step"], over["attempt"], over["lost"], over["budget"]) == ("Switch+Gate", 1, 2, 1)
    # One is within it, wherever it falls.
    for at in (4.0, 8.0):
        assert attribute({"n1": fail(at)}, {"n1": MIGRATION}, {"n1"}, {"Switch": 1, "Gate": 1}, shared
                         ).over_budget() == []
    # Another attempt's Switch and Gate have their own.
    two = [*timeline((0, "Switch"), (2, "Gate"), (4, "RolledBack")),
           *timeline((10, "Switch"), (12, "Gate"), (14, "Done"), attempt=2)]
    two[3] = Seen(T0 + 10, T0 + 9.95, 2, "Switch")
    b = attribute({"n1": fail(3.0, 13.0)}, {"n1": two}, {"n1"}, {"Switch": 1, "Gate": 1}, shared)
    assert b.over_budget() == []


def test_visits_run_from_the_look_before_to_the_look_after() -> None:
    [first, second] = visits("n1", [Seen(T0, None, 1, "Gate"), Seen(T0 + 2, T0 + 1.9, 1, "Done")])
    assert (first.start, first.end) == (float("-inf"), T0 + 2)
    assert (second.start, second.end) == (T0 + 1.9, float("inf"))


def test_the_budget_covers_every_fault_and_step() -> None:
    assert set(STEPS) == {*PHASES, DELETED}
    assert all(set(BUDGET[f]) == set(COLUMNS) for f in FAULTS)
    # The rule hold applies at Switch: only a fault that keeps the hold from being made may cost a connection
    # there, or just after it, in Gate.
    assert [f for f in FAULTS if BUDGET[f]["Switch"] or BUDGET[f]["Gate"]] == ["agent-kill"]
    assert BUDGETS["agent-kill"].shared == (("Switch", "Gate"),)
    # Every non-zero entry comes from an allowance that says why.
    for fault in FAULTS:
        for step, lost in BUDGET[fault].items():
            if lost:
                assert any(fault in a.faults and step in a.steps and a.lost == lost and len(a.why) > 80
                           for a in ALLOWANCES), (fault, step)


@pytest.mark.parametrize(("row", "fault"), [("operator-kill", "operator-kill"),
                                            ("operator-kill (migration 2, to iptables)", "operator-kill"),
                                            ("agent-kill in Verify (migration 3, to nftables)", "agent-kill in Verify"),
                                            ("clock-skew +30s", "clock-skew"),
                                            ("kube-proxy-crashloop@Gate", "kube-proxy-crashloop@Gate")])
def test_a_report_row_finds_its_budget(row: str, fault: str) -> None:
    assert budget_of(row) is BUDGETS[fault]


def test_an_unknown_fault_has_no_budget() -> None:
    with pytest.raises(AssertionError, match="no single budget"):
        budget_of("gremlins")
