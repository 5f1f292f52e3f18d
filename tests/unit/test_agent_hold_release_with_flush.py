"""A Cleanup's one round: the rule hold's copies and the stale kube-proxy chains leave in one save and one restore
per family (agent/hold.py release_with_flush), against a small model of iptables-restore --noflush."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.agent import hold
from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool, TablePlan, merge_plans, plan_flush, render_restore
from proxyshift.agent.iptables_save import Dump, Rule, Table, parse, rule_target
from proxyshift.agent.ownership import Mode
from proxyshift.commands import CommandError, Result

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent.parent / "fixtures"
WITH_USER_RULES = (FIXTURES / "iptables" / "iptables-mode-20-services-with-user-rules.save.txt").read_text()
V4, V6 = IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")
V4_LEGACY = IptablesTool("ipv4", "legacy")
IPTABLES_ONLY: frozenset[Mode] = frozenset({"iptables"})


class RestoreRefused(Exception):
    """The model refused a line: the whole COMMIT block changes nothing, as iptables-restore's transaction."""


def apply_restore(dump: Dump, text: str) -> Dump:
    """`iptables-restore --noflush` of `text` on `dump`: each COMMIT block all or nothing; declaring a chain
    empties it, -D needs the exact rule, -X an empty chain nothing jumps to."""
    tables = {name: Table(name, dict(t.chains), list(t.rules)) for name, t in dump.tables.items()}
    block: list[str] = []
    name = ""
    for line in text.splitlines():
        if line.startswith("*"):
            name, block = line[1:], []
        elif line == "COMMIT":
            tables[name] = _commit(tables.get(name) or Table(name), block)
        else:
            block.append(line)
    return Dump(tables)


def _commit(before: Table, lines: list[str]) -> Table:
    table = Table(before.name, dict(before.chains), list(before.rules))
    for line in lines:
        if line.startswith(":"):
            chain = line[1:].split()[0]
            table.rules = [r for r in table.rules if r.chain != chain]
            table.chains.setdefault(chain, f":{chain} - [0:0]")
        elif line.startswith("-D "):
            wanted = "-A " + line[3:]
            at = next((i for i, r in enumerate(table.rules) if r.line == wanted), None)
            if at is None:
                raise RestoreRefused(f"no such rule: {line}")
            del table.rules[at]
        elif line.startswith("-X "):
            chain = line[3:]
            if chain not in table.chains or any(r.chain == chain or r.target == chain for r in table.rules):
                raise RestoreRefused(f"cannot delete {chain}")
            del table.chains[chain]
        elif line.startswith("-A "):
            table.rules.append(Rule(line.split(" ", 2)[1], line, rule_target(line)))
    return table


def render_save(dump: Dump) -> str:
    out: list[str] = []
    for table in dump.tables.values():
        out += [f"*{table.name}", *table.chains.values(), *(r.line for r in table.rules), "COMMIT"]
    return "\n".join(out) + "\n"


def with_hold(save: str) -> Dump:
    """`save` with the hold installed over it (the copies and their hook jumps, as hold.install makes them)."""
    declare, rules, hooks = hold.plan_iptables_hold(parse(save))
    out: list[str] = []
    for lines in (declare, rules, hooks):
        out += ["*nat", *lines, "COMMIT"]
    return apply_restore(parse(save), "\n".join(out) + "\n")


class FakeNode:
    """iptables-save/-restore per tool over the model, `nft` over a table list; records every command."""

    def __init__(self, dumps: dict[IptablesTool, Dump], nft_tables: Sequence[tuple[str, str]] = (),
                 refuse: set[str] | None = None) -> None:
        self.dumps = dict(dumps)
        self.nft = list(nft_tables)
        self.refuse = refuse or set()  # restore binaries that always fail
        self.commands: list[str] = []
        self.restores: dict[str, list[str]] = {}

    def _tool(self, binary: str) -> IptablesTool:
        return next(t for t in self.dumps if binary in (t.save, t.restore))

    def __call__(self, argv: list[str], *, timeout: float, input: str | None = None, **_: Any) -> Result:
        assert timeout > 0 and isinstance(argv, list)
        self.commands.append(" ".join(argv[:2]) if argv[0] == "nft" else argv[0])
        if argv[0] == "nft" and argv[1:] == ["-j", "list", "tables"]:
            doc = {"nftables": [{"table": {"family": f, "name": n}} for f, n in self.nft]}
            return Result(argv, 0, json.dumps(doc), "")
        if argv[0] == "nft" and argv[1:] == ["-f", "-"]:
            assert input is not None
            gone = {tuple(line.split()[2:4]) for line in input.splitlines() if line.startswith("delete table")}
            self.nft = [t for t in self.nft if t not in gone]
            return Result(argv, 0, "", "")
        tool = self._tool(argv[0])
        if argv[0] == tool.save:
            return Result(argv, 0, render_save(self.dumps[tool]), "")
        assert input is not None and "--noflush" in argv
        self.restores.setdefault(tool.label, []).append(input)
        if argv[0] in self.refuse:
            raise CommandError(argv, "exited 1: line 3 failed", returncode=1)
        try:
            self.dumps[tool] = apply_restore(self.dumps[tool], input)
        except RestoreRefused as exc:
            raise CommandError(argv, f"exited 1: {exc}", returncode=1) from exc
        return Result(argv, 0, "", "")


def chains(dump: Dump) -> set[tuple[str, str]]:
    return {(t.name, c) for t in dump.tables.values() for c in t.user_defined()}


def test_a_hold_and_stale_chains_leave_in_one_restore_per_family() -> None:
    node = FakeNode({V4: with_hold(WITH_USER_RULES), V6: with_hold(WITH_USER_RULES)},
                    nft_tables=[("ip", "filter")])
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=node, iptables_tools=[V4, V6])
    assert flushed.ok and released.ok
    for tool in (V4, V6):
        left = chains(node.dumps[tool])
        assert not any(c.startswith(hold.HOLD_CHAIN_PREFIX) for _, c in left)
        assert plan_flush(node.dumps[tool], IPTABLES_ONLY, "nftables") == []
        assert ("filter", "KUBE-FIREWALL") in left  # kubelet's stays
        assert render_save(node.dumps[tool]).count("USER-") == WITH_USER_RULES.count("USER-")
        assert len(node.restores[tool.label]) == 1  # both owners' chains in one transaction set
        # one save to plan, one restore, one save to verify (which the inventory after a Cleanup reuses)
        assert node.commands.count(tool.save) == 2 and node.commands.count(tool.restore) == 1
        assert tool.label in flushed.after
    assert node.commands.count("nft -j") == 1 and "nft -f" not in node.commands  # no hold table: nothing to delete
    assert [s.tool for s in flushed.steps] == [V4.label, V6.label]  # the flush's report, as without the hold
    assert all(s.removed.get("chains") for s in flushed.steps)
    n = len(hold.plan_iptables_release(with_hold(WITH_USER_RULES))[0].delete_chains)
    assert released.message() == (f"rule hold release: {V4.label}: {n} chains removed; "
                                  f"{V6.label}: {n} chains removed")


def test_with_only_the_hold_on_the_node_only_the_hold_goes_and_the_flush_reports_nothing() -> None:
    # What kube-proxy's nftables start leaves: its own cleanup removed iptables mode's chains, the hold is left.
    clean = render_save(apply_restore(parse(WITH_USER_RULES), render_restore(
        plan_flush(parse(WITH_USER_RULES), IPTABLES_ONLY, "nftables"))))
    held = with_hold(WITH_USER_RULES)
    kube = {c for p in plan_flush(parse(WITH_USER_RULES), IPTABLES_ONLY, "nftables") for c in p.delete_chains}
    only_hold = apply_restore(held, render_restore(plan_flush(held, IPTABLES_ONLY, "nftables")))
    assert not kube & {c for _, c in chains(only_hold)} and hold.plan_iptables_release(only_hold)
    node = FakeNode({V4: only_hold})
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=node, iptables_tools=[V4])
    assert flushed.ok and released.ok and released.changed
    (restore,) = node.restores[V4.label]
    named = [line.split()[1] for line in restore.splitlines() if line.startswith(("-X", "-D"))]
    assert named and all(n.startswith(hold.HOLD_CHAIN_PREFIX) or n in ("PREROUTING", "OUTPUT", "POSTROUTING")
                         for n in named)
    assert chains(node.dumps[V4]) == chains(parse(clean))
    assert flushed.message().endswith(f"{V4.label}: nothing to remove")


def test_a_family_whose_restore_fails_is_reported_and_the_other_is_still_done() -> None:
    node = FakeNode({V4: with_hold(WITH_USER_RULES), V6: with_hold(WITH_USER_RULES)},
                    refuse={V6.restore})
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=node, iptables_tools=[V4, V6])
    assert not released.ok and not flushed.ok
    n = len(hold.plan_iptables_release(with_hold(WITH_USER_RULES))[0].delete_chains)
    assert released.done == [f"{V4.label}: {n} chains removed"]
    assert len(released.errors) == 1 and released.errors[0].startswith(f"{V6.label}: iptables-restore refused")
    v4, v6 = flushed.steps
    assert not v4.errors and v6.errors and not v6.removed
    assert not hold.plan_iptables_release(node.dumps[V4]) and hold.plan_iptables_release(node.dumps[V6])
    assert len(node.restores[V6.label]) == 2  # planned again from a fresh save, once


def test_legacy_tools_are_flushed_but_never_searched_for_a_hold() -> None:
    node = FakeNode({V4: with_hold(WITH_USER_RULES), V4_LEGACY: parse(WITH_USER_RULES)})
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=node,
                                                iptables_tools=[V4, V4_LEGACY])
    assert flushed.ok and released.ok
    assert [s.tool for s in flushed.steps] == [V4.label, V4_LEGACY.label]
    assert all(line.startswith(V4.label) for line in released.done)
    assert plan_flush(node.dumps[V4_LEGACY], IPTABLES_ONLY, "nftables") == []


def test_a_flush_of_nftables_alone_releases_an_iptables_hold_without_a_flush_step_for_it() -> None:
    node = FakeNode({V4: with_hold(WITH_USER_RULES), V4_LEGACY: parse(WITH_USER_RULES)},
                    nft_tables=[("ip", "kube-proxy"), ("ip", hold.NFT_HOLD_TABLE), ("ip", "filter")])
    flushed, released = hold.release_with_flush(["nftables"], "iptables", runner=node,
                                                iptables_tools=[V4, V4_LEGACY])
    assert flushed.ok and released.ok
    assert [s.tool for s in flushed.steps] == ["nftables"] and flushed.steps[0].removed == {"tables": 1}
    assert node.nft == [("ip", "filter")]
    assert node.commands.count("nft -j") == 1 and node.commands.count("nft -f") == 1  # one listing, one transaction
    assert V4_LEGACY.save not in node.commands  # no hold is looked for there, and nothing of iptables is flushed
    assert not hold.plan_iptables_release(node.dumps[V4])
    assert released.done[-1] == "1 nft hold tables removed"


def test_the_one_round_reports_what_release_then_flush_reported() -> None:
    separate = FakeNode({V4: with_hold(WITH_USER_RULES)}, nft_tables=[("ip", hold.NFT_HOLD_TABLE)])
    held_then = hold.release(runner=separate, iptables_tools=[V4])
    flushed_then = flush(["iptables"], "nftables", runner=separate, iptables_tools=[V4])
    together = FakeNode({V4: with_hold(WITH_USER_RULES)}, nft_tables=[("ip", hold.NFT_HOLD_TABLE)])
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=together, iptables_tools=[V4])
    assert released.message() == held_then.message()
    assert flushed.message() == flushed_then.message() and flushed.details() == flushed_then.details()
    assert render_save(together.dumps[V4]) == render_save(separate.dumps[V4])
    assert len(together.commands) < len(separate.commands)


_KUBE_NAT = [c for p in plan_flush(parse(WITH_USER_RULES), IPTABLES_ONLY, "nftables") if p.table == "nat"
             for c in p.delete_chains]


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(_KUBE_NAT)), st.booleans())
def test_one_merged_restore_leaves_what_the_hold_release_then_the_flush_leave(gone: set[str], held: bool) -> None:
    # Any part of iptables mode's nat chains already gone (kube-proxy's own cleanup, partly), hold or not.
    start = with_hold(WITH_USER_RULES) if held else parse(WITH_USER_RULES)
    pre = [TablePlan("nat", sorted(gone), [r for r in start.tables["nat"].rules
                                           if r.chain not in gone and r.target in gone])]
    start = apply_restore(start, render_restore(pre)) if gone else start
    hold_plans, flush_plans = hold.plan_iptables_release(start), plan_flush(start, IPTABLES_ONLY, "nftables")
    sequential = apply_restore(start, render_restore(hold_plans)) if hold_plans else start
    sequential = apply_restore(sequential, render_restore(plan_flush(sequential, IPTABLES_ONLY, "nftables")))
    merged = merge_plans(flush_plans, hold_plans)
    once = apply_restore(start, render_restore(merged)) if merged else start
    assert render_save(once) == render_save(sequential)
    lines = [r.line for p in merged for r in p.delete_rules]
    assert len(lines) == len(set(lines))  # no rule deleted twice


def test_the_legacy_backends_rounds_never_overlap_and_the_report_keeps_the_tools_order() -> None:
    import threading
    import time

    v6_legacy = IptablesTool("ipv6", "legacy")
    node = FakeNode({V4: parse(WITH_USER_RULES), V4_LEGACY: parse(WITH_USER_RULES), V6: parse(WITH_USER_RULES),
                     v6_legacy: parse(WITH_USER_RULES)})
    busy, overlaps, lock = [0], [], threading.Lock()

    def runner(argv: list[str], **kw: Any) -> Result:
        legacy = "legacy" in argv[0]
        if legacy:
            with lock:
                busy[0] += 1
                overlaps.append(busy[0])
            time.sleep(0.01)  # long enough for a second legacy round to start, were they side by side
        try:
            return node(argv, **kw)
        finally:
            if legacy:
                with lock:
                    busy[0] -= 1

    tools = [V4, V4_LEGACY, V6, v6_legacy]
    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=runner, iptables_tools=tools)
    assert flushed.ok and released.ok and max(overlaps) == 1  # the xtables lock's users, one at a time
    assert [s.tool for s in flushed.steps] == [t.label for t in tools]
    assert all(plan_flush(node.dumps[t], IPTABLES_ONLY, "nftables") == [] for t in tools)
