"""The compatibility report's rules: what each mode move changes, for which Services, and what keeps it."""

from __future__ import annotations

from typing import Any

import pytest
from behaviour_strategies import clusters
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import NFTABLES_LOCALHOST_GATE
from proxyshift.planner.compat import MAX_FINDING_SERVICES, CompatFinding, compatibility, localhost_protocols
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView

pytestmark = pytest.mark.unit

WEB = ServiceView("default", "web", cluster_ips=("198.19.0.10",), ports=(ServicePortView("", "TCP", 80),))
NP = ServiceView("default", "np", type="NodePort", cluster_ips=("198.19.0.20",),
                 ports=(ServicePortView("", "TCP", 80, 30080),))
UDP_NP = ServiceView("default", "syslog", type="NodePort", cluster_ips=("198.19.0.21",),
                     ports=(ServicePortView("", "UDP", 514, 30514),))
STICKY = ServiceView("default", "sticky", cluster_ips=("198.19.0.30",), ports=(ServicePortView("", "TCP", 80),),
                     session_affinity="ClientIP", affinity_timeout_seconds=60)
LB = ServiceView("metallb", "ingress", type="LoadBalancer", cluster_ips=("198.19.0.40",),
                 ports=(ServicePortView("", "TCP", 443, 30443),), load_balancer_ips=("198.18.250.1",))
HEADLESS = ServiceView("default", "db", headless=True, ports=(ServicePortView("", "TCP", 5432),))
SERVICES = [WEB, NP, UDP_NP, STICKY, LB, HEADLESS]
ENDPOINTS = [EndpointView("default/web", "198.18.1.1", True, "ps-node-1"),
             EndpointView("default/web", "198.18.1.2", True, "ps-node-2"),
             EndpointView("default/np", "198.18.1.3", True, "ps-node-1")]


def config(mode: str, **kw: Any) -> KubeProxyConfiguration:
    return KubeProxyConfiguration.model_validate({"mode": mode, **kw})


def by_change(findings: list[CompatFinding]) -> dict[str, CompatFinding]:
    names = [f.change for f in findings]
    assert len(names) == len(set(names)), names
    return {f.change: f for f in findings}


def test_iptables_to_nftables_with_defaults() -> None:
    found = by_change(compatibility("iptables", config("iptables"), "nftables", config("nftables"), SERVICES,
                                    ENDPOINTS))
    assert set(found) == {"LocalhostNodePorts", "NodePortAddresses", "NodePortFirewall", "ConntrackInvalid",
                          "ForeignIPVSFlush"}
    localhost = found["LocalhostNodePorts"]
    assert localhost.services == ("default/np", "default/syslog", "metallb/ingress") and not localhost.preserved
    assert "nftables.localhostNodePorts: true" in (localhost.preserving or "")
    addresses = found["NodePortAddresses"]
    assert "only on the node's primary IPs when nodePortAddresses is unset" in addresses.summary
    assert addresses.preserving == "nodePortAddresses: [0.0.0.0/0] (or [all])"
    assert found["NodePortFirewall"].preserving is None
    assert found["ConntrackInvalid"].preserving == "conntrack.tcpBeLiberal: true"
    assert "default/db" not in found["ConntrackInvalid"].services  # headless: nothing is NATed
    assert found["ForeignIPVSFlush"].service_count == 0


def test_the_policys_settings_preserve_what_they_can() -> None:
    target = config("nftables", nodePortAddresses=["0.0.0.0/0", "localhost"], conntrack={"tcpBeLiberal": True},
                    featureGates={NFTABLES_LOCALHOST_GATE: True})
    found = by_change(compatibility("iptables", config("iptables"), "nftables", target, SERVICES, ENDPOINTS))
    assert found["NodePortAddresses"].preserved
    assert found["ConntrackInvalid"].preserved
    # TCP localhost NodePorts are kept; the UDP one is not, and nothing keeps it in nftables mode.
    localhost = found["LocalhostNodePorts"]
    assert not localhost.preserved and localhost.services == ("default/syslog",) and localhost.preserving is None


def test_tcp_only_cluster_keeps_localhost_node_ports_with_the_gate() -> None:
    target = config("nftables", nodePortAddresses=["primary", "localhost"],
                    featureGates={NFTABLES_LOCALHOST_GATE: True})
    found = by_change(compatibility("iptables", None, "nftables", target, [NP], []))
    assert found["LocalhostNodePorts"].preserved
    # [primary, localhost] narrows NodePorts to the primary IPs: that is a change of its own.
    assert not found["NodePortAddresses"].preserved


def test_iptables_without_localhost_node_ports_loses_nothing_there() -> None:
    source = config("iptables", iptables={"localhostNodePorts": False})
    found = by_change(compatibility("iptables", source, "nftables", None, SERVICES, ENDPOINTS))
    assert "LocalhostNodePorts" not in found
    source = config("iptables", nodePortAddresses=["primary"])
    found = by_change(compatibility("iptables", source, "nftables", None, SERVICES, ENDPOINTS))
    assert "LocalhostNodePorts" not in found and "NodePortAddresses" not in found  # primary both times


def test_liberal_conntrack_before_means_no_invalid_drop_to_lose() -> None:
    source = config("iptables", conntrack={"tcpBeLiberal": True})
    assert "ConntrackInvalid" not in by_change(compatibility("iptables", source, "nftables", None, SERVICES, []))


def test_leaving_ipvs() -> None:
    source = config("ipvs", ipvs={"scheduler": "sh"})
    found = by_change(compatibility("ipvs", source, "iptables", config("iptables"), SERVICES, ENDPOINTS))
    assert set(found) == {"SessionAffinity", "IPVSScheduler"}
    assert found["SessionAffinity"].services == ("default/sticky",)
    assert "sh (source hashing)" in found["IPVSScheduler"].summary
    assert found["IPVSScheduler"].services == ("default/web",)  # the one with two ready endpoints
    assert "sessionAffinity: ClientIP" in (found["IPVSScheduler"].preserving or "")
    rr = by_change(compatibility("ipvs", None, "nftables", None, SERVICES, ENDPOINTS))
    assert rr["IPVSScheduler"].preserving is None and "rr (round robin)" in rr["IPVSScheduler"].summary
    assert {"NodePortFirewall", "ConntrackInvalid", "ForeignIPVSFlush"} <= set(rr)


def test_entering_ipvs() -> None:
    found = by_change(compatibility("iptables", None, "ipvs", config("ipvs"), SERVICES, ENDPOINTS))
    assert set(found) == {"LocalhostNodePorts", "SessionAffinity", "StrictARP", "ForeignIPVSFlush"}
    assert found["StrictARP"].services == ("metallb/ingress",) and not found["StrictARP"].preserved
    assert found["LocalhostNodePorts"].preserving is None
    strict = by_change(compatibility("iptables", None, "ipvs", config("ipvs", ipvs={"strictARP": True}), SERVICES,
                                     ENDPOINTS))
    assert strict["StrictARP"].preserved


def test_a_revision_in_the_same_mode_can_change_things_too() -> None:
    found = by_change(compatibility("iptables", None, "iptables", config("iptables", iptables={
        "localhostNodePorts": False}, nodePortAddresses=["198.18.0.0/16"]), SERVICES, ENDPOINTS))
    assert set(found) == {"LocalhostNodePorts", "NodePortAddresses"}
    assert found["LocalhostNodePorts"].preserving is not None
    assert found["LocalhostNodePorts"].preserving.startswith("iptables.localhostNodePorts: true")
    assert "['198.18.0.0/16']" in found["NodePortAddresses"].summary
    assert compatibility("nftables", None, "nftables", None, SERVICES, ENDPOINTS) == []


def test_localhost_protocols() -> None:
    assert localhost_protocols("iptables", None) == {"TCP", "UDP"}
    assert localhost_protocols("iptables", config("iptables", nodePortAddresses=["198.18.0.0/16"])) == set()
    assert localhost_protocols("iptables", config("iptables", nodePortAddresses=["127.0.0.0/8"])) == {"TCP", "UDP"}
    assert localhost_protocols("iptables", config("iptables", nodePortAddresses=["0.0.0.0/0"])) == {"TCP", "UDP"}
    assert localhost_protocols("iptables", config("iptables", nodePortAddresses=["0.0.0.0/8"])) == set()
    # An IPv6-only list leaves IPv4 with kube-proxy's zero CIDR: every IPv4 address.
    assert localhost_protocols("iptables", config("iptables", nodePortAddresses=["fd00::/8"])) == {"TCP", "UDP"}
    assert localhost_protocols("ipvs", None) == set()
    assert localhost_protocols("nftables", None) == set()
    assert localhost_protocols("nftables", config("nftables", featureGates={NFTABLES_LOCALHOST_GATE: True})) == set()
    assert localhost_protocols("nftables", config("nftables", featureGates={NFTABLES_LOCALHOST_GATE: True},
                                                  nodePortAddresses=["localhost"])) == {"TCP"}


MODES = st.sampled_from(["iptables", "ipvs", "nftables", "cilium-kpr"])


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(max_services=60), source=MODES, target=MODES)
def test_report_properties(cluster: tuple[list[ServiceView], list[EndpointView]], source: str, target: str) -> None:
    services, endpoints = cluster
    findings = compatibility(source, None, target, None, services, endpoints)
    by_change(findings)  # one finding per change
    keys = {s.key for s in services}
    headless = {s.key for s in services if s.headless}
    for finding in findings:
        assert len(finding.services) <= MAX_FINDING_SERVICES and finding.service_count >= len(finding.services)
        assert set(finding.services) <= keys and not set(finding.services) & headless
        assert list(finding.services) == sorted(finding.services)
    if source == target:
        assert findings == []
    # The socket-LB difference is reported for every move into or out of Cilium's KPR, and only then, for
    # every Service a client can dial.
    socket_lb = [f for f in findings if f.change == "SocketLoadBalancing"]
    assert bool(socket_lb) == ((source == "cilium-kpr") != (target == "cilium-kpr"))
    dialable = {s.key for s in services if not s.headless and s.type != "ExternalName" and s.cluster_ips}
    assert all(f.service_count == len(dialable) and f.preserving is None for f in socket_lb)
    # Cilium's KPR and the kube-proxy modes keep ClientIP affinity differently: a move between them always says so.
    if (source == "cilium-kpr") != (target == "cilium-kpr"):
        assert "SessionAffinity" in {f.change for f in findings}


def test_compat_summary_for_a_condition() -> None:
    from proxyshift.planner.compat import compat_summary

    findings = compatibility("iptables", None, "nftables", config("nftables", conntrack={"tcpBeLiberal": True}),
                             SERVICES, ENDPOINTS)
    text = compat_summary("nftables", findings)
    assert text.startswith("nftables mode changes: LocalhostNodePorts for default/np, default/syslog, "
                           "metallb/ingress (keep with nftables.localhostNodePorts: true")
    more = [ServiceView("default", f"np{i}", type="NodePort", cluster_ips=(f"198.19.1.{i}",),
                        ports=(ServicePortView("", "TCP", 80, 30100 + i),)) for i in range(5)]
    assert "LocalhostNodePorts for default/np0, default/np1, default/np2 and 2 more (" in compat_summary(
        "nftables", compatibility("iptables", None, "nftables", None, more, []))
    assert "ConntrackInvalid" not in text  # kept by the target config
    assert "ForeignIPVSFlush (no setting keeps it)" in text
    assert len(compat_summary("nftables", findings, limit=80)) == 80
    assert compat_summary("nftables", []) == ""


# Cilium's kube-proxy replacement (issue 19): a move to it and back, as the report tells it.

def test_iptables_to_cilium_kpr_with_defaults() -> None:
    found = by_change(compatibility("iptables", None, "cilium-kpr", config("cilium-kpr"), SERVICES, ENDPOINTS))
    assert set(found) == {"NodePortAddresses", "SessionAffinity", "SocketLoadBalancing"}
    socket_lb = found["SocketLoadBalancing"]
    assert socket_lb.summary.startswith("Cilium's kube-proxy replacement balances the node's own clients at "
                                        "connect() (socket-LB) instead of NATing each packet as iptables mode does")
    assert "conntrack holds no DNAT entry" in socket_lb.summary and socket_lb.preserving is None
    assert socket_lb.services == ("default/np", "default/sticky", "default/syslog", "default/web", "metallb/ingress")
    addresses = found["NodePortAddresses"]
    assert "only on the addresses of Cilium's devices" in addresses.summary
    assert addresses.preserving == "nodePortAddresses: [0.0.0.0/0] (or [all])"
    affinity = found["SessionAffinity"]
    assert affinity.services == ("default/sticky",) and "network namespace" in affinity.summary
    # socket-LB serves localhost NodePorts, TCP and UDP, as route_localnet does: nothing lost there; no INVALID
    # drop to miss (its own conntrack reverse-translates); NodePorts are handled before netfilter.
    assert localhost_protocols("cilium-kpr", None) == {"TCP", "UDP"}


def test_cilium_kpr_nodeport_addresses_keep_every_address() -> None:
    wide = config("cilium-kpr", nodePortAddresses=["0.0.0.0/0"])
    found = by_change(compatibility("iptables", None, "cilium-kpr", wide, SERVICES, ENDPOINTS))
    assert found["NodePortAddresses"].preserved and "LocalhostNodePorts" not in found
    narrow = config("cilium-kpr", nodePortAddresses=["198.18.0.0/16"])
    lost = by_change(compatibility("iptables", None, "cilium-kpr", narrow, SERVICES, ENDPOINTS))["LocalhostNodePorts"]
    assert lost.summary == ("Cilium's kube-proxy replacement serves no NodePorts on 127.0.0.1 "
                            "(iptables mode does)")
    assert lost.services == ("default/np", "default/syslog", "metallb/ingress")


def test_ipvs_to_cilium_kpr_loses_the_scheduler_and_persistence() -> None:
    found = by_change(compatibility("ipvs", config("ipvs", ipvs={"scheduler": "sh"}), "cilium-kpr", None,
                                    SERVICES, ENDPOINTS))
    assert {"IPVSScheduler", "SessionAffinity", "SocketLoadBalancing"} <= set(found)
    assert "IPVS persistence in ipvs mode" in found["SessionAffinity"].summary
    assert "Cilium's affinity map" in found["SessionAffinity"].summary
    assert found["IPVSScheduler"].summary.endswith("in Cilium's kube-proxy replacement")
    assert "StrictARP" not in found  # Cilium binds no Service address on a dummy interface


def test_cilium_kpr_back_to_nftables() -> None:
    found = by_change(compatibility("cilium-kpr", None, "nftables", None, SERVICES, ENDPOINTS))
    assert {"LocalhostNodePorts", "SessionAffinity", "SocketLoadBalancing", "NodePortFirewall"} <= set(found)
    assert found["SocketLoadBalancing"].summary.startswith(
        "nftables mode NATs each packet where Cilium's kube-proxy replacement balanced")
    assert "nftables.localhostNodePorts: true" in (found["LocalhostNodePorts"].preserving or "")
    # Cilium and nftables both serve NodePorts on the node's own addresses when unset: nothing moves.
    assert "NodePortAddresses" not in found
    back = by_change(compatibility("cilium-kpr", None, "iptables", None, SERVICES, ENDPOINTS))
    assert set(back) == {"SessionAffinity", "SocketLoadBalancing"}


def test_compat_summary_names_cilium_kpr() -> None:
    from proxyshift.planner.compat import compat_summary

    text = compat_summary("cilium-kpr", compatibility("iptables", None, "cilium-kpr", None, SERVICES, ENDPOINTS))
    assert text.startswith("Cilium's kube-proxy replacement changes: NodePortAddresses for ")
    assert "SocketLoadBalancing for default/np, default/sticky, default/syslog and 2 more (no setting keeps it)" in text
