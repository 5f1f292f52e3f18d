"""Flush of stale kube-proxy objects: one flusher per kind of kernel object behind one interface.

Which kinds a mode leaves on a node is the mode's fact (`proxyshift.modes`, ModeFacts.objects): iptables mode
its chains, ipvs mode chains and IPVS objects, nftables mode its nft tables, Cilium's KPR its chains and devices
and its BPF attachments (never while its agent still answers on the node). `flush(remove_modes, target_mode)` runs
the flushers of the kinds the removed modes own, in the only safe order (OBJECT_KINDS): iptables rules first
(ipvs-mode rules reference the KUBE-* ipsets that the ipvs flusher destroys), then ipvs, then nftables, then a
replacement's devices, then its pinned BPF links and legacy tc filters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from proxyshift.agent import cilium_api
from proxyshift.agent.flush.base import Flusher, FlushReport, FlushStep, Runner
from proxyshift.agent.flush.bpf import DEFAULT_BPFFS, BpfFlusher
from proxyshift.agent.flush.devices import DeviceFlusher
from proxyshift.agent.flush.iptables import IptablesFlusher, IptablesTool
from proxyshift.agent.flush.ipvs import IpvsFlusher
from proxyshift.agent.flush.nftables import NftablesFlusher
from proxyshift.agent.ownership import MODES, Mode
from proxyshift.commands import run
from proxyshift.modes import MODE_FACTS, OBJECT_KINDS, ObjectKind

__all__ = ["FLUSHERS", "FlushOptions", "FlushReport", "FlushStep", "flush", "validate_modes"]


def validate_modes(remove_modes: Iterable[str], target_mode: str | None) -> tuple[frozenset[Mode], Mode | None]:
    bad = [m for m in [*remove_modes, *([target_mode] if target_mode else [])] if m not in MODES]
    if bad:
        raise ValueError(f"unknown kube-proxy mode(s) {bad}; expected one of {list(MODES)}")
    remove = frozenset(m for m in remove_modes if m != target_mode)
    return remove, target_mode  # type: ignore[return-value]  # every name was checked against MODES above


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


# One flusher per kind of object a mode leaves (ModeFacts.objects), run in OBJECT_KINDS order.
FLUSHERS: dict[ObjectKind, Callable[[FlushOptions], Flusher]] = {
    "iptables-chains": lambda o: IptablesFlusher(run=o.runner, tools=o.iptables_tools, destroy_sets=o.destroy_sets,
                                                 verify=o.verify, dry_run=o.dry_run),
    "ipvs-objects": lambda o: IpvsFlusher(run=o.runner, proc_root=o.proc_root, dry_run=o.dry_run),
    "nft-tables": lambda o: NftablesFlusher(run=o.runner, dry_run=o.dry_run),
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
          answers: Callable[[str], bool] = _agent_answers) -> FlushReport:
    """Remove the objects of `remove_modes` that `target_mode` does not use. Idempotent.

    The target mode is never removed, even if listed: that is the mode kube-proxy
    runs now. dry_run: report what would be removed, change nothing.
    """
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
                           dry_run=dry_run, bpffs=bpffs,
                           # The iptables flush also drops the rules that reference the removed modes' ipsets,
                           # so that those can be destroyed.
                           destroy_sets=frozenset[str]().union(*(MODE_FACTS[m].owned.ipsets for m in remove)))
    # Only the kinds a removed mode owns: a flush of nftables alone saves no iptables table at all. Each
    # flusher also decides for itself which of its objects the target mode keeps (shared chains).
    owned = {kind for m in remove for kind in MODE_FACTS[m].objects}
    for kind in OBJECT_KINDS:
        if kind in owned:
            report.steps.extend(FLUSHERS[kind](options).flush(remove, target))
    return report
