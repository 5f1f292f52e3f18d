"""Which kernel objects belong to kube-proxy, and to which of its modes.

This is the single place the agent decides "is this kube-proxy's?". The names live with each mode
(`proxyshift.modes.<mode>.OWNED`); this module only answers from all of them together, so a chain two modes
create (KUBE-SERVICES in iptables and ipvs mode) is known as shared. Everything is an exact name or a
kube-proxy-specific shape, never a bare "KUBE-": a user's chain called KUBE-MYTHING, kubelet's KUBE-FIREWALL
and a user's own ipset called KUBE-ALLOWED must never be mistaken for kube-proxy's.

Names follow kube-proxy 1.33-1.37 (pkg/proxy/iptables, pkg/proxy/ipvs,
pkg/proxy/nftables); docs/agent.md, "Flush: what is removed, what is never touched".
"""

from __future__ import annotations

from proxyshift.api.proxynode import MODES, Mode
from proxyshift.modes import (
    IPVS_ADDRESS_SETS,
    IPVS_DUMMY_INTERFACE,
    IPVS_IPSETS,
    IPVS_NODEPORT_SETS,
    MODE_FACTS,
)

__all__ = ["IPVS_ADDRESS_SETS", "IPVS_DUMMY_INTERFACE", "IPVS_IPSETS", "IPVS_NODEPORT_SETS", "KUBELET_CHAINS",
           "MODES", "NFT_TABLES", "Mode", "chain_is_stale", "iptables_chain_modes", "is_kube_proxy_ipset"]

# kubelet's chains: kubelet recreates them and relies on them; not kube-proxy's to remove.
KUBELET_CHAINS = frozenset({"KUBE-KUBELET-CANARY", "KUBE-FIREWALL"})


def _fixed_chains() -> dict[tuple[str, str], frozenset[Mode]]:
    owners: dict[tuple[str, str], set[Mode]] = {}
    for mode, facts in MODE_FACTS.items():
        for key in facts.owned.chains:
            owners.setdefault(key, set()).add(mode)
    return {key: frozenset(modes) for key, modes in owners.items()}


# (table, chain) -> modes whose kube-proxy creates it. Chains of more than one mode are the "shared"
# ones: they survive a flush whose target is the other mode.
_FIXED_CHAINS = _fixed_chains()
# Per-service nat chains: prefix -> the modes that create chains KUBE-<kind>-<16 base32 chars of a hash>.
_SERVICE_CHAIN_PREFIXES: dict[str, frozenset[Mode]] = {
    prefix: frozenset(m for m, f in MODE_FACTS.items() if prefix in f.owned.service_chain_prefixes)
    for facts in MODE_FACTS.values() for prefix in facts.owned.service_chain_prefixes
}
_HASH_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")

_EMPTY: frozenset[Mode] = frozenset()


def _service_chain_modes(chain: str) -> frozenset[Mode]:
    for prefix, modes in _SERVICE_CHAIN_PREFIXES.items():
        if chain.startswith(prefix):
            suffix = chain[len(prefix):]
            # kube-proxy's suffix is exactly 16 base32 characters; requiring that shape
            # keeps a user's KUBE-SVC-mine out of the flush.
            return modes if len(suffix) == 16 and set(suffix) <= _HASH_ALPHABET else _EMPTY
    return _EMPTY


def iptables_chain_modes(table: str, chain: str) -> frozenset[Mode]:
    """Modes whose kube-proxy creates `chain` in `table` (empty: not kube-proxy's)."""
    if chain in KUBELET_CHAINS:
        return _EMPTY
    fixed = _FIXED_CHAINS.get((table, chain))
    if fixed is not None:
        return fixed
    if table == "nat":
        return _service_chain_modes(chain)
    return _EMPTY


def chain_is_stale(table: str, chain: str, remove_modes: frozenset[Mode] | set[Mode],
                   target_mode: Mode | None) -> bool:
    """True when the chain belongs to a mode being removed and not to the target mode."""
    modes = iptables_chain_modes(table, chain)
    if not modes & set(remove_modes):
        return False
    return target_mode is None or target_mode not in modes


# Every mode's nft tables, (family, name), in the modes' order.
NFT_TABLES: tuple[tuple[str, str], ...] = tuple(t for f in MODE_FACTS.values() for t in f.owned.nft_tables)
# Every mode's ipsets (today ipvs mode's alone).
_IPSETS = frozenset().union(*(f.owned.ipsets for f in MODE_FACTS.values()))


def is_kube_proxy_ipset(name: str) -> bool:
    return name in _IPSETS
