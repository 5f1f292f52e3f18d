"""Render the reliability report (JSON lines written by the tests) as the Markdown tables of docs/reliability.md.

    python3 tests/reliability/report.py /tmp/proxyshift-cluster/logs/reliability.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _lost(row: dict[str, Any]) -> str:
    traffic = row.get("traffic") or {}
    failed = {n: t["failed"] for n, t in traffic.items() if t.get("failed")}
    ok = sum(t.get("ok", 0) for t in traffic.values())
    longest = max((row.get("longest_outage_s") or {}).values(), default=0.0)
    if not failed:
        return f"nothing: 0 failed of {ok} connections"
    return f"{sum(failed.values())} failed of {ok} connections {failed}, longest outage {longest:.1f}s"


def _by_step(row: dict[str, Any]) -> str:
    """Where the failed connections fell: `ps-node-1 Switch 1; ps-node-3 untouched 1` (loss_budget.attribute);
    `-` for none, and for rows written before the report had it."""
    lost = row.get("lost_by_step") or {}
    return "; ".join(f"{node} {step} {count}" for node, steps in sorted(lost.items())
                     for step, count in steps.items()) or "-"


def fault_rows(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| fault | steps it fired at (node) | outcome | what happened | lost | lost by step | s |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "flips" in row:
            continue
        fired = ", ".join(f"{f['step']} ({f['node'][-1]})" for f in row.get("fired") or []) or "all (whole run)"
        outcome = f"{row['outcome']} ({row.get('reason')})"
        happened = (row.get("message") or "").replace("|", "/")[:160]
        if row.get("kills"):
            happened = f"{row['kills']} kube-proxy kills; " + happened
        if row.get("agent_clock_ahead_s"):
            happened = f"agent clock {row['agent_clock_ahead_s']}s ahead; " + happened
        out.append(f"| {row['fault']} | {fired} | {outcome} | {happened} | {_lost(row)} | {_by_step(row)} "
                   f"| {row.get('seconds')} |")
    return out


def soak_rows(rows: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for row in rows:
        if "flips" not in row:
            continue
        flips = row["flips"]
        out += [f"**{row['fault']}** ({row['seconds']} s): failed connections {row['failed']} of "
                f"{sum(row['ok'].values())} (by step: {_by_step(row)}); RSS growth first->last flip (MiB) "
                f"{ {k: round(v, 1) for k, v in row['rss_growth_mib'].items()} }; processes per node namespace "
                f"{row['processes']}", "",
                "| flip | mode | s | failed (node 1/2/3) | operator RSS MiB | agent RSS MiB (1/2/3) |",
                "|---|---|---|---|---|---|"]
        for f in flips:
            failed = "/".join(str(v) for v in f["failed"].values())
            agents = "/".join(str(v) for v in f["agent_rss_mib"].values())
            row_text = f"| {f['flip']} | {f['mode']} | {f['seconds']} | {failed} | {f['operator_rss_mib']} | {agents} |"
            out.append(row_text)
        out.append("")
    return out


def main(argv: list[str]) -> None:
    rows = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
    print("\n".join(fault_rows(rows)))
    print()
    print("\n".join(soak_rows(rows)))


if __name__ == "__main__":
    main(sys.argv)
