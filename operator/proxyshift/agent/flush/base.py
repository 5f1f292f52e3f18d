"""The one interface every mode's flusher implements, and what a flush reports.

Like kubernetes' pkg/proxy, each mode has its own module (iptables.py,
nftables.py, ipvs.py); `proxyshift.agent.flush.flush` runs them in the only
safe order (iptables rules first, so no rule still references an ipset that
the ipvs flusher destroys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxyshift.agent.iptables_save import Dump
from proxyshift.agent.ownership import Mode
from proxyshift.commands import Result

# commands.run, or the same with netns= bound (tests, bench), or a fake (unit tests).
Runner = Callable[..., Result]

# What iptables, nft, ipset and ipvsadm print when the kernel refuses a process without CAP_NET_ADMIN.
REFUSED_MARKERS = ("Permission denied", "Operation not permitted")
MISSING_CAPABILITY_HINT = ("the kernel refused the agent: its container needs CAP_NET_ADMIN and CAP_NET_RAW "
                           "(config/agent/daemonset.yaml grants them; a policy or webhook may have dropped them)")


@dataclass
class FlushStep:
    """What one tool did: counts removed, things skipped (with why), errors."""

    tool: str
    removed: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, n: int) -> None:
        if n:
            self.removed[kind] = self.removed.get(kind, 0) + n

    def describe(self) -> str:
        parts = [f"{n} {kind}" for kind, n in sorted(self.removed.items())]
        # "nothing to remove" only when the tool could look: after an error it is not known.
        text = f"{self.tool}: " + (", ".join(parts) + " removed" if parts else
                                   "nothing removed" if self.errors else "nothing to remove")
        if self.skipped:
            text += "; " + "; ".join(self.skipped)
        if self.errors:
            text += "; ERROR: " + "; ".join(self.errors)
        return text


@dataclass
class FlushReport:
    remove_modes: list[Mode]
    target_mode: Mode | None
    steps: list[FlushStep] = field(default_factory=list)
    # Per iptables tool label, its save read right after the flush's restore (the verification): the kernel
    # as the flush left it, which the inventory after a Cleanup reads instead of saving again. Not reported.
    after: dict[str, Dump] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not any(s.errors for s in self.steps)

    def total_removed(self) -> int:
        return sum(sum(s.removed.values()) for s in self.steps)

    def message(self) -> str:
        head = f"flush of {', '.join(self.remove_modes) or 'nothing'}"
        if self.target_mode:
            head += f" (target {self.target_mode})"
        text = head + ": " + " | ".join(s.describe() for s in self.steps)
        if any(marker in error for s in self.steps for error in s.errors for marker in REFUSED_MARKERS):
            text = f"{MISSING_CAPABILITY_HINT}; {text}"
        return text

    def details(self) -> dict[str, Any]:
        return {
            "removeModes": list(self.remove_modes),
            "targetMode": self.target_mode,
            "steps": [
                {"tool": s.tool, "removed": dict(s.removed), "skipped": list(s.skipped), "errors": list(s.errors)}
                for s in self.steps
            ],
        }


class Flusher(Protocol):
    """Removes one tool's stale kube-proxy objects. Must be idempotent."""

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]: ...
