"""The one shape every mode's pure facts take (ModeFacts), and the facts that concern more than one mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from proxyshift.api.proxynode import Mode

# The change a policy names in gate.behaviour.allowChanges to move a node holding foreign IPVS virtual servers.
FOREIGN_IPVS_CHANGE = "ForeignIPVSFlush"
NFTABLES_DELETES_IPVS = ("every start of an nftables kube-proxy deletes them (kube-proxy 1.37 platformCleanup runs "
                         "the ipvs cleanup, which flushes every IPVS virtual server on the host)")

# Keys of ProxyNode.status.tools and attributes of the agent's ToolVersions.
Tool = Literal["iptables", "ipset", "nft"]


@dataclass(frozen=True)
class ToolNeed:
    """A userspace tool the mode's kube-proxy runs, and the oldest version it accepts (None: any)."""

    tool: Tool
    min_version: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModuleNeed:
    """A kernel module the mode needs, and why (the preflight report quotes `why`)."""

    module: str
    why: str
    # The kernel itself loads it when kube-proxy first uses it (see agent/preflight.py's module doc).
    on_demand: bool = False


def _no_modules(scheduler: str | None) -> tuple[ModuleNeed, ...]:
    return ()


@dataclass(frozen=True)
class ModeFacts:
    """What one kube-proxy mode needs from a node and what starting it does to the others' objects."""

    mode: Mode
    tools: tuple[ToolNeed, ...]
    min_kernel: tuple[int, int] | None = None
    # The mode's kernel modules for an IPVS scheduler (only ipvs mode has one).
    modules: Callable[[str | None], tuple[ModuleNeed, ...]] = field(default=_no_modules)
    # Modes whose rules this mode's kube-proxy deletes at start, before its first sync (platformCleanup).
    startup_cleans_rules_of: frozenset[Mode] = frozenset()
    # Its kube-proxy flushes every IPVS virtual server at every start, kube-proxy's or not.
    deletes_foreign_ipvs: bool = False


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
