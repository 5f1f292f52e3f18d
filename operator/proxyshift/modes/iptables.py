"""iptables mode's pure facts (pkg/proxy/iptables)."""

from __future__ import annotations

from proxyshift.modes.base import ModeFacts, ToolNeed

FACTS = ModeFacts(
    mode="iptables",
    tools=(ToolNeed("iptables"),),
    # nftables and iptables mode each clean up the other at start (platformCleanup in server_linux.go).
    startup_cleans_rules_of=frozenset({"nftables"}),
)
