"""The compatibility report, pure: what a mode move changes for this cluster's Services.

Each mode's side of these rules is its facts (proxyshift.modes: nodePortAddresses default, localhost
NodePorts and the words for losing them, NodePort filter rules, INVALID drops, IPVS scheduling); this module
compares two modes' facts and never a mode's name.

Rules from KEP-3866 ("Changes from the iptables kube-proxy backend"), kube-proxy's "Migrating from
iptables mode to nftables" page, the ipvs docs, and kube-proxy 1.37.2's own source:

- localhost NodePorts: iptables mode serves them (route_localnet) unless iptables.localhostNodePorts
  is false; ipvs mode never; nftables mode only for TCP, with the alpha feature gate
  KubeProxyNFTablesLocalhostNodePorts and nodePortAddresses naming loopback.
- nodePortAddresses unset: every local address in iptables and ipvs mode, the primary node IPs in
  nftables mode (kube-proxy 1.37 defaults it per mode).
- iptables and ipvs mode add filter rules accepting NodePort traffic; nftables mode opens nothing.
- iptables and ipvs mode drop conntrack INVALID packets (a workaround for a kernel bug that resets
  long-lived connections); nftables mode does not, conntrack.tcpBeLiberal gives the same protection.
- every start of an nftables kube-proxy runs the ipvs cleanup, which flushes every IPVS virtual
  server on the host (pkg/proxy/ipvs/cleanup.go), a user's too.
- ipvs balances with its scheduler and implements ClientIP affinity as IPVS persistence; iptables
  and nftables mode choose at random and keep their own per-client affinity timer. ipvs binds
  Service and LoadBalancer addresses on kube-ipvs0, so MetalLB's L2 mode needs strictARP.
- Cilium's kube-proxy replacement (modes/cilium_kpr.py) balances a host-network client at connect()
  (socket-LB) instead of NATing each packet; serves NodePorts on its devices' addresses (nodeport-addresses
  when set) and on 127.0.0.1 for TCP and UDP; handles NodePorts before netfilter; and keeps ClientIP
  affinity per client network namespace.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from proxyshift.api.behaviour import ChangeName
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.modes import (
    DEFAULT_IPVS_SCHEDULER,
    deletes_foreign_ipvs,
    facts_of,
    node_port_default,
    prunes_unexcluded_ipvs,
)
from proxyshift.planner.services import EndpointView, ServiceView, endpoints_by_service

MAX_FINDING_SERVICES = 10

_SCHEDULERS = {
    "rr": "round robin", "wrr": "weighted round robin", "lc": "least connections", "wlc": "weighted least connections",
    "lblc": "locality-based least connections", "lblcr": "locality-based least connections with replication",
    "dh": "destination hashing", "sh": "source hashing", "sed": "shortest expected delay", "nq": "never queue",
    "mh": "Maglev hashing",
}


@dataclass(frozen=True)
class CompatFinding:
    """One behaviour the target mode changes, and for which of this cluster's Services."""

    change: ChangeName
    summary: str  # what changes, for a person
    services: tuple[str, ...]  # namespace/name of affected Services, sorted, at most MAX_FINDING_SERVICES
    service_count: int  # how many Services in all
    preserving: str | None  # the kube-proxy setting that keeps today's behaviour; None: there is none
    preserved: bool = False  # the target configuration already keeps today's behaviour


def _finding(change: ChangeName, summary: str, affected: Iterable[ServiceView], preserving: str | None,
             preserved: bool = False) -> CompatFinding:
    keys = sorted({s.key for s in affected})
    return CompatFinding(change, summary, tuple(keys[:MAX_FINDING_SERVICES]), len(keys), preserving, preserved)


def _addresses(config: KubeProxyConfiguration | None) -> list[str]:
    """nodePortAddresses as IPv4 sees it: kube-proxy filters the list per family, and a family left
    with no entry gets its zero CIDR (pkg/proxy/util NewNodePortAddresses). Empty: unset."""
    listed = list((config.node_port_addresses if config else None) or [])
    ipv4 = [a for a in listed if a in ("primary", "localhost", "all") or ":" not in a]
    return ipv4 or (["0.0.0.0/0"] if listed else [])


def _covers_everything(mode: str, config: KubeProxyConfiguration | None) -> bool:
    """Does nodePortAddresses (as kube-proxy 1.37 defaults it) let NodePorts answer on every local address?"""
    addresses = _addresses(config)
    if not addresses:
        return node_port_default(mode) == "all"
    for entry in addresses:
        if entry == "all":
            return True
        try:
            if ipaddress.ip_network(entry, strict=False).prefixlen == 0:
                return True
        except ValueError:
            continue
    return False


def _effective_addresses(mode: str, config: KubeProxyConfiguration | None) -> list[str]:
    return _addresses(config) or [node_port_default(mode)]


def localhost_protocols(mode: str, config: KubeProxyConfiguration | None) -> set[str]:
    """The protocols whose NodePorts answer on 127.0.0.1 in this mode and configuration."""
    facts = facts_of(mode)
    return facts.localhost_protocols(config, _addresses(config)) if facts is not None else set()


def _drops_invalid(mode: str, config: KubeProxyConfiguration | None) -> bool:
    facts = facts_of(mode)
    # iptables and ipvs mode skip their INVALID drop when conntrack is liberal already.
    return facts is not None and facts.drops_invalid and not _tcp_be_liberal(config)


def _opens_node_ports(mode: str) -> bool:
    facts = facts_of(mode)
    return facts is not None and facts.opens_node_ports


def _ipvs_scheduled(mode: str) -> bool:
    facts = facts_of(mode)
    return facts is not None and facts.ipvs_scheduler


def _binds_service_addresses(mode: str) -> bool:
    """It binds Service and LoadBalancer addresses on a dummy interface of its own (ipvs mode's kube-ipvs0)."""
    facts = facts_of(mode)
    return facts is not None and facts.owned.interface is not None


def _socket_lb(mode: str) -> bool:
    facts = facts_of(mode)
    return facts is not None and facts.socket_lb


_AFFINITY_WORDS = {
    "client-timer": "a per-client timer in iptables and nftables mode",
    "ipvs-persistence": "IPVS persistence in ipvs mode (per Service port, renewed by every connection)",
    "netns-cookie": "Cilium's affinity map with its kube-proxy replacement (keyed by the client's network "
                    "namespace, not its address, for connections its socket-LB balances; 3 hours by default)",
}


def _affinity_summary(from_mode: str, to_mode: str) -> str | None:
    """What changes for ClientIP affinity between the two modes' ways of keeping it (None: nothing)."""
    before, after = facts_of(from_mode), facts_of(to_mode)
    if before is None or after is None or before.session_affinity == after.session_affinity:
        return None
    kinds = {before.session_affinity, after.session_affinity}
    if kinds == {"client-timer", "ipvs-persistence"}:
        return ("ClientIP affinity is IPVS persistence in ipvs mode (per Service port, renewed by every connection) "
                "and a per-client timer in iptables and nftables mode: clients may reach another endpoint after "
                "the switch and the timeout counts differently")
    return (f"ClientIP affinity is {_AFFINITY_WORDS[before.session_affinity]} today and "
            f"{_AFFINITY_WORDS[after.session_affinity]} after the switch: clients may reach another endpoint, "
            "and clients that share an address no longer share their endpoint")


def _mode_words(mode: str) -> str:
    facts = facts_of(mode)
    if facts is not None and facts.replacement is not None:
        return f"{facts.replacement.agent}'s kube-proxy replacement"
    return f"{mode} mode"


def _localhost_opt_in(mode: str) -> str | None:
    facts = facts_of(mode)
    return facts.localhost_opt_in if facts is not None else None


def _tcp_be_liberal(config: KubeProxyConfiguration | None) -> bool:
    return bool(config and config.conntrack and config.conntrack.tcp_be_liberal)


def compatibility(
    from_mode: str,
    from_config: KubeProxyConfiguration | None,
    to_mode: str,
    to_config: KubeProxyConfiguration | None,
    services: Iterable[ServiceView],
    endpoints: Iterable[EndpointView],
) -> list[CompatFinding]:
    """Every behaviour a move from (from_mode, from_config) to (to_mode, to_config) changes.

    A configuration of None means kube-proxy's defaults. A finding the target configuration already
    neutralises is kept with preserved=True, so the report shows the user that it is handled.
    """
    dialable = [s for s in services if not s.headless and s.type != "ExternalName" and s.cluster_ips]
    node_port = [s for s in dialable if s.node_ports]
    ready = {k: sum(1 for e in v if e.ready) for k, v in endpoints_by_service(endpoints).items()}
    findings: list[CompatFinding] = []

    served_before, served_after = localhost_protocols(from_mode, from_config), localhost_protocols(to_mode, to_config)
    lost = served_before - served_after
    affected = [s for s in node_port if any(p.protocol in lost for p in s.node_ports)]
    if lost and not affected and served_after:
        # What is lost (UDP) no NodePort here uses; what they use is kept.
        findings.append(_finding("LocalhostNodePorts", "NodePorts on 127.0.0.1 keep answering (TCP)", node_port,
                                 _localhost_opt_in(to_mode), preserved=True))
    elif lost:
        to_facts = facts_of(to_mode)
        if to_facts is not None and to_facts.localhost_loss is not None:
            summary, preserving = to_facts.localhost_loss(frozenset(lost))
        else:
            preserving = None
            summary = f"{_mode_words(to_mode)} serves no NodePorts on 127.0.0.1 ({_mode_words(from_mode)} does)"
        findings.append(_finding("LocalhostNodePorts", summary, affected, preserving))
    elif served_before and from_mode != to_mode and (opt_in := _localhost_opt_in(to_mode)) is not None:
        # Today's localhost NodePorts are kept, by a setting the target mode needs for them.
        findings.append(_finding("LocalhostNodePorts", "NodePorts on 127.0.0.1 keep answering (TCP)", node_port,
                                 opt_in, preserved=True))

    wide_before, wide_after = _covers_everything(from_mode, from_config), _covers_everything(to_mode, to_config)
    before_list, after_list = _effective_addresses(from_mode, from_config), _effective_addresses(to_mode, to_config)
    if wide_before and not wide_after:
        to_facts = facts_of(to_mode)
        if not _addresses(to_config) and to_facts is not None and to_facts.node_port_words is not None:
            summary = (f"{_mode_words(to_mode)} serves NodePorts only on {to_facts.node_port_words} when "
                       f"nodePortAddresses is unset ({_mode_words(from_mode)}: on every local address, a second "
                       "NIC or a VIP too)")
        elif not _addresses(to_config) and node_port_default(to_mode) == "primary":
            summary = (f"{to_mode} mode serves NodePorts only on the node's primary IPs when nodePortAddresses is "
                       f"unset ({from_mode} mode: on every local address, a second NIC or a VIP too)")
        else:
            summary = f"nodePortAddresses {after_list} serves NodePorts only there (today: on every local address)"
        findings.append(_finding("NodePortAddresses", summary, node_port, "nodePortAddresses: [0.0.0.0/0] (or [all])"))
    elif not wide_before and not wide_after and before_list != after_list:
        findings.append(_finding(
            "NodePortAddresses", f"NodePorts move from nodePortAddresses {before_list} to {after_list}", node_port,
            f"nodePortAddresses: {before_list}"))
    elif wide_before and node_port_default(from_mode) == "all" and node_port_default(to_mode) == "primary":
        findings.append(_finding("NodePortAddresses", "NodePorts keep answering on every local address", node_port,
                                 "nodePortAddresses", preserved=True))

    if _opens_node_ports(from_mode) and facts_of(to_mode) is not None and not _opens_node_ports(to_mode):
        findings.append(_finding(
            "NodePortFirewall",
            f"{from_mode} mode adds filter rules that accept NodePort traffic; {to_mode} mode opens nothing, so a "
            "host firewall that drops by default now drops NodePort traffic (open the NodePort range, 30000-32767 by "
            "default, in it)",
            node_port, None))
        if _drops_invalid(from_mode, from_config):
            findings.append(_finding(
                "ConntrackInvalid",
                f"{from_mode} mode drops conntrack INVALID packets (a workaround for resets of long-lived "
                f"connections on kernels before 6.1); {to_mode} mode does not",
                [s for s in dialable if any(p.protocol == "TCP" for p in s.ports)],
                "conntrack.tcpBeLiberal: true", preserved=_tcp_be_liberal(to_config)))

    if deletes_foreign_ipvs(to_mode) and not deletes_foreign_ipvs(from_mode):
        findings.append(_finding(
            "ForeignIPVSFlush",
            "every start of an nftables kube-proxy flushes every IPVS virtual server on the node, ones that are "
            "not kube-proxy's too (its ipvs cleanup has no exclusions): keep your own virtual servers off these "
            "nodes, or recreate them after the switch",
            [], None))

    if prunes_unexcluded_ipvs(to_mode) and not prunes_unexcluded_ipvs(from_mode):
        findings.append(_finding(
            "ForeignIPVSFlush",
            "an ipvs kube-proxy deletes, at every sync, each IPVS virtual server of its IP family that it did not "
            "create (a keepalived's, a hand-made LVS) unless its address is in ipvs.excludeCIDRs: list your own "
            "virtual servers' addresses there",
            [], "ipvs.excludeCIDRs"))

    if (affinity_change := _affinity_summary(from_mode, to_mode)) is not None:
        affinity = [s for s in dialable if s.session_affinity == "ClientIP"]
        findings.append(_finding("SessionAffinity", affinity_change, affinity, None))
    if _ipvs_scheduled(from_mode) and not _ipvs_scheduled(to_mode):
        scheduler = (from_config.ipvs.scheduler if from_config and from_config.ipvs else None) or DEFAULT_IPVS_SCHEDULER
        hashing = scheduler in ("sh", "dh", "mh")
        findings.append(_finding(
            "IPVSScheduler",
            f"the ipvs scheduler {scheduler} ({_SCHEDULERS.get(scheduler, scheduler)}) is replaced by a random "
            f"choice among ready endpoints in {_mode_words(to_mode)}",
            [s for s in dialable if ready.get(s.key, 0) >= 2],
            "sessionAffinity: ClientIP on the Services that need a client to stay on one endpoint" if hashing
            else None))
    if _binds_service_addresses(to_mode) and not _binds_service_addresses(from_mode):
        strict = bool(to_config and to_config.ipvs and to_config.ipvs.strict_arp)
        findings.append(_finding(
            "StrictARP",
            "ipvs mode binds every Service and LoadBalancer address on the node's kube-ipvs0 interface; without "
            "strictARP the node answers ARP for them (MetalLB's L2 mode needs strictARP)",
            [s for s in dialable if s.type == "LoadBalancer"], "ipvs.strictARP: true", preserved=strict))
    if _socket_lb(from_mode) != _socket_lb(to_mode):
        findings.append(_finding("SocketLoadBalancing", _socket_lb_summary(from_mode, to_mode), dialable, None))
    return findings


def _socket_lb_summary(from_mode: str, to_mode: str) -> str:
    if _socket_lb(to_mode):
        return (f"{_mode_words(to_mode)} balances the node's own clients at connect() (socket-LB) instead of "
                f"NATing each packet as {_mode_words(from_mode)} does: their connections go to the endpoint "
                "directly, conntrack holds no DNAT entry for them and the Service address never appears on the "
                "wire (tcpdump, NetworkPolicy logs and iptables rules matching it see the endpoint); NodePorts are "
                "handled at tc ingress before netfilter, so host firewall rules no longer see them")
    return (f"{_mode_words(to_mode)} NATs each packet where {_mode_words(from_mode)} balanced the node's own "
            "clients at connect(): conntrack holds DNAT entries again, the Service address is on the wire, and "
            "NodePort traffic passes the host firewall's rules again")


CONDITION_MESSAGE_LENGTH = 1024


def compat_summary(to_mode: str, findings: Iterable[CompatFinding], limit: int = CONDITION_MESSAGE_LENGTH) -> str:
    """One bounded line for a policy condition or Event: each change not already kept, the Services it
    affects, and what keeps today's behaviour. Empty when nothing changes."""
    parts = []
    for finding in findings:
        if finding.preserved:
            continue
        services = ""
        if finding.service_count:
            more = finding.service_count - len(finding.services[:3])
            services = f" for {', '.join(finding.services[:3])}" + (f" and {more} more" if more > 0 else "")
        keep = f"keep with {finding.preserving}" if finding.preserving else "no setting keeps it"
        parts.append(f"{finding.change}{services} ({keep})")
    if not parts:
        return ""
    text = f"{_mode_words(to_mode)} changes: " + "; ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."
