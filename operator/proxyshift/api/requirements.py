"""What each kube-proxy mode needs from a node: one list, read by the agent's preflight and by `proxyshift plan`."""

from __future__ import annotations

NFTABLES_MIN_KERNEL = (5, 13)
NFTABLES_MIN_NFT = (1, 0, 1)
IPVS_MIN_IPSET = (6, 0)
