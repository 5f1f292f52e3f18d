"""Rule hold: the old mode's service rules, kept under proxyshift's names while the new kube-proxy starts.

Why it exists: a kube-proxy that starts in nftables mode deletes iptables mode's
rules, and one that starts in iptables mode deletes the `kube-proxy` nft tables
(platformCleanup in cmd/kube-proxy/app/server_linux.go, v1.37), before its
informers have synced and its first sync has programmed anything. Between that
cleanup and the first sync a ClusterIP has no DNAT on the node: a connection the
node itself opens (host-network clients, which cordon and drain cannot move)
sends its SYN to an address nobody answers, and conntrack pins that un-NATed
flow, so even the retransmitted SYN fails.

The hold is a copy of the old mode's service rules under names kube-proxy's
cleanup does not know, installed just before the switch:

- iptables -> nftables: every kube-proxy chain of the nat table (KUBE-SERVICES,
  KUBE-SVC-*, KUBE-SEP-*, KUBE-MARK-MASQ, KUBE-POSTROUTING, ...) copied as
  PSHOLD-*, with the jumps from PREROUTING/OUTPUT/POSTROUTING pointing at the
  copies.
- nftables -> iptables: the `kube-proxy` tables copied whole as `proxyshift-hold`
  tables (the text form of a table names its chains, sets and maps relative to
  the table, so only the table's own name changes).

Both copies DNAT exactly like the rules they were copied from. When both a
copy and kube-proxy's new rules exist, the first NAT rule a new connection meets
binds it and the kernel skips the other NAT chains of that hook, so they cannot
fight. The hold is released as soon as a new kube-proxy process has completed a
sync (the agent watches that through its probe), by every Cleanup, and at the
latest when its time to live runs out: a copy left longer would DNAT to
endpoints that may have gone. A Cleanup releases it in the flush's own round
(release_with_flush): the copies and the stale rules leave in one save and one
restore per iptables family, and one nft listing.

ipvs mode is not held: its virtual servers live in the IPVS table, not in rules
that can be renamed. ipvs <-> iptables needs no hold (kube-proxy keeps the
shared chains and does not clean the other of the two up at start).

Which kind of object a mode's hold copies is the mode's fact (ModeFacts.held_as);
this module has one installer per kind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxyshift.agent import flush as flush_mod
from proxyshift.agent.flush.base import Runner
from proxyshift.agent.flush.iptables import CHAIN_BATCH, IptablesTool, TablePlan, available_tools, render_restore
from proxyshift.agent.flush.nftables import list_tables, render_delete
from proxyshift.agent.iptables_save import BUILTIN_CHAINS, Dump, Rule, parse
from proxyshift.agent.ownership import NFT_TABLES, iptables_chain_modes
from proxyshift.api.proxynode import IN_FLIGHT, KubeProxyFacts, NodeMigration, Phase, attempt_key
from proxyshift.commands import CommandError, run, side_by_side
from proxyshift.modes import MODE_FACTS, MODES, ObjectKind, facts_of, startup_cleanup_drops_old_rules

HOLD_CHAIN_PREFIX = "PSHOLD-"
KUBE_PREFIX = "KUBE-"
NFT_HOLD_TABLE = "proxyshift-hold"
# Chains that only mark kube-proxy's presence or are long obsolete: nothing to keep.
_NOT_HELD = frozenset({"KUBE-PROXY-CANARY", "KUBE-MARK-DROP"})
SAVE_TIMEOUT = 120.0
RESTORE_TIMEOUT = 300.0


# Whether the new kube-proxy's start deletes rules a hold can keep; the state machine asks the same.
hold_applies = startup_cleanup_drops_old_rules
# The modes whose iptables chains a hold copies (iptables mode's; ipvs mode's shared chains are its too).
_HELD_CHAIN_MODES = frozenset(m for m, f in MODE_FACTS.items() if f.held_as == "iptables-chains")


def abandoned(operation_id: str | None, migration: NodeMigration | None) -> bool:
    """Whether the node's ProxyNode no longer names the migration a hold was made for: no migration, one that
    ended or went back to Pending, or another attempt (`operation_id`, the operation that made the hold, starts
    with its migration's attempt key). A hold found on the node by a restarted agent (no id) is abandoned only
    when no migration is in flight."""
    # In flight, a migration may still need its hold: made with the preflight (Preflight, then Prepared while it
    # waits for a slot), asked at the switch, kept through the gate and a rollback until a kube-proxy has synced.
    # Any other phase (Pending after an abandon, Done, Failed, RolledBack) is its end: a hold is a stale copy.
    if migration is None or migration.phase not in IN_FLIGHT:
        return True
    return operation_id is not None and not operation_id.startswith(f"{attempt_key(migration)}.")


# Phases in which the target kube-proxy may start, or has started, and runs its startup cleanup of the old rules.
_SWITCHING: frozenset[Phase] = frozenset({"Switch", "Gate"})


def sync_frees(synced_mode: str | None, migration: NodeMigration | None) -> bool:
    """Whether a kube-proxy that has synced (a different process from the one the hold was made under) makes the
    hold unneeded. While the migration switches forward, only one of the migration's target mode: an old-mode
    kube-proxy that restarts and syncs meanwhile (a Node deleted and registered again restarts it: kube-proxy
    exits when its Node's addresses change) rewrites the old rules that the target's startup cleanup then
    removes, with no hold left to serve until the target's first sync. The target is the migration's, so a hold
    a restarted agent found on the node waits for it too (it cannot tell which kube-proxy the hold was made
    under). Otherwise (waiting for a slot, rolling back, ended, or a record without a target mode) any mode's."""
    if migration is None or migration.phase not in _SWITCHING or migration.to_mode is None:
        return True
    return synced_mode == migration.to_mode


def kube_proxy_serves(facts: KubeProxyFacts | None, held_start: float | None) -> bool:
    """Whether kube-proxy's own rules serve the node without the hold: the kube-proxy that ran when the hold was
    made still runs (nothing switched, its rules never went), or the one running now has synced since it started.

    An abandoned hold goes only then. A Node deleted at Gate ends its migration (the new Node's ProxyNode names
    none) while the target kube-proxy has exited before its first sync (kube-proxy 1.37 exits when its Node is
    deleted, and its next start waits up to 30 s for a Node to exist) and the old rules went with its startup
    cleanup: the hold is then all that serves the node's Services."""
    if facts is None or facts.process_start_time is None:
        return False  # nobody answers: nothing proves rules are in place
    if held_start is not None and facts.process_start_time == held_start:
        return True
    return facts.synced_since_start()


def held_name(chain: str) -> str:
    """KUBE-SVC-ABC -> PSHOLD-SVC-ABC (28 characters at most, iptables' limit, for kube-proxy's names)."""
    return HOLD_CHAIN_PREFIX + chain.removeprefix(KUBE_PREFIX)


def _retarget(rule: Rule, renames: dict[str, str]) -> str:
    """The rule's spec with its jump target renamed (the target is the last -j/-g of the line)."""
    assert rule.target is not None
    spec = rule.spec
    for flag in ("-j", "-g"):
        needle = f"{flag} {rule.target}"
        at = spec.rfind(needle)
        end = at + len(needle)
        if at >= 0 and (at == 0 or spec[at - 1] == " ") and (end == len(spec) or spec[end] == " "):
            return f"{spec[:at]}{flag} {renames[rule.target]}{spec[end:]}"
    raise ValueError(f"cannot find the jump to {rule.target} in {rule.line!r}")


def plan_iptables_hold(dump: Dump) -> tuple[list[str], list[str], list[str]]:
    """Pure: (chain declarations, rules of the copies, hook jumps) copying kube-proxy's nat chains.

    Empty when the dump has no iptables-mode nat chain (nothing to hold).
    """
    nat = dump.tables.get("nat")
    if nat is None:
        return [], [], []
    owned = [c for c in nat.user_defined()
             if c not in _NOT_HELD and _HELD_CHAIN_MODES & iptables_chain_modes("nat", c)]
    if not owned:
        return [], [], []
    renames = {c: held_name(c) for c in owned}
    declare = [f":{renames[c]} - [0:0]" for c in owned]
    rules: list[str] = []
    hooks: list[str] = []
    for rule in nat.rules:
        if rule.chain in renames:
            spec = _retarget(rule, renames) if rule.target in renames else rule.spec
            rules.append(f"-A {renames[rule.chain]} {spec}")
        elif rule.chain in BUILTIN_CHAINS and rule.target in renames:
            hooks.append(f"-A {rule.chain} {_retarget(rule, renames)}")
    return declare, rules, hooks


def render_iptables_hold(declare: list[str], rules: list[str], hooks: list[str], *,
                         batch: int = CHAIN_BATCH) -> str:
    """iptables-restore --noflush input: the copies first, the hook jumps that make them live last.

    Until the last block commits no packet reaches a copy, so blocks of `batch`
    lines keep a large table fast (see flush/iptables.py) without a half-made hold
    ever seeing traffic.
    """
    out: list[str] = []
    for lines in (declare, rules):
        for i in range(0, len(lines), batch):
            out += ["*nat", *lines[i:i + batch], "COMMIT"]
    if hooks:
        out += ["*nat", *hooks, "COMMIT"]
    return "\n".join(out) + "\n" if out else ""


def plan_iptables_release(dump: Dump) -> list[TablePlan]:
    """Pure: the hold chains and the rules that jump into them. A hold lives in the nat table only, so
    callers save just that table (a full save at 10k Services would be most of a cleanup's time)."""
    plans = []
    for table in dump.tables.values():
        chains = [c for c in table.user_defined() if c.startswith(HOLD_CHAIN_PREFIX)]
        if not chains:
            continue
        doomed = set(chains)
        jumps = [r for r in table.rules if r.chain not in doomed and r.target in doomed]
        plans.append(TablePlan(table.name, chains, jumps))
    return plans


def nft_hold_text(family: str, listed: str) -> str:
    """`nft list table <family> kube-proxy` output -> an nft -f script that (re)creates it as the hold table."""
    header = f"table {family} kube-proxy {{"
    lines = listed.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None or lines[first].strip() != header:
        raise ValueError(f"unexpected `nft list table {family} kube-proxy` output: starts with "
                         f"{(lines[first] if first is not None else '')[:80]!r}")
    lines[first] = f"table {family} {NFT_HOLD_TABLE} {{"
    # The add+delete idiom replaces an older hold in the same transaction that creates the new one.
    return render_delete([(family, NFT_HOLD_TABLE)]) + "\n".join(lines[first:]) + "\n"


@dataclass
class HoldReport:
    """What one install or release did, per tool."""

    action: str
    done: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def changed(self) -> bool:
        return bool(self.done)

    def message(self) -> str:
        text = f"rule hold {self.action}: " + ("; ".join(self.done) or "nothing to do")
        if self.errors:
            text += "; ERROR: " + "; ".join(self.errors)
        return text

    def collect(self, outcomes: list[tuple[str | None, str | None]]) -> None:
        """Add each part's (what was done, or its error), in the parts' order; (None, None): it had nothing."""
        for done, error in outcomes:
            self.done += [done] if done else []
            self.errors += [error] if error else []


# What a release says per part: release() and release_with_flush() report alike.
def _chains_removed(label: str, n: int) -> str:
    return f"{label}: {n} chains removed"


def _nft_tables_removed(n: int) -> str:
    return f"{n} nft hold tables removed"


def _failed(label: str, error: object) -> str:
    # The nft part's errors are named after the kernel subsystem, as every nft error the agent reports.
    return f"nftables: {error}" if label == flush_mod.NFT_LABEL else f"{label}: {error}"


def _held_by(tool: IptablesTool) -> bool:
    # Only the nft backend and the default: that is where a current kube-proxy writes.
    return tool.backend != "legacy"


def _tools(tools: list[IptablesTool] | None) -> list[IptablesTool]:
    found = tools if tools is not None else available_tools()
    return [t for t in found if _held_by(t)]


def install(from_mode: str, *, runner: Runner = run, iptables_tools: list[IptablesTool] | None = None) -> HoldReport:
    """Copy `from_mode`'s service rules under the hold's names. Idempotent: an older hold is replaced."""
    report = HoldReport("install")
    facts = facts_of(from_mode)
    kind = facts.held_as if facts is not None else None
    if kind is None:
        held = " and ".join(m for m in MODES if MODE_FACTS[m].held_as)
        report.errors.append(f"no hold for {from_mode!r} mode (only {held} rules can be held)")
        return report
    INSTALLERS[kind](report, runner, iptables_tools)
    return report


def _install_iptables(report: HoldReport, runner: Runner, iptables_tools: list[IptablesTool] | None) -> None:
    # The families side by side: each its own save and restore, sharing nothing.
    tools = _tools(iptables_tools)
    report.collect(side_by_side([functools.partial(_install_one, tool, runner) for tool in tools],
                                name="hold-install"))


def _install_one(tool: IptablesTool, runner: Runner) -> tuple[str | None, str | None]:
    """One family's copy: (what was done, or the error); (None, None) when it has nothing to hold."""
    try:
        dump = _save_nat(tool, runner)
        declare, rules, hooks = plan_iptables_hold(dump)
        if not declare:
            return None, None
        _release_iptables(tool, dump, runner)
        runner([tool.restore, "-w", "5", "--noflush"], input=render_iptables_hold(declare, rules, hooks),
               timeout=RESTORE_TIMEOUT)
        return f"{tool.label}: {len(declare)} chains, {len(rules)} rules copied", None
    except (CommandError, ValueError) as exc:
        return None, f"{tool.label}: {exc}"


def _install_nft(report: HoldReport, runner: Runner, iptables_tools: list[IptablesTool] | None) -> None:
    try:
        present = set(list_tables(runner))
        for family, name in NFT_TABLES:
            if (family, name) not in present:
                continue
            listed = runner(["nft", "list", "table", family, name], timeout=SAVE_TIMEOUT).stdout
            runner(["nft", "-f", "-"], input=nft_hold_text(family, listed), timeout=RESTORE_TIMEOUT)
            report.done.append(f"nft table {family} {name} copied as {family} {NFT_HOLD_TABLE}")
    except (CommandError, ValueError) as exc:
        report.errors.append(f"nftables: {exc}")


# One installer per kind of object a mode's hold copies (ModeFacts.held_as).
INSTALLERS: dict[ObjectKind, Callable[[HoldReport, Runner, list[IptablesTool] | None], None]] = {
    "iptables-chains": _install_iptables,
    "nft-tables": _install_nft,
}


def _save_nat(tool: IptablesTool, runner: Runner) -> Dump:
    return parse(runner([tool.save, "-t", "nat"], timeout=SAVE_TIMEOUT).stdout)


def _release_iptables(tool: IptablesTool, dump: Dump, runner: Runner) -> int:
    plans = plan_iptables_release(dump)
    if plans:
        runner([tool.restore, "-w", "5", "--noflush"], input=render_restore(plans), timeout=RESTORE_TIMEOUT)
    return sum(len(p.delete_chains) for p in plans)


def release(*, runner: Runner = run, iptables_tools: list[IptablesTool] | None = None) -> HoldReport:
    """Remove every hold on the node (both kinds). Idempotent."""
    report = HoldReport("release")
    # Every family and the nft hold side by side: they share nothing. Reported in that order.
    calls = [functools.partial(_release_one, tool, runner) for tool in _tools(iptables_tools)]
    report.collect(side_by_side([*calls, functools.partial(_release_nft, runner)], name="hold-release"))
    return report


def _release_one(tool: IptablesTool, runner: Runner) -> tuple[str | None, str | None]:
    try:
        removed = _release_iptables(tool, _save_nat(tool, runner), runner)
        return (_chains_removed(tool.label, removed) if removed else None), None
    except (CommandError, ValueError) as exc:
        return None, _failed(tool.label, exc)


def _release_nft(runner: Runner) -> tuple[str | None, str | None]:
    try:
        held = _held_tables(list_tables(runner))
        if held:
            runner(["nft", "-f", "-"], input=render_delete(held), timeout=RESTORE_TIMEOUT)
            return _nft_tables_removed(len(held)), None
        return None, None
    except (CommandError, ValueError) as exc:
        return None, _failed(flush_mod.NFT_LABEL, exc)


def _held_tables(listed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(family, name) for family, name in listed if name == NFT_HOLD_TABLE]


def release_with_flush(remove_modes: list[str], target_mode: str | None, *, runner: Runner = run,
                       iptables_tools: list[IptablesTool] | None = None,
                       **flush_args: Any) -> tuple[flush_mod.FlushReport, HoldReport]:
    """A Cleanup's flush of `remove_modes` with every hold on the node (both kinds) released in the same round:
    the copies are planned from the flush's own save of each family and removed by its restore, the nft hold
    table chosen from its listing. What `release` and then `flush` would do, and report, in one round instead
    of two. `flush_args`: the rest of flush()'s arguments."""
    extra = flush_mod.Extra(iptables=lambda tool, dump: plan_iptables_release(dump) if _held_by(tool) else [],
                            iptables_covers=_held_by, nft_tables=_held_tables)
    flushed = flush_mod.flush(remove_modes, target_mode, runner=runner, iptables_tools=iptables_tools,
                              extra=extra, **flush_args)
    report = HoldReport("release")
    # As release() reports: the iptables families in the tools' order, then the nft hold (its round ran beside).
    for label in sorted(extra.removed, key=lambda label: label == flush_mod.NFT_LABEL):
        n = extra.removed[label]
        report.done.append(_nft_tables_removed(n) if label == flush_mod.NFT_LABEL else _chains_removed(label, n))
    for label in sorted(extra.errors, key=lambda label: label == flush_mod.NFT_LABEL):
        report.errors.append(_failed(label, extra.errors[label]))
    return flushed, report


def present(*, runner: Runner = run, iptables_tools: list[IptablesTool] | None = None) -> bool:
    """Whether any hold exists on the node (read-only)."""
    for tool in _tools(iptables_tools):
        try:
            nat = _save_nat(tool, runner).tables.get("nat")
        except (CommandError, ValueError):
            continue
        if nat is not None and any(c.startswith(HOLD_CHAIN_PREFIX) for c in nat.chains):
            return True
    try:
        return any(name == NFT_HOLD_TABLE for _, name in list_tables(runner))
    except (CommandError, ValueError):
        return False
