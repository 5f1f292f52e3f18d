"""nftables mode's pure facts (pkg/proxy/nftables)."""

from __future__ import annotations

from proxyshift.api.kubeproxy import KPNFTablesConfiguration, KubeProxyConfiguration
from proxyshift.api.policy import NFTABLES_LOCALHOST_GATE, ProxyPolicySpec, names_loopback
from proxyshift.modes.base import ModeFacts, Owned, ToolNeed, overlay

NFTABLES_MIN_KERNEL = (5, 13)
NFTABLES_MIN_NFT = (1, 0, 1)

# nftables mode keeps everything in these two tables.
OWNED = Owned(nft_tables=(("ip", "kube-proxy"), ("ip6", "kube-proxy")))


def render_settings(config: KubeProxyConfiguration, spec: ProxyPolicySpec) -> None:
    if spec.nftables is None:
        return
    config.nftables = config.nftables or KPNFTablesConfiguration()
    # localhostNodePorts is not a KubeProxyConfiguration.nftables field: kube-proxy 1.37 reads it
    # as a feature gate, so it goes there and nowhere else.
    overlay(config.nftables, spec.nftables.model_copy(update={"localhost_node_ports": None}))
    if spec.nftables.localhost_node_ports is not None:
        config.feature_gates = {**(config.feature_gates or {}),
                                NFTABLES_LOCALHOST_GATE: spec.nftables.localhost_node_ports}


def localhost_protocols(config: KubeProxyConfiguration | None, addresses: list[str]) -> set[str]:
    """TCP only, and only with the alpha feature gate and loopback named in nodePortAddresses."""
    gates = (config.feature_gates if config else None) or {}
    if gates.get(NFTABLES_LOCALHOST_GATE) and any(names_loopback(a) for a in addresses):
        return {"TCP"}
    return set()


LOCALHOST_OPT_IN = "nftables.localhostNodePorts: true"


def localhost_loss(lost: frozenset[str]) -> tuple[str, str | None]:
    if lost == {"UDP"}:
        # The TCP ones are kept already; nftables has nothing for UDP.
        return ("nftables mode serves localhost NodePorts for TCP only: UDP NodePorts on 127.0.0.1 stop answering",
                None)
    return ("nftables mode serves no NodePorts on 127.0.0.1 (iptables mode does, through route_localnet)",
            "nftables.localhostNodePorts: true with localhost in nodePortAddresses, e.g. [0.0.0.0/0, "
            f"localhost] (TCP only; kube-proxy's alpha feature gate {NFTABLES_LOCALHOST_GATE})")


def localhost_cause(protocol: str, config: KubeProxyConfiguration | None) -> str:
    gates = (config.feature_gates if config else None) or {}
    addresses = (config.node_port_addresses if config else None) or []
    if gates.get(NFTABLES_LOCALHOST_GATE) and any(names_loopback(a) for a in addresses):
        if protocol == "UDP":
            return ("nftables mode serves localhost NodePorts for TCP only (allow the change LocalhostNodePorts, "
                    "or keep this pool on iptables)")
        return ("nftables.localhostNodePorts is on but kube-proxy's localhost proxy does not answer (check "
                "kube-proxy's log; or allow the change LocalhostNodePorts)")
    if protocol == "TCP":
        return ("nftables mode serves no localhost NodePorts (set nftables.localhostNodePorts: true with "
                "localhost in nodePortAddresses, allow the change LocalhostNodePorts, or keep this pool on "
                "iptables)")
    return ("nftables mode serves no UDP NodePorts on localhost (allow the change LocalhostNodePorts, or keep "
            "this pool on iptables)")


FACTS = ModeFacts(
    mode="nftables",
    tools=(ToolNeed("nft", NFTABLES_MIN_NFT),),
    owned=OWNED,
    objects=("nft-tables",),
    min_kernel=NFTABLES_MIN_KERNEL,
    startup_cleans_rules_of=frozenset({"iptables"}),
    # platformCleanup -> ipvs cleanup -> ipvs.Flush(), at every start (cmd/kube-proxy/app/server_linux.go).
    deletes_foreign_ipvs=True,
    # Its service rules are the kube-proxy tables, which a hold copies whole as proxyshift-hold tables.
    held_as="nft-tables",
    # Not hold_yields_to_live_rules: the proxyshift-hold table's base chains hook at the same priorities as
    # kube-proxy's, and the kernel puts a hook registered later before those of equal priority
    # (nf_hook_entries_grow, net/netfilter/core.c): the copy binds every new connection while it exists.
    render_settings=render_settings,
    node_port_default="primary",
    localhost_protocols=localhost_protocols,
    localhost_opt_in=LOCALHOST_OPT_IN,
    localhost_loss=localhost_loss,
    localhost_cause=localhost_cause,
)
