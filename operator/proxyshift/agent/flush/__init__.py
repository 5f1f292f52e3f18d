"""Flush of stale kube-proxy objects, one module per mode behind one interface.

`flush(remove_modes, target_mode)` runs the mode flushers in the only safe
order: iptables rules first (ipvs-mode rules reference the KUBE-* ipsets that
the ipvs flusher destroys), then ipvs, then nftables.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from proxyshift.agent.flush.base import Flusher, FlushReport, FlushStep, Runner
from proxyshift.agent.flush.iptables import IptablesFlusher, IptablesTool
from proxyshift.agent.flush.ipvs import IpvsFlusher
from proxyshift.agent.flush.nftables import NftablesFlusher
from proxyshift.agent.ownership import IPVS_IPSETS, MODES, Mode
from proxyshift.commands import run

__all__ = ["FlushReport", "FlushStep", "flush", "validate_modes"]


def validate_modes(remove_modes: Iterable[str], target_mode: str | None) -> tuple[frozenset[Mode], Mode | None]:
    bad = [m for m in [*remove_modes, *([target_mode] if target_mode else [])] if m not in MODES]
    if bad:
        raise ValueError(f"unknown kube-proxy mode(s) {bad}; expected one of {list(MODES)}")
    remove = frozenset(m for m in remove_modes if m != target_mode)
    return remove, target_mode  # type: ignore[return-value]  # every name was checked against MODES above


def flush(remove_modes: Iterable[str], target_mode: str | None, *, runner: Runner = run,
          iptables_tools: list[IptablesTool] | None = None, proc_root: Path = Path("/proc"),
          verify: bool = True, dry_run: bool = False) -> FlushReport:
    """Remove the objects of `remove_modes` that `target_mode` does not use. Idempotent.

    The target mode is never removed, even if listed: that is the mode kube-proxy
    runs now. dry_run: report what would be removed, change nothing.
    """
    remove, target = validate_modes(remove_modes, target_mode)
    report = FlushReport(sorted(remove), target)
    destroy_sets = frozenset(IPVS_IPSETS) if "ipvs" in remove and target != "ipvs" else frozenset()
    flushers: list[Flusher] = [
        IptablesFlusher(run=runner, tools=iptables_tools, destroy_sets=destroy_sets, verify=verify,
                        dry_run=dry_run),
        IpvsFlusher(run=runner, proc_root=proc_root, dry_run=dry_run),
        NftablesFlusher(run=runner, dry_run=dry_run),
    ]
    if "iptables" not in remove and "ipvs" not in remove:
        flushers = flushers[2:]
    for flusher in flushers:
        report.steps.extend(flusher.flush(remove, target))
    return report
