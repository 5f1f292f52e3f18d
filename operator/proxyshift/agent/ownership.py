"""Which kernel objects belong to kube-proxy, and to which of its modes.

This is the single place the agent decides "is this kube-proxy's?". Everything
here is an exact name or a kube-proxy-specific prefix, never a bare "KUBE-": a
user's chain called KUBE-MYTHING, kubelet's KUBE-FIREWALL and a user's own
ipset called KUBE-ALLOWED must never be mistaken for kube-proxy's.

Names follow kube-proxy 1.33-1.37 (pkg/proxy/iptables, pkg/proxy/ipvs,
pkg/proxy/nftables); see DESIGN.md "Kernel facts".
"""

from __future__ import annotations

from proxyshift.api.proxynode import MODES, Mode

__all__ = ["MODES", "Mode"]

# kubelet's chains: kubelet recreates them and relies on them; not kube-proxy's to remove.
KUBELET_CHAINS = frozenset({"KUBE-KUBELET-CANARY", "KUBE-FIREWALL"})

# (table, chain) -> modes whose kube-proxy creates it. Chains in both iptables and
# ipvs are the "shared" ones: they survive a flush whose target is the other mode.
_FIXED_CHAINS: dict[tuple[str, str], frozenset[Mode]] = {
    ("nat", "KUBE-SERVICES"): frozenset({"iptables", "ipvs"}),
    ("nat", "KUBE-POSTROUTING"): frozenset({"iptables", "ipvs"}),
    ("nat", "KUBE-MARK-MASQ"): frozenset({"iptables", "ipvs"}),
    ("nat", "KUBE-NODEPORTS"): frozenset({"iptables"}),
    ("nat", "KUBE-PROXY-CANARY"): frozenset({"iptables"}),
    # Created by kube-proxy (and kubelet) before 1.28; only old nodes still carry it.
    ("nat", "KUBE-MARK-DROP"): frozenset({"iptables"}),
    ("nat", "KUBE-NODE-PORT"): frozenset({"ipvs"}),
    ("nat", "KUBE-LOAD-BALANCER"): frozenset({"ipvs"}),
    ("filter", "KUBE-FORWARD"): frozenset({"iptables", "ipvs"}),
    ("filter", "KUBE-PROXY-FIREWALL"): frozenset({"iptables", "ipvs"}),
    ("filter", "KUBE-SERVICES"): frozenset({"iptables"}),
    ("filter", "KUBE-EXTERNAL-SERVICES"): frozenset({"iptables"}),
    ("filter", "KUBE-NODEPORTS"): frozenset({"iptables"}),
    ("filter", "KUBE-PROXY-CANARY"): frozenset({"iptables"}),
    ("filter", "KUBE-NODE-PORT"): frozenset({"ipvs"}),
    ("filter", "KUBE-SOURCE-RANGES-FIREWALL"): frozenset({"ipvs"}),
    ("filter", "KUBE-IPVS-FILTER"): frozenset({"ipvs"}),
    ("filter", "KUBE-IPVS-OUT-FILTER"): frozenset({"ipvs"}),
    ("mangle", "KUBE-PROXY-CANARY"): frozenset({"iptables"}),
}

# Per-service chains of iptables mode: KUBE-<kind>-<16 base32 chars of a hash>.
_SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-")
_HASH_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")

_EMPTY: frozenset[Mode] = frozenset()


def _is_service_chain(chain: str) -> bool:
    for prefix in _SERVICE_CHAIN_PREFIXES:
        if chain.startswith(prefix):
            suffix = chain[len(prefix):]
            # kube-proxy's suffix is exactly 16 base32 characters; requiring that shape
            # keeps a user's KUBE-SVC-mine out of the flush.
            return len(suffix) == 16 and set(suffix) <= _HASH_ALPHABET
    return False


def iptables_chain_modes(table: str, chain: str) -> frozenset[Mode]:
    """Modes whose kube-proxy creates `chain` in `table` (empty: not kube-proxy's)."""
    if chain in KUBELET_CHAINS:
        return _EMPTY
    fixed = _FIXED_CHAINS.get((table, chain))
    if fixed is not None:
        return fixed
    if table == "nat" and _is_service_chain(chain):
        return frozenset({"iptables"})
    return _EMPTY


def chain_is_stale(table: str, chain: str, remove_modes: frozenset[Mode] | set[Mode],
                   target_mode: Mode | None) -> bool:
    """True when the chain belongs to a mode being removed and not to the target mode."""
    modes = iptables_chain_modes(table, chain)
    if not modes & set(remove_modes):
        return False
    return target_mode is None or target_mode not in modes


# nftables mode keeps everything in these two tables.
NFT_TABLES: tuple[tuple[str, str], ...] = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))

# ipvs mode's dummy interface carrying every ClusterIP/external IP.
IPVS_DUMMY_INTERFACE = "kube-ipvs0"

_IPVS_SET_BASES = (
    "LOOP-BACK", "CLUSTER-IP", "EXTERNAL-IP", "EXTERNAL-IP-LOCAL", "LOAD-BALANCER",
    "LOAD-BALANCER-FW", "LOAD-BALANCER-LOCAL", "LOAD-BALANCER-SOURCE-IP", "LOAD-BALANCER-SOURCE-CIDR",
    "NODE-PORT-TCP", "NODE-PORT-LOCAL-TCP", "NODE-PORT-UDP", "NODE-PORT-LOCAL-UDP",
    "NODE-PORT-SCTP-HASH", "NODE-PORT-LOCAL-SCTP-HASH", "NODE-PORT-SCTP", "NODE-PORT-LOCAL-SCTP",
    "HEALTH-CHECK-NODE-PORT", "IPVS-IPS",
)
# IPv4 sets are KUBE-<base>; dual-stack IPv6 sets are KUBE-6-<base>.
IPVS_IPSETS = frozenset({f"KUBE-{b}" for b in _IPVS_SET_BASES} | {f"KUBE-6-{b}" for b in _IPVS_SET_BASES})

# Sets whose members are service addresses kube-proxy bound (ip,proto:port entries).
IPVS_ADDRESS_SETS = frozenset({
    f"KUBE-{p}{b}" for p in ("", "6-")
    for b in ("CLUSTER-IP", "EXTERNAL-IP", "EXTERNAL-IP-LOCAL", "LOAD-BALANCER", "LOAD-BALANCER-LOCAL")
})
# bitmap:port sets of NodePorts, per protocol.
IPVS_NODEPORT_SETS: dict[str, tuple[str, ...]] = {
    "tcp": ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-6-NODE-PORT-TCP",
            "KUBE-6-NODE-PORT-LOCAL-TCP"),
    "udp": ("KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP", "KUBE-6-NODE-PORT-UDP",
            "KUBE-6-NODE-PORT-LOCAL-UDP"),
}


def is_kube_proxy_ipset(name: str) -> bool:
    return name in IPVS_IPSETS
