"""Flush of stale kube-proxy objects: one flusher per kind of kernel object behind one interface.

Which kinds a mode leaves on a node is the mode's fact (`proxyshift.modes`, ModeFacts.objects): iptables mode
its chains, ipvs mode chains and IPVS objects, nftables mode its nft tables, Cilium's KPR its chains and devices
and its BPF attachments (never while its agent still answers on the node). `flush(remove_modes, target_mode)` runs
the flushers of the kinds the removed modes own, in the only safe order (OBJECT_KINDS; kube-proxy's nft tables,
which depend on nothing else, beside the others): iptables rules first
(ipvs-mode rules reference the KUBE-* ipsets that the ipvs flusher destroys), then ipvs, then nftables, then a
replacement's devices, then its pinned BPF links and legacy tc filters.

`extra` lets another owner's objects leave in the same rounds (agent/hold.py: the rule hold's copies when a
Cleanup releases it), so the two share each save, listing and restore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from proxyshift.agent import cilium_api
from proxyshift.agent.flush.base import Flusher, FlushReport, FlushStep, Runner
from proxyshift.agent.flush.bpf import DEFAULT_BPFFS, BpfFlusher
from proxyshift.agent.flush.devices import DeviceFlusher
from proxyshift.agent.flush.iptables import ExtraPlanner, IptablesFlusher, IptablesTool, available_tools
from proxyshift.agent.flush.ipvs import IpvsFlusher
from proxyshift.agent.flush.nftables import ExtraTables, NftablesFlusher
from proxyshift.agent.ownership import MODES, Mode
from proxyshift.commands import run
from proxyshift.modes import MODE_FACTS, OBJECT_KINDS, ObjectKind

__all__ = ["FLUSHERS", "NFT_LABEL", "Extra", "FlushOptions", "FlushReport", "FlushStep", "flush", "validate_modes"]


def validate_modes(remove_modes: Iterable[str], target_mode: str | None) -> tuple[frozenset[Mode], Mode | None]:
    bad = [m for m in [*remove_modes, *([target_mode] if target_mode else [])] if m not in MODES]
    if bad:
        raise ValueError(f"unknown kube-proxy mode(s) {bad}; expected one of {list(MODES)}")
    remove = frozenset(m for m in remove_modes if m != target_mode)
    return remove, target_mode  # type: ignore[return-value]  # every name was checked against MODES above


# Extra's key for the nft round (a tool, like the iptables tools' labels beside it).
NFT_LABEL = "nft"


@dataclass
class Extra:
    """Another owner's objects that leave in the flush's own rounds: the rule hold's copies (agent/hold.py).

    Planned from the flush's own reads (its save of each iptables tool the extra covers, its nft listing) and
    removed by its own writes. Those two kinds' rounds run even when no removed mode owns the kind, then with
    no step in the flush's report: what they did for the other owner is in `removed` and `errors`, per
    iptables tool label or NFT_LABEL. Never in a dry run.
    """

    iptables: ExtraPlanner
    iptables_covers: Callable[[IptablesTool], bool]
    nft_tables: ExtraTables
    removed: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FlushOptions:
    """What every flusher is made with (one flush call's arguments)."""

    runner: Runner
    iptables_tools: list[IptablesTool] | None
    proc_root: Path
    verify: bool
    dry_run: bool
    destroy_sets: frozenset[str]
    # The node's BPF filesystem as the agent sees it (its DaemonSet's hostPath of /sys/fs/bpf).
    bpffs: Path = DEFAULT_BPFFS
    extra: Extra | None = None


# One flusher per kind of object a mode leaves (ModeFacts.objects), run in OBJECT_KINDS order.
FLUSHERS: dict[ObjectKind, Callable[[FlushOptions], Flusher]] = {
    "iptables-chains": lambda o: IptablesFlusher(run=o.runner, tools=o.iptables_tools, destroy_sets=o.destroy_sets,
                                                 verify=o.verify, dry_run=o.dry_run,
                                                 extra=o.extra.iptables if o.extra is not None else None),
    "ipvs-objects": lambda o: IpvsFlusher(run=o.runner, proc_root=o.proc_root, dry_run=o.dry_run),
    "nft-tables": lambda o: NftablesFlusher(run=o.runner, dry_run=o.dry_run,
                                            extra=o.extra.nft_tables if o.extra is not None else None),
    "replacement-devices": lambda o: DeviceFlusher(run=o.runner, dry_run=o.dry_run),
    "bpf-attachments": lambda o: BpfFlusher(run=o.runner, bpffs=o.bpffs, dry_run=o.dry_run),
}


def _agent_answers(socket_path: str) -> bool:
    """Whether a replacement's agent answers on its socket: then its objects are its running datapath."""
    facts = cilium_api.read_replacement(cilium_api.CiliumAPI(socket_path, timeout=2.0), with_services=False)
    return facts.agent_state is not None


def flush(remove_modes: Iterable[str], target_mode: str | None, *, runner: Runner = run,
          iptables_tools: list[IptablesTool] | None = None, proc_root: Path = Path("/proc"),
          verify: bool = True, dry_run: bool = False, bpffs: Path = DEFAULT_BPFFS,
          answers: Callable[[str], bool] = _agent_answers, extra: Extra | None = None) -> FlushReport:
    """Remove the objects of `remove_modes` that `target_mode` does not use. Idempotent.

    The target mode is never removed, even if listed: that is the mode kube-proxy
    runs now. dry_run: report what would be removed, change nothing. `extra`: another owner's
    objects removed in the same rounds (see Extra).
    """
    extra = extra if not dry_run else None
    remove, target = validate_modes(remove_modes, target_mode)
    report = FlushReport(sorted(remove), target)
    for mode in sorted(remove):
        replacement = MODE_FACTS[mode].replacement
        if replacement is not None and answers(replacement.default_socket):
            # Cilium still runs here (the CNI of a cluster that keeps it): its chains, devices and pinned links are
            # its running datapath, not stale.
            remove = remove - {mode}
            report.steps.append(FlushStep(f"{mode} objects", skipped=[
                f"{replacement.agent}'s agent answers on {replacement.default_socket}: its objects are in use"]))
    options = FlushOptions(runner=runner, iptables_tools=iptables_tools, proc_root=proc_root, verify=verify,
                           dry_run=dry_run, bpffs=bpffs, extra=extra,
                           # The iptables flush also drops the rules that reference the removed modes' ipsets,
                           # so that those can be destroyed.
                           destroy_sets=frozenset[str]().union(*(MODE_FACTS[m].owned.ipsets for m in remove)))
    # Only the kinds a removed mode owns: a flush of nftables alone saves no iptables table at all. Each
    # flusher also decides for itself which of its objects the target mode keeps (shared chains).
    owned = {kind for m in remove for kind in MODE_FACTS[m].objects}
    # kube-proxy's nft tables depend on nothing the other kinds remove (no ipset, chain or device of theirs), so
    # their round goes beside the others, which keep their order; the report keeps OBJECT_KINDS order.
    beside: FlushReport | None = None
    with ThreadPoolExecutor(1, thread_name_prefix="flush-nft") as pool:
        pending = None
        if "nft-tables" in owned or extra is not None:
            beside = FlushReport(report.remove_modes, report.target_mode)
            pending = pool.submit(_nft_round, options, extra, remove, target, beside, owned="nft-tables" in owned)
        for kind in OBJECT_KINDS:
            if kind == "nft-tables":
                if pending is not None:
                    pending.result()
                    assert beside is not None
                    report.steps.extend(beside.steps)
            elif extra is not None and kind == "iptables-chains":
                _iptables_with_extra(options, extra, remove, target, report, owned=kind in owned)
            elif kind in owned:
                report.steps.extend(FLUSHERS[kind](options).flush(remove, target))
    return report


def _iptables_with_extra(options: FlushOptions, extra: Extra, remove: frozenset[Mode], target: Mode | None,
                         report: FlushReport, *, owned: bool) -> None:
    flusher = FLUSHERS["iptables-chains"](options)
    assert isinstance(flusher, IptablesFlusher)
    tools = options.iptables_tools if options.iptables_tools is not None else available_tools()
    if not owned:
        # Only for the extra's objects: no round (no save) where it has none to look for.
        tools = [t for t in tools if extra.iptables_covers(t)]
    elif not tools:
        report.steps.extend(flusher.flush(remove, target))  # its "no iptables tools" step
    for tool, done in zip(tools, flusher.rounds(tools, remove if owned else frozenset(), target), strict=True):
        if owned:
            report.steps.append(done.step)
        if done.after is not None:
            report.after[tool.label] = done.after
        if done.extra_error is not None:
            extra.errors[tool.label] = done.extra_error
        elif done.extra_removed:
            extra.removed[tool.label] = done.extra_removed


def _nft_round(options: FlushOptions, extra: Extra | None, remove: frozenset[Mode], target: Mode | None,
               report: FlushReport, *, owned: bool) -> None:
    flusher = FLUSHERS["nft-tables"](options)
    assert isinstance(flusher, NftablesFlusher)
    done = flusher.round(remove if owned else frozenset(), target)
    if done.step is not None:
        report.steps.append(done.step)
    if extra is None:
        return
    if done.extra_error is not None:
        extra.errors[NFT_LABEL] = done.extra_error
    elif done.extra_removed:
        extra.removed[NFT_LABEL] = done.extra_removed
