"""nftables mode's pure facts (pkg/proxy/nftables)."""

from __future__ import annotations

from proxyshift.modes.base import ModeFacts, ToolNeed

NFTABLES_MIN_KERNEL = (5, 13)
NFTABLES_MIN_NFT = (1, 0, 1)

FACTS = ModeFacts(
    mode="nftables",
    tools=(ToolNeed("nft", NFTABLES_MIN_NFT),),
    min_kernel=NFTABLES_MIN_KERNEL,
    startup_cleans_rules_of=frozenset({"iptables"}),
    # platformCleanup -> ipvs cleanup -> ipvs.Flush(), at every start (cmd/kube-proxy/app/server_linux.go).
    deletes_foreign_ipvs=True,
)
