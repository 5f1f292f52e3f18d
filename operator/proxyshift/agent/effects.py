"""What the agent loop does to its node and reads from it, behind one protocol.

The loop (agent/loop.py) decides when and why; `NodeEffects` is every call that reaches the
node's kernel, tools or kube-proxy. `KernelNodeEffects` is the real node; the unit tests pass a
fake that records calls and answers from memory, the dataplane tests the real one in a network
namespace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from proxyshift.agent import behaviour as behaviour_mod
from proxyshift.agent import cilium_api
from proxyshift.agent import conntrack as conntrack_mod
from proxyshift.agent import diagnostics as diagnostics_mod
from proxyshift.agent import flush as flush_mod
from proxyshift.agent import hold as hold_mod
from proxyshift.agent import inventory as inventory_mod
from proxyshift.agent import preflight as preflight_mod
from proxyshift.agent import probe as probe_mod
from proxyshift.agent.iptables_save import Dump
from proxyshift.agent.preflight import PreflightReport
from proxyshift.api.behaviour import BehaviourMatrix, BehaviourParams, ConntrackParams, ConntrackReport
from proxyshift.api.diagnostics import DiagnoseRequest, NodeDiagnostics
from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.api.replacement import ReplacementFacts, ReplacementParams
from proxyshift.commands import CommandError, run

# A /healthz poll answers from the node's loopback in a millisecond; one that hangs must not stretch a
# Probe's bounded wait by the full probe's 3 s.
HEALTH_POLL_TIMEOUT = 1.0


class NodeEffects(Protocol):
    """The node as the agent loop sees it."""

    def probe(self) -> KubeProxyFacts:
        """kube-proxy's own answers (/proxyMode, /metrics, /healthz); a failure is a fact with an error."""
        ...

    def health(self) -> probe_mod.KubeProxyHealth:
        """kube-proxy's /healthz alone, its proxiers' last sync times: the cheap look a waiting Probe polls
        between full probes. A failure is an answer with an error."""
        ...

    def inventory(self, fresh: Mapping[str, Dump] | None = None) -> inventory_mod.Inventory:
        """kube-proxy's objects of every mode on the node. `fresh`: per iptables tool label, a save read from the
        kernel after the agent's last change there (a Cleanup's verifying save, FlushReport.after), used instead
        of saving that tool again."""
        ...

    def cleanup(self, remove: list[str], target: str | None) -> tuple[flush_mod.FlushReport, hold_mod.HoldReport]:
        """Remove the stale objects of `remove`, never those of `target`, and the rule hold with them (a Cleanup
        never leaves one): one round for both."""
        ...

    def preflight(self, mode: str, scheduler: str | None = None, *, load_modules: bool = False,
                  extra_modules: Sequence[str] = (), allow_changes: Sequence[str] = (),
                  ipvs_exclude_cidrs: Sequence[str] | None = None) -> PreflightReport:
        """Whether the kernel and tools can run `mode`; also the node's kernel release, modules and tools."""
        ...

    def connect(self, targets: list[str]) -> dict[str, bool | str]:
        """A TCP connect to each ip:port: True, or why not."""
        ...

    def replacement(self, params: ReplacementParams, *, with_services: bool) -> ReplacementFacts:
        """The node's kube-proxy replacement from its own API (Cilium's socket): its health and (with_services,
        once that is Ok and replacing kube-proxy) its host endpoint and how much of the asked Service table it
        holds. An absent agent is a fact with an error."""
        ...

    def install_hold(self, from_mode: str) -> hold_mod.HoldReport:
        """Copy `from_mode`'s service rules under names kube-proxy's startup cleanup does not know."""
        ...

    def release_hold(self) -> hold_mod.HoldReport:
        """Remove the copy (idempotent)."""
        ...

    def hold_present(self) -> bool:
        """Whether a copy is on the node (one left by an earlier agent, after a restart)."""
        ...

    def behaviour(self, params: BehaviourParams, *, mode: str | None, operation_id: str) -> BehaviourMatrix:
        """Dial the Service sample from the node and the pod network."""
        ...

    def conntrack(self, params: ConntrackParams) -> ConntrackReport:
        """Delete un-NATed conntrack entries to Service destinations left from the switch's gap."""
        ...

    def diagnose(self, request: DiagnoseRequest, mode: str | None) -> NodeDiagnostics:
        """Read the kernel's counters for the Services of a spec.diagnose request now (read-only)."""
        ...


@dataclass(frozen=True)
class KernelNodeEffects:
    """The real node: its kube-proxy's ports, /proc, /sys, its modules and its tools."""

    metrics_address: str = probe_mod.DEFAULT_METRICS_ADDRESS
    health_address: str = probe_mod.DEFAULT_HEALTH_ADDRESS
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    modules_root: Path = Path("/lib/modules")
    # The agent's own tools' versions, asked once for its life (preflight.VersionCache says why only those).
    versions: preflight_mod.VersionCache = field(default_factory=preflight_mod.VersionCache, compare=False,
                                                 repr=False)

    def probe(self) -> KubeProxyFacts:
        return probe_mod.facts_from_probe(probe_mod.probe(self.metrics_address, self.health_address))

    def health(self) -> probe_mod.KubeProxyHealth:
        return probe_mod.read_health(self.health_address, timeout=HEALTH_POLL_TIMEOUT)

    def inventory(self, fresh: Mapping[str, Dump] | None = None) -> inventory_mod.Inventory:
        return inventory_mod.take_inventory(proc_root=self.proc_root, fresh=fresh)

    def cleanup(self, remove: list[str], target: str | None) -> tuple[flush_mod.FlushReport, hold_mod.HoldReport]:
        return hold_mod.release_with_flush(remove, target, proc_root=self.proc_root)

    def preflight(self, mode: str, scheduler: str | None = None, *, load_modules: bool = False,
                  extra_modules: Sequence[str] = (), allow_changes: Sequence[str] = (),
                  ipvs_exclude_cidrs: Sequence[str] | None = None) -> PreflightReport:
        return preflight_mod.check(mode, scheduler, proc_root=self.proc_root, sys_root=self.sys_root,
                                   modules_root=self.modules_root, load_modules=load_modules,
                                   extra_modules=extra_modules, allow_changes=allow_changes,
                                   ipvs_exclude_cidrs=ipvs_exclude_cidrs, versions=self.versions)

    def connect(self, targets: list[str]) -> dict[str, bool | str]:
        return probe_mod.tcp_connect(targets)

    def replacement(self, params: ReplacementParams, *, with_services: bool) -> ReplacementFacts:
        return cilium_api.read_replacement(cilium_api.CiliumAPI(params.socket_path), params.frontends,
                                           with_services=with_services)

    def install_hold(self, from_mode: str) -> hold_mod.HoldReport:
        return hold_mod.install(from_mode)

    def release_hold(self) -> hold_mod.HoldReport:
        return hold_mod.release()

    def hold_present(self) -> bool:
        return hold_mod.present()

    def behaviour(self, params: BehaviourParams, *, mode: str | None, operation_id: str) -> BehaviourMatrix:
        return behaviour_mod.run_behaviour(params, mode=mode, operation_id=operation_id)

    def conntrack(self, params: ConntrackParams) -> ConntrackReport:
        try:
            local = [a for a, _ in behaviour_mod.parse_ip_addr(
                run(["ip", "-j", "-4", "addr", "show"], timeout=2.0).stdout)]
        except (CommandError, ValueError) as exc:
            return ConntrackReport(error=f"the node's addresses could not be read: {exc}"[:300])
        return conntrack_mod.clean_unnated(params, local)

    def diagnose(self, request: DiagnoseRequest, mode: str | None) -> NodeDiagnostics:
        return diagnostics_mod.serve(request, mode)
