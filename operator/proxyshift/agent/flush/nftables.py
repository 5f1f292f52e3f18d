"""Flush of nftables mode: kube-proxy keeps everything in `ip kube-proxy` and `ip6 kube-proxy`.

Both tables go in one `nft -f` transaction. Each delete is preceded by an add of
the same table (a no-op when it exists), the idiom knftables uses, so the
transaction cannot fail because kube-proxy removed a table in the meantime.
A user's own tables, even in the same families, are never named.

Another owner's tables can go in the same transaction (`extra`: the rule hold's copy, agent/hold.py, when a
Cleanup releases the hold), chosen from the flush's own listing: one `nft list` and one `nft -f` for both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from proxyshift.agent.flush.base import FlushStep, Runner
from proxyshift.agent.ownership import NFT_TABLES, Mode
from proxyshift.commands import CommandError, run
from proxyshift.modes import kind_is_stale


class NftOutputError(ValueError):
    """`nft -j` printed something that is not its JSON schema."""


def parse_tables(text: str) -> list[tuple[str, str]]:
    """(family, name) of every table in `nft -j list tables` output."""
    if not text.strip():
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NftOutputError(f"nft -j list tables: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise NftOutputError("nft -j list tables: no 'nftables' list")
    tables = []
    for item in doc["nftables"]:
        table = item.get("table") if isinstance(item, dict) else None
        if isinstance(table, dict) and "family" in table and "name" in table:
            tables.append((str(table["family"]), str(table["name"])))
    return tables


def list_tables(runner: Runner = run) -> list[tuple[str, str]]:
    return parse_tables(runner(["nft", "-j", "list", "tables"], timeout=30).stdout)


def render_delete(tables: list[tuple[str, str]]) -> str:
    return "".join(f"add table {fam} {name}\ndelete table {fam} {name}\n" for fam, name in tables)


# Another owner's tables removed in the flush's own transaction: chosen among the tables listed.
ExtraTables = Callable[[list[tuple[str, str]]], list[tuple[str, str]]]


@dataclass
class NftRound:
    """The flush's step (None: nftables mode is not flushed, only `extra` was asked), and what it did for `extra`."""

    step: FlushStep | None
    extra_removed: int = 0
    extra_error: str | None = None


@dataclass
class NftablesFlusher:
    run: Runner = run
    dry_run: bool = False
    # Another owner's tables that go in the same transaction (see the module doc); not in a dry run.
    extra: ExtraTables | None = None

    def round(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> NftRound:
        own = kind_is_stale("nft-tables", remove_modes, target_mode)
        extra_asked = self.extra is not None and not self.dry_run
        out = NftRound(FlushStep("nftables") if own else None)
        if not own and not extra_asked:
            return out
        try:
            listed = list_tables(self.run)
            present = [t for t in NFT_TABLES if t in set(listed)] if own else []
            extra = self.extra(listed) if self.extra is not None and extra_asked else []
            if present and self.dry_run:
                assert out.step is not None
                out.step.add("tables", len(present))
                out.step.skipped.append("dry run: nothing changed")
            elif present or extra:
                try:
                    self.run(["nft", "-f", "-"], input=render_delete(present + extra), timeout=120)
                except CommandError as exc:
                    # Each owner is told only of what it had to remove (one transaction: neither happened).
                    if present and out.step is not None:
                        out.step.errors.append(str(exc))
                    if extra:
                        out.extra_error = str(exc)
                    return out
                if out.step is not None:
                    out.step.add("tables", len(present))
                out.extra_removed = len(extra)
        except (CommandError, NftOutputError) as exc:
            if out.step is not None:
                out.step.errors.append(str(exc))
            out.extra_error = str(exc)
        return out

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        step = self.round(remove_modes, target_mode).step
        return [step] if step is not None else []
