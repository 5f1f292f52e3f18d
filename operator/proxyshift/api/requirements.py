"""What each kube-proxy mode needs from a node, and what switching between modes does to it: one place,
read by the agent (preflight, rule hold), the state machine and `proxyshift plan`."""

from __future__ import annotations

NFTABLES_MIN_KERNEL = (5, 13)
NFTABLES_MIN_NFT = (1, 0, 1)
IPVS_MIN_IPSET = (6, 0)


def startup_cleanup_drops_old_rules(from_mode: str | None, to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes `from_mode`'s rules before its first sync in a way a
    rule hold can bridge: iptables <-> nftables (platformCleanup in cmd/kube-proxy/app/server_linux.go; ipvs
    keeps its virtual servers outside any rule, and iptables <-> ipvs cleans nothing up at start)."""
    return {from_mode, to_mode} == {"iptables", "nftables"}


# The change a policy names in gate.behaviour.allowChanges to move a node holding foreign IPVS virtual servers.
FOREIGN_IPVS_CHANGE = "ForeignIPVSFlush"
NFTABLES_DELETES_IPVS = ("every start of an nftables kube-proxy deletes them (kube-proxy 1.37 platformCleanup runs "
                         "the ipvs cleanup, which flushes every IPVS virtual server on the host)")


def deletes_foreign_ipvs(to_mode: str | None) -> bool:
    """Whether a kube-proxy starting in `to_mode` deletes IPVS virtual servers that are not its own: nftables, at
    every start, whatever ran before (cmd/kube-proxy/app/server_linux.go platformCleanup -> ipvs cleanup ->
    ipvs.Flush()). iptables and ipvs mode leave them alone."""
    return to_mode == "nftables"
