"""The behaviour workloads' plan and manifests, the identity server for test pods: pure, no root."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from localcluster import behaviour_workloads as bw
from localcluster import cli, identity_server
from proxyshift.api.behaviour import BehaviourTarget

pytestmark = pytest.mark.unit

ENDPOINTS = ["ps-ep-1", "ps-ep-2", "ps-ep-3", "ps-ep-4"]
NODES = ["ps-node-1", "ps-node-2", "ps-node-3"]


def made() -> bw.BehaviourWorkloads:
    where = bw.placement(ENDPOINTS, NODES)
    endpoints = tuple(bw.BehaviourEndpoint(n, f"198.18.1.{i}", where[n], 8080, 5353)
                      for i, n in enumerate(ENDPOINTS, 1))
    return bw.BehaviourWorkloads(bw.NAMESPACE, tuple(bw.behaviour_node(n) for n in NODES), endpoints,
                                 tuple(bw.plan_services(ENDPOINTS)))


def test_placement_leaves_the_last_node_without_endpoints() -> None:
    assert bw.placement(ENDPOINTS, NODES) == {"ps-ep-1": "ps-node-1", "ps-ep-2": "ps-node-2",
                                              "ps-ep-3": "ps-node-1", "ps-ep-4": "ps-node-2"}
    assert set(bw.placement(ENDPOINTS, ["ps-node-1"]).values()) == {"ps-node-1"}
    with pytest.raises(ValueError):
        bw.placement(ENDPOINTS, [])


def test_every_kind_the_gate_judges_is_planned() -> None:
    services = {s.name: s for s in bw.plan_services(ENDPOINTS)}
    assert {s.kind for s in services.values()} == {"ClusterIP", "NodePort", "Affinity", "InternalLocal",
                                                   "ExternalLocal", "NoEndpoints", None}
    assert services["clusterip-udp"].protocol == "UDP"
    assert services["no-endpoints"].endpoints == () and not services["not-ready"].ready
    with pytest.raises(ValueError):
        bw.plan_services(["ps-ep-1"])  # affinity needs two endpoints to mean anything


def test_service_manifests_carry_each_kind_s_settings() -> None:
    spec = {s.name: bw.service_manifest(s)["spec"] for s in bw.plan_services(ENDPOINTS)}
    assert spec["nodeport-tcp"]["type"] == "NodePort" and spec["nodeport-tcp"]["ports"][0]["nodePort"] == 30080
    assert spec["nodeport-tcp"]["externalTrafficPolicy"] == "Cluster"
    assert spec["external-local"]["externalTrafficPolicy"] == "Local"
    assert spec["external-local"]["ports"][0]["nodePort"] == 30081
    assert spec["internal-local"]["internalTrafficPolicy"] == "Local"
    assert spec["affinity"]["sessionAffinity"] == "ClientIP"
    assert spec["affinity"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] == bw.AFFINITY_TIMEOUT_SECONDS
    assert spec["headless"]["clusterIP"] == "None"
    assert "selector" not in spec["clusterip-tcp"]  # selector-less: the slices are ours
    assert spec["clusterip-udp"]["ports"][0] == {"name": "udp", "port": 53, "targetPort": 5353, "protocol": "UDP"}


def test_slices_name_each_endpoint_and_its_node() -> None:
    m = made()
    endpoints = {e.name: e for e in m.endpoints}
    for svc in m.services:
        if not svc.endpoints:
            continue
        body = bw.slice_manifest(svc, endpoints)
        assert body["metadata"]["labels"]["kubernetes.io/service-name"] == svc.name
        # kube-proxy pairs Service and slice ports by name.
        assert body["ports"][0]["name"] == bw.service_manifest(svc)["spec"]["ports"][0]["name"]
        for entry, name in zip(body["endpoints"], svc.endpoints, strict=True):
            assert entry["nodeName"] == endpoints[name].node and entry["hostname"] == name
            assert entry["targetRef"] == {"kind": "Pod", "namespace": bw.NAMESPACE, "name": name}
            assert entry["conditions"]["ready"] is svc.ready and entry["conditions"]["serving"] is svc.ready


def test_description_answers_locality_and_serialises() -> None:
    m = made()
    assert m.local_endpoints("internal-local", "ps-node-1") == ("ps-ep-1", "ps-ep-3")
    assert m.local_endpoints("internal-local", "ps-node-3") == ()
    assert m.node("ps-node-2").pod_netns == "ps-node-2-pod" and m.node("ps-node-2").second_address == "198.18.2.12"
    assert json.loads(json.dumps(m.to_dict()))["services"][0]["name"] == "clusterip-tcp"
    with pytest.raises(KeyError):
        m.service("nope")
    # Its kinds and protocols are the contract's: a target built from it validates.
    svc = m.service("internal-local")
    BehaviourTarget(service=svc.key, kind=svc.kind or "Named", protocol=svc.protocol, port=svc.port,
                    address="198.19.0.10", local_endpoints=[m.endpoint(e).ip for e in m.local_endpoints(
                        svc.name, "ps-node-1")])


def test_identity_server_answers_every_get_with_its_identity() -> None:
    assert identity_server.parse_listen("0.0.0.0:9090") == ("0.0.0.0", 9090)
    assert identity_server.parse_listen(":80") == ("0.0.0.0", 80)
    for bad in ("9090", "host:", "host:0", "host:99999"):
        with pytest.raises(ValueError):
            identity_server.parse_listen(bad)
    server = identity_server.make_server("127.0.0.1", 0, "pod-a")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for path in ("/healthz", "/"):
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=2)
            conn.request("GET", path)
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"pod-a\n")
            conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_cli_has_workloads_and_serve() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["workloads", "--behaviour", "--json"])
    assert args.command == "workloads" and args.behaviour and args.json
    assert parser.parse_args(["serve", "--listen", "0.0.0.0:9090"]).listen == "0.0.0.0:9090"
    with pytest.raises(SystemExit):
        parser.parse_args(["workloads"])  # --behaviour is the only kind there is


def test_expected_outcome_is_what_kube_proxy_does_here() -> None:
    m = made()
    services = {s.name: bw.BehaviourService(**{**vars(s), "cluster_ip": f"198.19.0.{i}"})
                for i, s in enumerate(m.services, 10)}
    m = bw.BehaviourWorkloads(m.namespace, m.nodes, m.endpoints, tuple(services.values()))
    every = frozenset(ENDPOINTS)
    n1, n3 = m.node("ps-node-1"), m.node("ps-node-3")
    ip = {name: svc.cluster_ip or "" for name, svc in services.items()}
    assert bw.expected_outcome(m, "clusterip-udp", n1.name, "pod", ip["clusterip-udp"]) == ("answered", every)
    assert bw.expected_outcome(m, "internal-local", n1.name, "node", ip["internal-local"]) == \
        ("answered", frozenset({"ps-ep-1", "ps-ep-3"}))
    assert bw.expected_outcome(m, "internal-local", n3.name, "pod", ip["internal-local"]) == ("timeout", frozenset())
    for name in ("not-ready", "no-endpoints"):
        assert bw.expected_outcome(m, name, n1.name, "pod", ip[name]) == ("refused", frozenset())
    # External Local on the node without a local endpoint: short-circuited to every endpoint.
    assert bw.expected_outcome(m, "external-local", n3.name, "node", n3.ip) == ("answered", every)
    for address in (n1.second_address, bw.LOCALHOST):
        assert bw.expected_outcome(m, "nodeport-tcp", n1.name, "node", address) == ("answered", every)
        assert bw.expected_outcome(m, "nodeport-tcp", n1.name, "node", address, "nftables") == \
            ("refused", frozenset())
    assert bw.expected_outcome(m, "nodeport-tcp", n1.name, "pod", n1.ip, "nftables") == ("answered", every)
    with pytest.raises(ValueError):
        bw.expected_outcome(m, "nodeport-tcp", n1.name, "pod", bw.LOCALHOST)
    with pytest.raises(ValueError):
        bw.expected_outcome(m, "clusterip-tcp", n1.name, "node", n3.ip)  # not a NodePort
