"""Everything proxyshift knows about each kube-proxy mode, one pure module per mode (iptables.py, ipvs.py,
nftables.py), each exporting a `ModeFacts`; `MODE_FACTS` is the registry keyed by Mode.

A mode's facts say what it needs from a node (tools, kernel, modules), which kernel objects its kube-proxy
owns (by name: agent/ownership.py), which kinds of object the agent probes and flushes for it and which kind a
rule hold copies, what its start does to the other modes' objects, how the policy's settings for it render
into the KubeProxyConfiguration, and how it treats Services (nodePortAddresses default, localhost NodePorts,
NodePort filter rules, INVALID drops). The planner (`proxyshift plan`'s preview, the compatibility report, the
behaviour gate), the renderer and the agent (preflight, inventory, flush, hold) all read this table, so a
caller asks a mode's facts instead of comparing its name. No I/O here: the agent's probes, flushers and holds
stay in proxyshift.agent, one per kind of object (ObjectKind).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from proxyshift.api.proxynode import MODES, Mode, is_mode
from proxyshift.modes.base import (
    FOREIGN_IPVS_CHANGE,
    IPVS_PRUNES_UNEXCLUDED,
    NFTABLES_DELETES_IPVS,
    OBJECT_KINDS,
    AffinityKind,
    FeatureNeed,
    KernelFeature,
    ModeFacts,
    ModuleNeed,
    NodePortDefault,
    ObjectKind,
    Owned,
    Replacement,
    ToolNeed,
    overlay,
    version_text,
)
from proxyshift.modes.cilium_kpr import FACTS as CILIUM_KPR
from proxyshift.modes.iptables import FACTS as IPTABLES
from proxyshift.modes.ipvs import (
    DEFAULT_IPVS_SCHEDULER,
    IPVS_ADDRESS_SETS,
    IPVS_DUMMY_INTERFACE,
    IPVS_IPSETS,
    IPVS_MIN_IPSET,
    IPVS_NODEPORT_SETS,
    IPVS_SCHEDULERS,
)
from proxyshift.modes.ipvs import FACTS as IPVS
from proxyshift.modes.nftables import FACTS as NFTABLES
from proxyshift.modes.nftables import NFTABLES_MIN_KERNEL, NFTABLES_MIN_NFT

__all__ = [
    "DEFAULT_IPVS_SCHEDULER",
    "DEFAULT_MODE",
    "FOREIGN_IPVS_CHANGE",
    "IPVS_ADDRESS_SETS",
    "IPVS_DUMMY_INTERFACE",
    "IPVS_IPSETS",
    "IPVS_MIN_IPSET",
    "IPVS_NODEPORT_SETS",
    "IPVS_PRUNES_UNEXCLUDED",
    "IPVS_SCHEDULERS",
    "KUBE_PROXY_MODES",
    "MODES",
    "MODE_FACTS",
    "NFTABLES_DELETES_IPVS",
    "NFTABLES_MIN_KERNEL",
    "NFTABLES_MIN_NFT",
    "OBJECT_KINDS",
    "AffinityKind",
    "FeatureNeed",
    "KernelFeature",
    "Mode",
    "ModeFacts",
    "ModuleNeed",
    "NodePortDefault",
    "ObjectKind",
    "Owned",
    "Replacement",
    "ToolNeed",
    "deletes_foreign_ipvs",
    "described_address",
    "facts",
    "facts_of",
    "hold_yields_to_live_rules",
    "is_mode",
    "kind_is_stale",
    "node_port_default",
    "outside_exclude_cidrs",
    "overlay",
    "prunes_unexcluded_ipvs",
    "replacement_labels",
    "runs_kube_proxy",
    "startup_cleanup_drops_old_rules",
    "version_text",
]

MODE_FACTS: dict[Mode, ModeFacts] = {f.mode: f for f in (IPTABLES, IPVS, NFTABLES, CILIUM_KPR)}
assert tuple(sorted(MODE_FACTS)) == tuple(sorted(MODES)), "every Mode has exactly one ModeFacts"
# The modes a kube-proxy runs (a revision with a kube-proxy DaemonSet); the others replace kube-proxy.
KUBE_PROXY_MODES: tuple[Mode, ...] = tuple(m for m in MODES if MODE_FACTS[m].kube_proxy)
# Every label some mode's replacement puts on its nodes: a node moving to any mode sets its own and removes the
# others', so a node leaving Cilium's KPR for a kube-proxy mode loses Cilium's label.
_REPLACEMENT_LABEL_KEYS: tuple[str, ...] = tuple(sorted({
    f.replacement.node_label[0] for f in MODE_FACTS.values() if f.replacement is not None}))

# kube-proxy's mode on Linux when its configuration names none: the mode every cluster starts in.
DEFAULT_MODE: Mode = IPTABLES.mode


def facts(mode: Mode) -> ModeFacts:
    return MODE_FACTS[mode]


def facts_of(mode: str | None) -> ModeFacts | None:
    """The facts of a mode read off the wire (a node may report one this version does not know): None then."""
    return MODE_FACTS[mode] if is_mode(mode) else None


def runs_kube_proxy(mode: str | None) -> bool:
    """Whether a node in `mode` runs a kube-proxy (a mode this version does not know is taken for one: every
    mode before Cilium's KPR was)."""
    known = facts_of(mode)
    return known is None or known.kube_proxy


def replacement_labels(mode: str | None) -> dict[str, str | None]:
    """The replacement labels a node in `mode` carries, key -> value, and None for each one it must not carry
    (a label patch: None removes). A mode this version does not know keeps no replacement label."""
    known = facts_of(mode)
    wanted = dict([known.replacement.node_label]) if known is not None and known.replacement is not None else {}
    return {key: wanted.get(key) for key in _REPLACEMENT_LABEL_KEYS}


def node_port_default(mode: str | None) -> NodePortDefault:
    """nodePortAddresses when unset, as kube-proxy defaults it in `mode`; a mode this version does not know gets
    the default every mode had before nftables mode: every local address."""
    known = facts_of(mode)
    return known.node_port_default if known is not None else "all"


def kind_is_stale(kind: ObjectKind, remove_modes: Iterable[Mode], target_mode: Mode | None) -> bool:
    """Whether a flush of `remove_modes` for `target_mode` has objects of `kind` to remove: a removed mode has
    such objects and the target mode, which kube-proxy runs now, has none of them."""
    if target_mode is not None and kind in MODE_FACTS[target_mode].objects:
        return False
    return any(kind in MODE_FACTS[m].objects for m in remove_modes if m != target_mode)


def startup_cleanup_drops_old_rules(from_mode: str | None, to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes `from_mode`'s rules before its first sync in a way a
    rule hold can bridge: iptables <-> nftables (platformCleanup in cmd/kube-proxy/app/server_linux.go; ipvs
    keeps its virtual servers outside any rule, and iptables <-> ipvs cleans nothing up at start)."""
    if not is_mode(from_mode) or not is_mode(to_mode) or from_mode == to_mode:
        return False
    return from_mode in MODE_FACTS[to_mode].startup_cleans_rules_of


def hold_yields_to_live_rules(from_mode: str | None) -> bool:
    """Whether a rule hold of `from_mode`'s rules serves only what that mode's live rules no longer match
    (ModeFacts.hold_yields_to_live_rules): only then may it be made before the switch."""
    return is_mode(from_mode) and MODE_FACTS[from_mode].hold_yields_to_live_rules


def deletes_foreign_ipvs(to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes IPVS virtual servers that are not its own: nftables, at
    every start, whatever ran before (cmd/kube-proxy/app/server_linux.go platformCleanup -> ipvs cleanup ->
    ipvs.Flush()). iptables and ipvs mode leave them alone."""
    return is_mode(to_mode) and MODE_FACTS[to_mode].deletes_foreign_ipvs


def prunes_unexcluded_ipvs(to_mode: str | None) -> bool:
    """Whether a kube-proxy running in `to_mode` deletes, at every sync, the IPVS virtual servers of its family that
    it did not create unless their address is in ipvs.excludeCIDRs: ipvs (pkg/proxy/ipvs cleanLegacyService)."""
    return is_mode(to_mode) and MODE_FACTS[to_mode].prunes_unexcluded_ipvs


def outside_exclude_cidrs(address: str | None, exclude_cidrs: Iterable[str]) -> bool:
    """Whether an ipvs kube-proxy would delete a foreign virtual server at `address`: it has an address (a
    firewall-mark service has none and is skipped) and no excludeCIDRs entry contains it. An entry that does not
    parse protects nothing (kube-proxy does not start with it)."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for cidr in exclude_cidrs:
        try:
            if ip in ipaddress.ip_network(cidr, strict=False):
                return False
        except ValueError:
            continue
    return True


def described_address(text: str) -> str | None:
    """The address in a virtual server as ForeignIPVS lists it ("TCP 198.18.5.1:80 rr", "UDP [fd00::1]:53");
    None for a firewall-mark service ("FWM 7 sh") or text that is not in that form."""
    parts = text.split()
    if len(parts) < 2 or parts[0] == "FWM":
        return None
    where = parts[1]
    host = where[1:].partition("]")[0] if where.startswith("[") else where.rpartition(":")[0]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None
