"""Surgical flush of kube-proxy's iptables chains: one save and one restore per family and backend.

The restore input is applied with --noflush, so the kernel only sees what we
name: the rules in other chains that jump into kube-proxy's stale chains are
deleted by their own text (`-D`), the stale chains are declared (which empties
them) and removed (`-X`). Nothing else is named, so a user's chains and rules
stay exactly as iptables-save shows them.

Each COMMIT block of an iptables-restore input is one transaction. The first
block of each table does everything traffic can notice: it unlinks the stale
chains from every chain that stays, all at once. What follows only empties and
deletes chains no packet can reach any more, in blocks of CHAIN_BATCH chains:
iptables-nft-restore is superlinear in the size of one commit (32,000 chains,
10,000 Services: 86 s as one block, about 2 s in blocks of 1,000). If a block
fails, the blocks before it stand and the flush plans again from a fresh save:
it is idempotent, so finishing later is the same as finishing now.

Another owner's chains can go in the same round (`extra`: the rule hold's copies, agent/hold.py, when a
Cleanup releases the hold): planned from the flush's own save and merged into its restore, so a family costs
one save and one restore for both, not a round each. The families and backends go side by side.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from proxyshift.agent.flush.base import FlushStep, Runner
from proxyshift.agent.iptables_save import Dump, Rule, parse, rule_sets
from proxyshift.agent.ownership import Mode, chain_is_stale, iptables_chain_modes
from proxyshift.commands import CommandError, run, side_by_side

Family = Literal["ipv4", "ipv6"]
Backend = Literal["nft", "legacy"]

SAVE_TIMEOUT = 120.0
RESTORE_TIMEOUT = 300.0


@dataclass(frozen=True)
class IptablesTool:
    """One iptables family + backend: the save/restore binaries to use."""

    family: Family
    backend: Backend | None   # None: the distribution's default `iptables-save`

    @property
    def _stem(self) -> str:
        return "iptables" if self.family == "ipv4" else "ip6tables"

    @property
    def save(self) -> str:
        return f"{self._stem}-{self.backend}-save" if self.backend else f"{self._stem}-save"

    @property
    def restore(self) -> str:
        return f"{self._stem}-{self.backend}-restore" if self.backend else f"{self._stem}-restore"

    @property
    def label(self) -> str:
        return f"iptables ({self.family}, {self.backend or 'default'} backend)"


def available_tools(which: Callable[[str], str | None] = shutil.which,
                    families: Iterable[Family] = ("ipv4", "ipv6")) -> list[IptablesTool]:
    """Every family/backend whose tools are installed.

    Both backends are looked at: a kube-proxy image may have written legacy rules
    on a host whose own iptables is nft (or the reverse), and those are stale too.
    """
    tools: list[IptablesTool] = []
    for family in families:
        found = False
        for backend in ("nft", "legacy"):
            tool = IptablesTool(family, backend)
            if which(tool.save) and which(tool.restore):
                tools.append(tool)
                found = True
        if not found:
            tool = IptablesTool(family, None)
            if which(tool.save) and which(tool.restore):
                tools.append(tool)
    return tools


@dataclass
class TablePlan:
    table: str
    delete_chains: list[str] = field(default_factory=list)
    # Rules outside the deleted chains that must go with them: jumps into a deleted
    # chain, and rules in kube-proxy's own kept chains that match a destroyed ipset.
    delete_rules: list[Rule] = field(default_factory=list)


def plan_flush(dump: Dump, remove_modes: frozenset[Mode], target_mode: Mode | None,
               destroy_sets: frozenset[str] = frozenset()) -> list[TablePlan]:
    """Pure: what to remove from `dump`. Empty when nothing is stale (idempotence)."""
    plans: list[TablePlan] = []
    for table in dump.tables.values():
        doomed = [c for c in table.user_defined() if chain_is_stale(table.name, c, remove_modes, target_mode)]
        doomed_set = set(doomed)
        rules: list[Rule] = []
        for rule in table.rules:
            if rule.chain in doomed_set:
                continue  # emptied by the chain declaration
            jumps_into_doomed = rule.target in doomed_set
            matches_doomed_set = bool(destroy_sets) and bool(iptables_chain_modes(table.name, rule.chain)) \
                and bool(set(rule_sets(rule.line)) & destroy_sets)
            if jumps_into_doomed or matches_doomed_set:
                rules.append(rule)
        if doomed or rules:
            plans.append(TablePlan(table.name, doomed, rules))
    return plans


CHAIN_BATCH = 1000


def _blocks(table: str, lines: list[str], size: int) -> list[str]:
    out: list[str] = []
    for i in range(0, len(lines), size):
        out += [f"*{table}", *lines[i:i + size], "COMMIT"]
    return out


def render_restore(plans: list[TablePlan], *, batch: int = CHAIN_BATCH) -> str:
    """iptables-restore --noflush input for the plans (see the module doc for the block order)."""
    out: list[str] = []
    for plan in plans:
        # One transaction per table: after it, no kept chain leads into a stale one.
        out += _blocks(plan.table, [f"-D {rule.chain} {rule.spec}" for rule in plan.delete_rules],
                       len(plan.delete_rules) or 1)
    for plan in plans:
        # Declaring an existing chain under --noflush empties it, which also drops
        # every link between stale chains before any of them is deleted.
        out += _blocks(plan.table, [f":{chain} - [0:0]" for chain in plan.delete_chains], batch)
    for plan in plans:
        out += _blocks(plan.table, [f"-X {chain}" for chain in plan.delete_chains], batch)
    return "\n".join(out) + "\n" if out else ""


def merge_plans(*parts: list[TablePlan]) -> list[TablePlan]:
    """Pure: one plan per table that removes every chain and rule the parts remove (one restore for all of them).

    A rule inside a chain that goes is not deleted on its own (declaring the chain empties it), and no rule is
    deleted twice: a second `-D` of the same text would fail the whole transaction.
    """
    merged: dict[str, TablePlan] = {}
    chains: dict[str, set[str]] = {}
    for plans in parts:
        for plan in plans:
            into = merged.setdefault(plan.table, TablePlan(plan.table))
            seen = chains.setdefault(plan.table, set())
            into.delete_chains += [c for c in plan.delete_chains if c not in seen]
            seen.update(plan.delete_chains)
            into.delete_rules += plan.delete_rules
    for table, into in merged.items():
        doomed, lines = chains[table], set[str]()
        rules = []
        for rule in into.delete_rules:
            if rule.chain not in doomed and rule.line not in lines:
                lines.add(rule.line)
                rules.append(rule)
        into.delete_rules = rules
    return list(merged.values())


# Another owner's chains removed in the flush's own round: its plans from the flush's save of one tool.
ExtraPlanner = Callable[[IptablesTool, Dump], list[TablePlan]]


@dataclass
class ToolRound:
    """One family/backend's round: the flush's step, and what it did for the `extra` planner."""

    step: FlushStep
    extra_removed: int = 0
    extra_error: str | None = None
    # The verifying save, read after the round's restore (None: nothing was restored, or no verification).
    after: Dump | None = None


def _count(plans: list[TablePlan], step: FlushStep) -> None:
    for plan in plans:
        step.add("chains", len(plan.delete_chains))
        step.add("jump rules", len(plan.delete_rules))


@dataclass
class IptablesFlusher:
    run: Runner = run
    tools: list[IptablesTool] | None = None
    destroy_sets: frozenset[str] = frozenset()
    verify: bool = True
    dry_run: bool = False
    # Another owner's chains that go in the same save and restore (see the module doc); not in a dry run.
    extra: ExtraPlanner | None = None

    def _save(self, tool: IptablesTool) -> Dump:
        return parse(self.run([tool.save], timeout=SAVE_TIMEOUT).stdout)

    def _plan(self, tool: IptablesTool, dump: Dump, remove_modes: frozenset[Mode],
              target_mode: Mode | None) -> tuple[list[TablePlan], list[TablePlan]]:
        own = plan_flush(dump, remove_modes, target_mode, self.destroy_sets)
        return own, (self.extra(tool, dump) if self.extra is not None and not self.dry_run else [])

    def _restore(self, tool: IptablesTool, own: list[TablePlan], extra: list[TablePlan]) -> None:
        self.run([tool.restore, "-w", "5", "--noflush"], input=render_restore(merge_plans(own, extra)),
                 timeout=RESTORE_TIMEOUT)

    def flush_one(self, tool: IptablesTool, remove_modes: frozenset[Mode],
                  target_mode: Mode | None) -> FlushStep:
        return self.round(tool, remove_modes, target_mode).step

    def round(self, tool: IptablesTool, remove_modes: frozenset[Mode], target_mode: Mode | None) -> ToolRound:
        """One tool's save, restore and verifying save, for the flush and the `extra` planner."""
        step = FlushStep(tool.label)
        out = ToolRound(step)
        try:
            own, extra = self._plan(tool, self._save(tool), remove_modes, target_mode)
            if not own and not extra:
                return out
            if self.dry_run:
                _count(own, step)
                step.skipped.append("dry run: nothing changed")
                return out
            try:
                self._restore(tool, own, extra)
            except CommandError as first:
                # The transaction changed nothing. Most likely kube-proxy rewrote a chain
                # between our save and restore: plan again from a fresh save, once.
                own, extra = self._plan(tool, self._save(tool), remove_modes, target_mode)
                if own or extra:
                    try:
                        self._restore(tool, own, extra)
                    except CommandError as second:
                        said = f"iptables-restore refused the flush twice ({first}; {second}); nothing was changed"
                        # Each owner is told only of what it had to remove: a flush with nothing stale stays
                        # "nothing removed" whatever happened to the other's chains.
                        if own:
                            step.errors.append(said)
                        if extra:
                            out.extra_error = said
                        return out
            _count(own, step)
            out.extra_removed = sum(len(p.delete_chains) for p in extra)
            if self.verify:
                out.after = self._save(tool)
                left = plan_flush(out.after, remove_modes, target_mode, self.destroy_sets)
                if left:
                    names = [c for p in left for c in p.delete_chains][:5]
                    step.errors.append(f"after the flush kube-proxy chains are still present: {names}; "
                                       "run the cleanup again")
                extra_left = self.extra(tool, out.after) if self.extra is not None and extra else []
                if extra_left:
                    names = [c for p in extra_left for c in p.delete_chains][:5]
                    out.extra_error = f"still present after the restore: {names}"
        except CommandError as exc:
            step.errors.append(str(exc))
            out.extra_error = str(exc)
        return out

    def rounds(self, tools: list[IptablesTool], remove_modes: frozenset[Mode],
               target_mode: Mode | None) -> list[ToolRound]:
        """Every tool's round, side by side (they share nothing), in the tools' order. The legacy backend's rounds
        go one after the other in a lane of their own: every legacy restore takes the one xtables lock, and with
        `-w 5` a second one of ours would only wait for the first, and give up after 5 s on a large table."""
        legacy = [t for t in tools if t.backend == "legacy"]
        lanes = [[t] for t in tools if t.backend != "legacy"] + ([legacy] if legacy else [])
        done = side_by_side([functools.partial(self._lane, lane, remove_modes, target_mode) for lane in lanes],
                            name="flush-iptables")
        by_tool = {tool: r for lane, results in zip(lanes, done, strict=True)
                   for tool, r in zip(lane, results, strict=True)}
        return [by_tool[tool] for tool in tools]

    def _lane(self, tools: list[IptablesTool], remove_modes: frozenset[Mode],
              target_mode: Mode | None) -> list[ToolRound]:
        return [self.round(tool, remove_modes, target_mode) for tool in tools]

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        tools = self.tools if self.tools is not None else available_tools()
        if not tools:
            return [FlushStep("iptables", skipped=["no iptables-save/iptables-restore installed"])]
        return [r.step for r in self.rounds(tools, remove_modes, target_mode)]
