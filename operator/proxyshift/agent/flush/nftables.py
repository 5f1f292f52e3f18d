"""Flush of nftables mode: kube-proxy keeps everything in `ip kube-proxy` and `ip6 kube-proxy`.

Both tables go in one `nft -f` transaction. Each delete is preceded by an add of
the same table (a no-op when it exists), the idiom knftables uses, so the
transaction cannot fail because kube-proxy removed a table in the meantime.
A user's own tables, even in the same families, are never named.
"""

from __future__ import annotations

import json
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


@dataclass
class NftablesFlusher:
    run: Runner = run
    dry_run: bool = False

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        step = FlushStep("nftables")
        if not kind_is_stale("nft-tables", remove_modes, target_mode):
            return []
        try:
            present = [t for t in NFT_TABLES if t in set(list_tables(self.run))]
            if present and self.dry_run:
                step.add("tables", len(present))
                step.skipped.append("dry run: nothing changed")
            elif present:
                self.run(["nft", "-f", "-"], input=render_delete(present), timeout=120)
                step.add("tables", len(present))
        except (CommandError, NftOutputError) as exc:
            step.errors.append(str(exc))
        return [step]
