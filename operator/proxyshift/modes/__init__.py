"""What each kube-proxy mode needs from a node and what switching between modes does: pure facts, one module per
mode (iptables.py, ipvs.py, nftables.py), each exporting a `ModeFacts`; `MODE_FACTS` is the registry keyed by Mode.

The planner (`proxyshift plan`'s preview, the state machine) and the agent (preflight, rule hold) both read this
package, so the prediction and the node's own check evaluate the same requirements table. No I/O here: the agent's
probes, flushers and holds stay in proxyshift.agent.
"""

from __future__ import annotations

from proxyshift.api.proxynode import MODES, Mode, is_mode
from proxyshift.modes.base import (
    FOREIGN_IPVS_CHANGE,
    NFTABLES_DELETES_IPVS,
    ModeFacts,
    ModuleNeed,
    ToolNeed,
    version_text,
)
from proxyshift.modes.iptables import FACTS as IPTABLES
from proxyshift.modes.ipvs import DEFAULT_IPVS_SCHEDULER, IPVS_MIN_IPSET, IPVS_SCHEDULERS
from proxyshift.modes.ipvs import FACTS as IPVS
from proxyshift.modes.nftables import FACTS as NFTABLES
from proxyshift.modes.nftables import NFTABLES_MIN_KERNEL, NFTABLES_MIN_NFT

__all__ = [
    "DEFAULT_IPVS_SCHEDULER",
    "FOREIGN_IPVS_CHANGE",
    "IPVS_MIN_IPSET",
    "IPVS_SCHEDULERS",
    "MODES",
    "MODE_FACTS",
    "NFTABLES_DELETES_IPVS",
    "NFTABLES_MIN_KERNEL",
    "NFTABLES_MIN_NFT",
    "Mode",
    "ModeFacts",
    "ModuleNeed",
    "ToolNeed",
    "deletes_foreign_ipvs",
    "facts",
    "is_mode",
    "startup_cleanup_drops_old_rules",
    "version_text",
]

MODE_FACTS: dict[Mode, ModeFacts] = {f.mode: f for f in (IPTABLES, IPVS, NFTABLES)}
assert tuple(sorted(MODE_FACTS)) == tuple(sorted(MODES)), "every Mode has exactly one ModeFacts"


def facts(mode: Mode) -> ModeFacts:
    return MODE_FACTS[mode]


def startup_cleanup_drops_old_rules(from_mode: str | None, to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes `from_mode`'s rules before its first sync in a way a
    rule hold can bridge: iptables <-> nftables (platformCleanup in cmd/kube-proxy/app/server_linux.go; ipvs
    keeps its virtual servers outside any rule, and iptables <-> ipvs cleans nothing up at start)."""
    if not is_mode(from_mode) or not is_mode(to_mode) or from_mode == to_mode:
        return False
    return from_mode in MODE_FACTS[to_mode].startup_cleans_rules_of


def deletes_foreign_ipvs(to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes IPVS virtual servers that are not its own: nftables, at
    every start, whatever ran before (cmd/kube-proxy/app/server_linux.go platformCleanup -> ipvs cleanup ->
    ipvs.Flush()). iptables and ipvs mode leave them alone."""
    return is_mode(to_mode) and MODE_FACTS[to_mode].deletes_foreign_ipvs
