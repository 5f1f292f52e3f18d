"""The behaviour matrix: the sample a node probes, and the comparison before/after the switch."""

from __future__ import annotations

from typing import Any

import pytest
from behaviour_strategies import NODES, clusters, matrices
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.api.behaviour import CHANGE_NAMES, MAX_CELLS, MAX_TARGETS, BehaviourCell, BehaviourMatrix
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import NFTABLES_LOCALHOST_GATE, ProxyPolicySpec
from proxyshift.planner.behaviour import (
    behaviour_params,
    compare_matrices,
    estimated_cells,
    node_ips_from_k8s,
    serves_node_ports_on,
    stable_rank,
)
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView

pytestmark = pytest.mark.unit

NODE_IPS = ["198.18.0.11"]


def spec(**gate: Any) -> ProxyPolicySpec:
    return ProxyPolicySpec.model_validate({"nodeSelector": {}, "mode": "nftables", "gate": gate})


def svc(name: str, *, ns: str = "default", ip: str = "198.19.0.10", ports: tuple[ServicePortView, ...] = (
        ServicePortView("", "TCP", 80),), **kw: Any) -> ServiceView:
    return ServiceView(namespace=ns, name=name, cluster_ips=(ip,) if ip else (), ports=ports, **kw)


def ep(service: str, address: str, node: str = "ps-node-1", ready: bool = True) -> EndpointView:
    return EndpointView(service=f"default/{service}", address=address, ready=ready, node_name=node)


# A small cluster with one Service of every kind.
SERVICES = [
    svc("web", ip="198.19.0.10"),
    svc("dns", ip="198.19.0.53", ports=(ServicePortView("", "UDP", 53),)),
    svc("np", ip="198.19.0.20", type="NodePort", ports=(ServicePortView("", "TCP", 80, 30080),)),
    svc("sticky", ip="198.19.0.30", session_affinity="ClientIP", affinity_timeout_seconds=60),
    svc("itp", ip="198.19.0.40", internal_traffic_policy="Local"),
    svc("etp", ip="198.19.0.50", type="NodePort", external_traffic_policy="Local",
        ports=(ServicePortView("", "TCP", 80, 30090),)),
    svc("empty", ip="198.19.0.60"),
    svc("headless", ip="", headless=True),
]
ENDPOINTS = [
    ep("web", "198.18.1.1"), ep("dns", "198.18.1.2"), ep("np", "198.18.1.3"),
    ep("sticky", "198.18.1.4"), ep("sticky", "198.18.1.5", "ps-node-2"),
    ep("itp", "198.18.1.6", "ps-node-1"), ep("itp", "198.18.1.7", "ps-node-2"),
    ep("etp", "198.18.1.8", "ps-node-2"), ep("etp", "198.18.1.9", "ps-node-1"),
    ep("empty", "198.18.1.10", ready=False), ep("headless", "198.18.1.11"),
]


def test_every_kind_is_sampled_from_a_small_cluster() -> None:
    params = behaviour_params(SERVICES, ENDPOINTS, "ps-node-1", NODE_IPS, spec(), "198.18.2.11:9000")
    by_service = {t.service: t for t in params.targets if t.kind != "ClusterIP" or t.service != "default/np"}
    kinds = {(t.kind, t.protocol) for t in params.targets}
    assert kinds == {("ClusterIP", "TCP"), ("ClusterIP", "UDP"), ("NodePort", "TCP"), ("Affinity", "TCP"),
                     ("InternalLocal", "TCP"), ("ExternalLocal", "TCP"), ("NoEndpoints", "TCP")}
    assert by_service["default/dns"].address == "198.19.0.53" and by_service["default/dns"].port == 53
    assert by_service["default/np"].address is None and by_service["default/np"].port == 30080
    assert by_service["default/sticky"].attempts > 1
    assert by_service["default/itp"].local_endpoints == ["198.18.1.6"]
    assert by_service["default/etp"].local_endpoints == ["198.18.1.9"]
    assert by_service["default/empty"].kind == "NoEndpoints"
    assert "default/headless" not in by_service
    assert params.node_ips == NODE_IPS and params.pod_probe == "198.18.2.11:9000"
    # A plain NodePort Service also stands for ClusterIP TCP: its ClusterIP is one more cell.
    assert ("default/np", "198.19.0.20") in {(t.service, t.address) for t in params.targets}


def test_local_endpoints_are_this_nodes_ready_ones() -> None:
    other = behaviour_params(SERVICES, ENDPOINTS, "ps-node-2", NODE_IPS, spec(), None)
    by_service = {t.service: t for t in other.targets if t.local_endpoints is not None}
    assert by_service["default/itp"].local_endpoints == ["198.18.1.7"]
    assert by_service["default/etp"].local_endpoints == ["198.18.1.8"]
    third = {t.service: t for t in behaviour_params(SERVICES, ENDPOINTS, "ps-node-3", NODE_IPS, spec(), None).targets
             if t.local_endpoints is not None}
    assert third["default/itp"].local_endpoints == []  # judged: nothing may answer from elsewhere


def test_named_services_come_first_and_are_dialled_once() -> None:
    named = spec(probeServices=[{"name": "web", "port": 80}, {"name": "missing", "port": 80},
                                {"name": "headless", "port": 80}])
    params = behaviour_params(SERVICES, ENDPOINTS, "ps-node-1", NODE_IPS, named, None)
    assert params.targets[0].service == "default/web" and params.targets[0].kind == "Named"
    assert [t.service for t in params.targets].count("default/web") == 1
    assert "default/missing" not in {t.service for t in params.targets}


def test_disabled_probe_has_no_targets_and_budget_comes_from_the_policy() -> None:
    assert behaviour_params(SERVICES, ENDPOINTS, "ps-node-1", NODE_IPS, spec(behaviour={"enabled": False}),
                            None).targets == []
    params = behaviour_params(SERVICES, ENDPOINTS, "ps-node-1", NODE_IPS, spec(behaviour={"budgetSeconds": 0.5}),
                              None)
    assert params.budget_seconds == 0.5


def test_the_sample_is_spread_by_hash_not_by_namespace() -> None:
    crowd = [svc(f"s{i:03d}", ns="big", ip=f"198.19.1.{i}") for i in range(1, 200)]
    few = [svc("only", ns="small", ip="198.19.2.1")]
    endpoints = [EndpointView(s.key, "198.18.1.1", True, "ps-node-1") for s in crowd + few]
    ranks = sorted(s.key for s in crowd + few)
    assert ranks[0].startswith("big/")  # alphabetical order would always pick from "big"
    params = behaviour_params(crowd + few, endpoints, "ps-node-1", NODE_IPS, spec(behaviour={"samplePerKind": 8}),
                              None)
    picked = [t.service for t in params.targets if t.kind == "ClusterIP"]
    assert picked == sorted(picked, key=stable_rank)


@settings(max_examples=120, deadline=None)
@given(cluster=clusters(), node=st.sampled_from(NODES), per_kind=st.integers(1, 8), seed=st.randoms())
def test_sampling_properties(cluster: tuple[list[ServiceView], list[EndpointView]], node: str, per_kind: int,
                             seed: Any) -> None:
    services, endpoints = cluster
    names = [s for s in services if not s.headless and s.cluster_ips][:4]
    policy = spec(behaviour={"samplePerKind": per_kind},
                  probeServices=[{"namespace": s.namespace, "name": s.name, "port": 80} for s in names])
    params = behaviour_params(services, endpoints, node, NODE_IPS, policy, None)
    # Deterministic, whatever order the caches hand the objects over in.
    shuffled_s, shuffled_e = list(services), list(endpoints)
    seed.shuffle(shuffled_s)
    seed.shuffle(shuffled_e)
    assert behaviour_params(shuffled_s, shuffled_e, node, NODE_IPS, policy, None) == params
    # Bounded: per kind, in targets and in the cells the agent will write.
    assert len(params.targets) <= MAX_TARGETS
    assert sum(estimated_cells(t, NODE_IPS) for t in params.targets) <= MAX_CELLS
    for kind in ("ClusterIP", "NodePort", "Affinity", "InternalLocal", "ExternalLocal", "NoEndpoints"):
        for protocol in ("TCP", "UDP"):
            assert sum(1 for t in params.targets if (t.kind, t.protocol) == (kind, protocol)) <= per_kind
    # Named ones always in; headless never; no port dialled twice.
    assert {f"{s.namespace}/{s.name}" for s in names} <= {t.service for t in params.targets if t.kind == "Named"}
    headless = {s.key for s in services if s.headless}
    assert not headless & {t.service for t in params.targets}
    ids = [(t.service, t.address, t.port, t.protocol) for t in params.targets]
    assert len(ids) == len(set(ids))
    # Local policies are judged against this node's ready endpoints only.
    ready_here = {(e.service, e.address) for e in endpoints if e.ready and e.node_name == node}
    for target in params.targets:
        for address in target.local_endpoints or []:
            assert (target.service, address) in ready_here


def test_a_large_cluster_is_cut_at_the_cell_bound_with_every_kind_in() -> None:
    many = []
    endpoints = []
    for i in range(1, 60):
        many.append(svc(f"np{i}", ip=f"198.19.3.{i}", type="NodePort",
                        ports=(ServicePortView("", "TCP", 80, 30000 + i),)))
        many.append(svc(f"web{i}", ip=f"198.19.4.{i}"))
        many.append(svc(f"dns{i}", ip=f"198.19.5.{i}", ports=(ServicePortView("", "UDP", 53),)))
        endpoints += [ep(f"np{i}", "198.18.1.1"), ep(f"web{i}", "198.18.1.2"), ep(f"dns{i}", "198.18.1.3")]
    node_ips = [f"198.18.0.{i}" for i in range(11, 19)]  # 8: a NodePort is 19 cells
    params = behaviour_params(many, endpoints, "ps-node-1", node_ips, spec(behaviour={"samplePerKind": 8}), None)
    assert sum(estimated_cells(t, node_ips) for t in params.targets) <= MAX_CELLS
    assert 0 < sum(1 for t in params.targets if t.kind == "NodePort") < 8  # cut by cells, not by samplePerKind
    assert {("ClusterIP", "TCP"), ("ClusterIP", "UDP"), ("NodePort", "TCP")} <= {(t.kind, t.protocol)
                                                                               for t in params.targets}


def test_node_ips_from_the_node_object() -> None:
    node = {"status": {"addresses": [{"type": "Hostname", "address": "ps-node-1"},
                                     {"type": "InternalIP", "address": "198.18.0.11"},
                                     {"type": "ExternalIP", "address": "198.18.100.11"},
                                     {"type": "InternalIP", "address": "198.18.0.11"}, "junk"]}}
    assert node_ips_from_k8s(node) == ["198.18.0.11", "198.18.100.11"]
    assert node_ips_from_k8s({}) == [] and node_ips_from_k8s({"status": {"addresses": "x"}}) == []


# ---- comparison -------------------------------------------------------------------------------


def cell(**kw: Any) -> BehaviourCell:
    base: dict[str, Any] = {"service": "default/np", "kind": "NodePort", "protocol": "TCP", "port": 30080,
                            "address": "127.0.0.1", "address_role": "localhost", "path": "node",
                            "outcome": "answered", "endpoints": ["198.18.1.3"]}
    return BehaviourCell.model_validate(base | kw)


def matrix(*cells: BehaviourCell, mode: str = "iptables", **kw: Any) -> BehaviourMatrix:
    return BehaviourMatrix(operation_id=mode, mode=mode, cells=list(cells), **kw)


def test_localhost_node_port_refused_after_a_move_to_nftables() -> None:
    before = matrix(cell())
    after = matrix(cell(outcome="refused", endpoints=[]), mode="nftables")
    verdict = compare_matrices(before, after, set())
    assert not verdict.passed
    assert [c.name for c in verdict.failing] == ["LocalhostNodePorts"]
    assert verdict.reason.startswith(
        "NodePort 30080 on 127.0.0.1 (default/np) answered before the switch and is refused now: "
        "nftables mode serves no localhost NodePorts (set nftables.localhostNodePorts: true")
    assert "allow the change LocalhostNodePorts" in verdict.reason
    assert compare_matrices(before, after, {"LocalhostNodePorts"}).passed


def test_udp_localhost_node_port_has_no_preserving_setting() -> None:
    config = KubeProxyConfiguration(mode="nftables", node_port_addresses=["primary", "localhost"],
                                    feature_gates={NFTABLES_LOCALHOST_GATE: True})
    before = matrix(cell(protocol="UDP"))
    after = matrix(cell(protocol="UDP", outcome="timeout", endpoints=[]), mode="nftables")
    verdict = compare_matrices(before, after, set(), to_config=config)
    assert "UDP NodePort 30080 on 127.0.0.1" in verdict.reason and "for TCP only" in verdict.reason


def test_second_address_lost_with_node_port_addresses_unset_in_nftables() -> None:
    before = matrix(cell(address="198.18.200.11", address_role="otherAddress"),
                    cell(address="198.18.0.11", address_role="nodeIP"))
    after = matrix(cell(address="198.18.200.11", address_role="otherAddress", outcome="timeout", endpoints=[]),
                   cell(address="198.18.0.11", address_role="nodeIP"), mode="nftables")
    verdict = compare_matrices(before, after, set())
    assert [c.name for c in verdict.failing] == ["NodePortAddresses"]
    assert "only on the node's primary IPs when nodePortAddresses is unset" in verdict.reason
    assert verdict.compared == 2


def test_a_node_ip_left_out_of_node_port_addresses_is_that_change_too() -> None:
    config = KubeProxyConfiguration(mode="nftables", node_port_addresses=["10.0.0.0/8"])
    before = matrix(cell(address="198.18.0.11", address_role="nodeIP"))
    after = matrix(cell(address="198.18.0.11", address_role="nodeIP", outcome="refused"), mode="nftables")
    verdict = compare_matrices(before, after, set(), to_config=config)
    assert [c.name for c in verdict.failing] == ["NodePortAddresses"] and "['10.0.0.0/8']" in verdict.reason


def test_a_cluster_ip_that_stops_answering_is_reachability_and_never_allowed() -> None:
    web = cell(service="default/web", kind="ClusterIP", address="198.19.0.10", address_role="clusterIP", port=80,
               path="pod")
    after = matrix(web.model_copy(update={"outcome": "timeout", "detail": "no answer in 250 ms"}), mode="nftables")
    verdict = compare_matrices(matrix(web), after, set(CHANGE_NAMES))
    assert [c.name for c in verdict.failing] == ["Reachability"]
    assert verdict.reason.startswith("default/web 198.19.0.10:80/TCP from a pod answered before the switch and "
                                     "times out now (no answer in 250 ms)")


def test_lost_stickiness_and_locality() -> None:
    sticky = cell(service="default/sticky", kind="Affinity", address="198.19.0.30", address_role="clusterIP",
                  port=80, sticky=True)
    local = cell(service="default/itp", kind="InternalLocal", address="198.19.0.40", address_role="clusterIP",
                 port=80, local=True)
    after = matrix(sticky.model_copy(update={"sticky": False, "endpoints": ["198.18.1.4", "198.18.1.5"]}),
                   local.model_copy(update={"local": False, "endpoints": ["198.18.1.7"]}), mode="nftables")
    verdict = compare_matrices(matrix(sticky, local), after, set())
    assert [c.name for c in verdict.failing] == ["SessionAffinity", "TrafficPolicyLocal"]
    assert "198.18.1.4, 198.18.1.5" in verdict.failing[0].message
    assert compare_matrices(matrix(sticky, local), after, {"SessionAffinity", "TrafficPolicyLocal"}).passed


def test_endpoint_identities_may_change() -> None:
    web = cell(service="default/web", address="198.19.0.10", address_role="clusterIP", port=80, sticky=True)
    after = matrix(web.model_copy(update={"endpoints": ["198.18.1.99"]}), mode="nftables")
    verdict = compare_matrices(matrix(web), after, set())
    assert verdict.passed and verdict.changes == []


def test_recovered_cells_are_reported_not_failed() -> None:
    empty = cell(service="default/empty", kind="NoEndpoints", address="198.19.0.60", address_role="clusterIP",
                 outcome="refused", endpoints=[])
    verdict = compare_matrices(matrix(empty), matrix(empty.model_copy(update={"outcome": "answered"})), set())
    assert verdict.passed and len(verdict.recovered) == 1 and "was refused before" in verdict.recovered[0]
    # A failure that fails differently is no change users would miss.
    assert compare_matrices(matrix(empty), matrix(empty.model_copy(update={"outcome": "timeout"})), set()).passed


def test_truncated_matrix_compares_what_both_have_and_says_so() -> None:
    a, b = cell(port=30080), cell(port=30081)
    verdict = compare_matrices(matrix(a, b), matrix(a, truncated=True), set())
    assert verdict.passed and verdict.compared == 1
    assert any("ran out of time (after)" in n for n in verdict.notes)


def test_missing_pod_path_compares_node_cells_only() -> None:
    node = cell(service="default/web", address="198.19.0.10", address_role="clusterIP", port=80)
    pod = node.model_copy(update={"path": "pod"})
    after = matrix(node, mode="nftables", pod_path_error="pod probe server not answering")
    verdict = compare_matrices(matrix(node, pod), after, set())
    assert verdict.passed and verdict.compared == 1
    assert verdict.notes[0] == "pod path not compared: pod probe server not answering"


def test_messages_stay_within_the_api_bound() -> None:
    long = cell(service="n" * 60 + "/" + "s" * 60, detail="x" * 200, address="198.19.0.10",
                address_role="clusterIP")
    verdict = compare_matrices(matrix(long), matrix(long.model_copy(update={"outcome": "error"})), set())
    assert len(verdict.failing[0].message) <= 400


def test_serves_node_ports_on() -> None:
    assert serves_node_ports_on("198.18.200.11", "otherAddress", "iptables", None)
    assert not serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", None)
    assert serves_node_ports_on("198.18.0.11", "nodeIP", "nftables", None)
    assert serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", ["0.0.0.0/0"])
    assert serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", ["all"])
    assert not serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", ["primary"])
    assert serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", ["198.18.0.0/16"])
    assert serves_node_ports_on("198.18.200.11", "otherAddress", "nftables", ["fd00::/8"])  # IPv4 gets 0.0.0.0/0


@settings(max_examples=200, deadline=None)
@given(m=matrices())
def test_equal_matrices_always_pass(m: BehaviourMatrix) -> None:
    verdict = compare_matrices(m, m.model_copy(update={"mode": "nftables"}), set())
    assert verdict.passed and verdict.changes == [] and verdict.compared == len(m.cells)


@settings(max_examples=200, deadline=None)
@given(m=matrices(), data=st.data(), mode=st.sampled_from(["iptables", "ipvs", "nftables"]))
def test_a_removed_reachable_cell_fails_unless_its_change_is_allowed(m: BehaviourMatrix, data: st.DataObject,
                                                                     mode: str) -> None:
    answered = [c for c in m.cells if c.outcome == "answered"]
    if not answered:
        return
    lost = data.draw(st.sampled_from(answered))
    how = data.draw(st.sampled_from(["refused", "timeout", "unreachable", "error"]))
    cells = [c.model_copy(update={"outcome": how, "endpoints": [], "sticky": None, "local": None})
             if c.key == lost.key else c for c in m.cells]
    after = m.model_copy(update={"cells": cells, "mode": mode})
    verdict = compare_matrices(m, after, set())
    assert not verdict.passed and len(verdict.failing) == 1 and verdict.failing[0].service == lost.service
    name = verdict.failing[0].name
    everything_else = set(CHANGE_NAMES) - {name}
    assert not compare_matrices(m, after, everything_else).passed
    allowed = compare_matrices(m, after, set(CHANGE_NAMES))
    assert allowed.passed == (name != "Reachability")
    if lost.address_role == "clusterIP":
        assert name == "Reachability"
