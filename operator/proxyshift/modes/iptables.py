"""iptables mode's pure facts (pkg/proxy/iptables)."""

from __future__ import annotations

import ipaddress

from proxyshift.api.kubeproxy import KPIPTablesConfiguration, KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicySpec
from proxyshift.modes.base import ModeFacts, Owned, ToolNeed, overlay

# The chains ipvs mode creates too (modes/ipvs.py lists them again): they survive a flush whose target is ipvs.
SHARED_WITH_IPVS = frozenset({
    ("nat", "KUBE-SERVICES"), ("nat", "KUBE-POSTROUTING"), ("nat", "KUBE-MARK-MASQ"),
    ("filter", "KUBE-FORWARD"), ("filter", "KUBE-PROXY-FIREWALL"),
})

OWNED = Owned(
    chains=SHARED_WITH_IPVS | {
        ("nat", "KUBE-NODEPORTS"), ("nat", "KUBE-PROXY-CANARY"),
        # Created by kube-proxy (and kubelet) before 1.28; only old nodes still carry it.
        ("nat", "KUBE-MARK-DROP"),
        ("filter", "KUBE-SERVICES"), ("filter", "KUBE-EXTERNAL-SERVICES"), ("filter", "KUBE-NODEPORTS"),
        ("filter", "KUBE-PROXY-CANARY"),
        ("mangle", "KUBE-PROXY-CANARY"),
    },
    service_chain_prefixes=("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-"),
)


def render_settings(config: KubeProxyConfiguration, spec: ProxyPolicySpec) -> None:
    if spec.iptables is not None:
        config.iptables = config.iptables or KPIPTablesConfiguration()
        overlay(config.iptables, spec.iptables)


def contains_loopback(entry: str) -> bool:
    try:
        return ipaddress.ip_address("127.0.0.1") in ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False  # a keyword, or another family


def localhost_protocols(config: KubeProxyConfiguration | None, addresses: list[str]) -> set[str]:
    """route_localnet serves TCP and UDP NodePorts on 127.0.0.1 unless iptables.localhostNodePorts is false or
    nodePortAddresses leaves loopback out."""
    enabled = not (config and config.iptables and config.iptables.localhost_node_ports is False)
    covered = not addresses or any(a in ("all", "localhost") or contains_loopback(a) for a in addresses)
    return {"TCP", "UDP"} if enabled and covered else set()


def localhost_loss(lost: frozenset[str]) -> tuple[str, str | None]:
    return ("the new revision turns localhost NodePorts off: NodePorts on 127.0.0.1 stop answering",
            "iptables.localhostNodePorts: true (and loopback in nodePortAddresses, if set)")


def localhost_cause(protocol: str, config: KubeProxyConfiguration | None) -> str:
    return ("iptables.localhostNodePorts is off, or nodePortAddresses leaves out loopback, in the new revision "
            "(set iptables.localhostNodePorts: true, or allow the change LocalhostNodePorts)")


FACTS = ModeFacts(
    mode="iptables",
    tools=(ToolNeed("iptables"),),
    owned=OWNED,
    objects=("iptables-chains",),
    # nftables and iptables mode each clean up the other at start (platformCleanup in server_linux.go).
    startup_cleans_rules_of=frozenset({"nftables"}),
    # Its service rules are nat chains, which a hold copies as PSHOLD-* chains.
    held_as="iptables-chains",
    # kube-proxy prepends its jumps to PREROUTING/OUTPUT/POSTROUTING (-I); the hold appends its own (-A).
    hold_yields_to_live_rules=True,
    render_settings=render_settings,
    counters="iptables",
    opens_node_ports=True,
    drops_invalid=True,
    localhost_protocols=localhost_protocols,
    localhost_loss=localhost_loss,
    localhost_cause=localhost_cause,
)
