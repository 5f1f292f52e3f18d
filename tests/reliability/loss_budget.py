"""The loss budget of the fault suite: per fault and step, how many connections a switched node may lose.

One table (`BUDGET`, built from `ALLOWANCES`): every (fault, step) is 0 unless an allowance below says otherwise,
and each allowance names the mechanism that costs the connection. docs/reliability.md states the same table
(`render()`; tests/unit/test_reliability_doc.py checks the two are equal). A budget is per node and per *visit*
of a step: a node that enters Switch in two attempts, or whose Node is deleted twice, has it each time.

`attribute()` is the pure part the fault runs use: it charges each failed connection a prober saw to the step
its node was in. A failure recorded at wall time t belongs to a connection started up to one probe timeout
(1 s) earlier, and the injector sees a change only at its next look (50 ms apart, longer while the API is
down), so a failure may belong to any step the node was in during [t - timeout - poll, t + poll], where a
step's extent runs from the last look that did not yet see it to the first look that saw the next one. Among
the overlapping steps the failure is charged to one with budget left (a matching: the most failures that fit
the budget do); a failure that fits nowhere is charged to the step its node was in at t. Failures of nodes
outside the migrated pool are charged to `untouched`, whose budget is always 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

# Not a ProxyNode phase: the node's Node object (or its ProxyNode) is gone, or it was registered again and has
# not reached its Switch yet. The re-registered Node runs the baseline kube-proxy, started without a rule hold
# at some point of that stretch: the injector cannot see when, so the whole stretch is one step.
DELETED = "Deleted"
UNTOUCHED = "untouched"
# A pool node the injector never saw: nothing can be charged to a step it does not know.
UNSEEN = "unseen"
STEPS: tuple[str, ...] = ("Pending", "Preflight", "Prepared", "Cordon", "Switch", "Gate", "Cleanup", "Verify",
                          "Uncordon", "Done", "RollingBack", "RolledBack", "Failed", DELETED)
COLUMNS: tuple[str, ...] = (*STEPS, UNTOUCHED)
# The ProxyNode phases a Node registered again during a run is recorded as DELETED in (injector): before its
# Switch its kube-proxy is the baseline one the new Node started with.
BEFORE_SWITCH: frozenset[str] = frozenset({"Pending", "Preflight", "Prepared", "Cordon"})

ABSORBED = ("operator-kill", "apiserver-restart", "etcd-pause", "agent-kill", "probe-unreachable")
IN_VERIFY = tuple(f"{f} in Verify" for f in ("operator-kill", "apiserver-restart", "agent-kill"))
ROLLING_BACK = tuple(f"{f} while rolling back" for f in ("operator-kill", "apiserver-restart", "agent-kill"))
CRASH_LOOPS = ("kube-proxy-crashloop@Switch", "kube-proxy-crashloop@Gate")
# Every fault run of tests/reliability/test_faults.py, by the name its report row starts with.
FAULTS: tuple[str, ...] = (*ABSORBED, "node-delete", *CRASH_LOOPS, "kube-proxy-crashloop/retry", "clock-skew",
                           *IN_VERIFY, *ROLLING_BACK)


@dataclass(frozen=True)
class Allowance:
    """`lost` connections per node in `steps` under `faults`. Several steps share the one budget when a node
    passes through them in one go (same attempt, one after the other): the loss has one cause whose moment
    falls on either side of the boundary between them."""

    faults: tuple[str, ...]
    steps: tuple[str, ...]
    lost: int
    why: str


ALLOWANCES: tuple[Allowance, ...] = (
    Allowance(("agent-kill",), ("Switch", "Gate"), 1,
              "the node's switch runs without a rule hold: either its agent is dead or in its restart back-off "
              "when the switch asks for the hold, and the switch goes on without one after 20 s "
              "(`RuleHoldSkipped`). (Before 5 December also: the agent made the hold and was killed, and its "
              "successor, which cannot tell which kube-proxy an inherited hold was made for, released it at the "
              "first synced kube-proxy, possibly still the old one; it now waits for one of the migration's "
              "target mode, `hold.sync_frees`.) The new kube-proxy's startup cleanup then removes the old mode's "
              "rules before its first sync: a connection the node opens in that gap has no DNAT, conntrack pins "
              "it and its retransmitted SYNs fail until the 1 s connect timeout, by which time the gap (well "
              "under a second here) is over: one connection. Switch and Gate share it: Switch ends when the new "
              "kube-proxy pod is Ready, which (no readiness probe) is when it starts, so its cleanup and first "
              "sync fall at the end of Switch or, as in the run of 2 December (the failed connect began ~0.1 s "
              "after Gate was seen), at the start of Gate"),
    Allowance(("node-delete",), (DELETED,), 1,
              "a Node deleted after its switch comes back (the node simulator, like a kubelet) without the "
              "revision label, so the baseline iptables kube-proxy starts on it and its startup cleanup removes "
              "the nftables rules with no hold in place (the hold was dropped when the nftables kube-proxy "
              "synced): the same one-connection gap as a switch without a hold"),
    Allowance(("node-delete", *CRASH_LOOPS, *ROLLING_BACK), ("RollingBack",), 1,
              "a rollback moves the label back without a rule hold (the planner asks for one only on the way "
              "forward), so once the target kube-proxy has synced (the hold dropped), the old kube-proxy's "
              "startup cleanup removes its rules before its first sync: the same one-connection gap (seen once, "
              "30 November, in the crash loop from Gate)"),
)


@dataclass(frozen=True)
class Budget:
    """One fault's row: `steps` maps every column to its budget; each of `shared` is a group of steps whose
    consecutive visits in one attempt share one budget (`steps` gives each of them that same number)."""

    fault: str
    steps: Mapping[str, int]
    shared: tuple[tuple[str, ...], ...] = ()


def _build() -> dict[str, Budget]:
    table = {fault: dict.fromkeys(COLUMNS, 0) for fault in FAULTS}
    shared: dict[str, list[tuple[str, ...]]] = {fault: [] for fault in FAULTS}
    for allowance in ALLOWANCES:
        assert allowance.steps and set(allowance.steps) <= set(STEPS), \
            f"{allowance.steps}: not steps (the untouched pool's budget is always 0)"
        assert allowance.lost > 0 and allowance.why, allowance
        for fault in allowance.faults:
            assert fault in table, f"{fault}: not a fault of the suite"
            for step in allowance.steps:
                assert not table[fault][step], f"{fault} {step}: two allowances"
                table[fault][step] = allowance.lost
            if len(allowance.steps) > 1:
                shared[fault].append(allowance.steps)
    return {fault: Budget(fault, table[fault], tuple(shared[fault])) for fault in FAULTS}


BUDGETS: dict[str, Budget] = _build()
# fault -> step -> budget, as the table reads
BUDGET: dict[str, Mapping[str, int]] = {fault: b.steps for fault, b in BUDGETS.items()}


def budget_of(row_fault: str) -> Budget:
    """The budget of a report row's fault: `operator-kill (migration 2, to iptables)` is operator-kill's,
    `clock-skew +30s` clock-skew's, `agent-kill in Verify (migration 2, ...)` agent-kill in Verify's."""
    matches = [f for f in FAULTS if row_fault == f or row_fault.startswith((f"{f} (", f"{f} +"))]
    assert len(matches) == 1, f"no single budget for the fault {row_fault!r}: {matches}"
    return BUDGETS[matches[0]]


def _cell(budget: Budget, step: str) -> str:
    group = next((g for g in budget.shared if step in g), None)
    return str(budget.steps[step]) + (f" ({'+'.join(group)})" if group else "")


def render() -> str:
    """The budget as docs/reliability.md states it: the table, then why each non-zero entry is not 0."""
    lines = ["| fault | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for fault in FAULTS:
        lines.append(f"| {fault} | " + " | ".join(_cell(BUDGETS[fault], c) for c in COLUMNS) + " |")
    lines.append("")
    for allowance in ALLOWANCES:
        lines.append(f"- **{'+'.join(allowance.steps)} {allowance.lost}** ({', '.join(allowance.faults)}): "
                     f"{allowance.why}.")
    return "\n".join(lines) + "\n"


# ---- attribution ----


@dataclass(frozen=True)
class Seen:
    """One observed change of a node's step: first seen at `at` (wall time, after the look's reads), so entered
    after `since` (the start of the previous successful look; None for the first look)."""

    at: float
    since: float | None
    attempt: int
    step: str


@dataclass(frozen=True)
class Visit:
    node: str
    step: str
    attempt: int
    start: float  # earliest it may have begun
    end: float  # latest it may have ended
    # What the budget is counted over: the index of the first visit of a run of visits sharing one budget (a
    # shared group, same attempt, one after the other), else this visit's own index; and its name.
    unit: int = 0
    unit_name: str = ""


def visits(node: str, timeline: Sequence[Seen], shared: Sequence[tuple[str, ...]] = ()) -> list[Visit]:
    out: list[Visit] = []
    for i, seen in enumerate(timeline):
        start = -math.inf if i == 0 or seen.since is None else seen.since
        end = timeline[i + 1].at if i + 1 < len(timeline) else math.inf
        group = next((g for g in shared if seen.step in g), None)
        prev = out[-1] if out else None
        if group and prev is not None and prev.step in group and prev.attempt == seen.attempt:
            unit, name = prev.unit, prev.unit_name
        else:
            unit, name = i, "+".join(group) if group else seen.step
        out.append(Visit(node, seen.step, seen.attempt, start, end, unit, name))
    return out


@dataclass(frozen=True)
class Charge:
    at: float  # the failure's wall time
    error: str
    visit: Visit


def allowed(budget: Mapping[str, int], step: str) -> int:
    """A step's budget; the untouched pool and a node never seen get nothing, whatever `budget` says."""
    return 0 if step in (UNTOUCHED, UNSEEN) else budget.get(step, 0)


@dataclass
class Attribution:
    charges: list[Charge]
    budget: Mapping[str, int]

    def lost_by_step(self) -> dict[str, dict[str, int]]:
        """node -> step -> failed connections charged there (nodes and steps with none left out)."""
        out: dict[str, dict[str, int]] = {}
        for c in self.charges:
            steps = out.setdefault(c.visit.node, {})
            steps[c.visit.step] = steps.get(c.visit.step, 0) + 1
        return out

    def over_budget(self) -> list[dict[str, Any]]:
        """Each visit (or run of visits sharing a budget) charged more than its budget: node, step, attempt,
        lost, budget and the failure times."""
        by_unit: dict[tuple[str, int], list[Charge]] = {}
        for c in self.charges:
            by_unit.setdefault((c.visit.node, c.visit.unit), []).append(c)
        over = []
        for (node, _), charged in by_unit.items():
            visit = charged[0].visit
            most = allowed(self.budget, visit.step)
            if len(charged) > most:
                over.append({"node": node, "step": visit.unit_name, "attempt": visit.attempt, "lost": len(charged),
                             "budget": most, "failures": [f"{_clock(c.at)} {c.error} ({c.visit.step})"
                                                          for c in charged]})
        return over


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def attribute(failures: Mapping[str, Sequence[tuple[float, str]]], timelines: Mapping[str, Sequence[Seen]],
              pool: Collection[str], budget: Mapping[str, int], shared: Sequence[tuple[str, ...]] = (), *,
              probe_timeout: float = 1.0, poll: float = 0.05) -> Attribution:
    """Charge every failed connection `(wall time, error)` of each node to a step of that node (module doc);
    `shared`: groups of steps whose consecutive visits in one attempt share one budget (Budget.shared)."""
    items: list[tuple[float, str, str]] = sorted((t, node, err) for node, fs in failures.items() for t, err in fs)
    node_visits = {node: visits(node, timelines.get(node) or [], shared) for node in failures}
    candidates: list[list[Visit]] = []
    fallback: list[Visit] = []
    for t, node, _ in items:
        if node not in pool:
            whole = Visit(node, UNTOUCHED, 0, -math.inf, math.inf, 0, UNTOUCHED)
            candidates.append([whole])
            fallback.append(whole)
            continue
        mine = node_visits[node]
        if not mine:
            nothing = Visit(node, UNSEEN, 0, -math.inf, math.inf, 0, UNSEEN)
            candidates.append([nothing])
            fallback.append(nothing)
            continue
        lo, hi = t - probe_timeout - poll, t + poll
        overlapping = [v for v in mine if v.start <= hi and v.end >= lo]
        # The step the node was last seen entering by t: where the failure is charged when no budget fits.
        at_t = max((v for v in mine if v.start <= t), key=lambda v: v.start, default=mine[0])
        candidates.append(sorted(overlapping, key=lambda v: v != at_t) or [at_t])
        fallback.append(at_t)
    # A capacitated bipartite matching (augmenting paths): failure i may take a slot of any budget unit (a
    # visit, or a run of visits sharing one budget) it overlaps; a failure is left over only when no
    # assignment fits more failures.
    taken: dict[tuple[str, int], list[tuple[int, Visit]]] = {}

    def place(i: int, tried: set[tuple[str, int]]) -> bool:
        for visit in candidates[i]:
            unit, room = (visit.node, visit.unit), allowed(budget, visit.step)
            if unit in tried or room <= 0:
                continue
            tried.add(unit)
            holders = taken.setdefault(unit, [])
            if len(holders) < room:
                holders.append((i, visit))
                return True
            for held in list(holders):
                if place(held[0], tried):
                    holders.remove(held)
                    holders.append((i, visit))
                    return True
        return False

    for i in range(len(items)):
        place(i, set())
    placed = {i: visit for holders in taken.values() for i, visit in holders}
    charges = [Charge(t, err, placed.get(i, fallback[i])) for i, (t, _, err) in enumerate(items)]
    return Attribution(charges, budget)


def timeline_json(timeline: Sequence[Seen]) -> list[list[Any]]:
    """A node's timeline for the report: [HH:MM:SS.mmm, attempt, step] per change."""
    return [[_clock(s.at), s.attempt, s.step] for s in timeline]
