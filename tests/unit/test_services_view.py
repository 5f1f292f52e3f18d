"""Service and EndpointSlice views from the API's JSON: what is kept, what is tolerated, what is bounded."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.planner.services import (
    MAX_ENDPOINTS_PER_SLICE,
    MAX_PORTS,
    EndpointView,
    ServicePortView,
    endpoints_from_slice,
    service_view_from_k8s,
)

pytestmark = pytest.mark.unit


def service(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": "default", "name": "web"}, "spec": spec, "status": status or {}}


def test_a_nodeport_service_with_affinity_and_local_policies() -> None:
    view = service_view_from_k8s(service({
        "type": "NodePort", "clusterIP": "198.19.0.10", "clusterIPs": ["198.19.0.10"],
        "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30080},
                  {"name": "dns", "protocol": "UDP", "port": 53}],
        "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
        "internalTrafficPolicy": "Local", "externalTrafficPolicy": "Local",
    }))
    assert view is not None
    assert view.key == "default/web" and view.type == "NodePort" and view.cluster_ips == ("198.19.0.10",)
    assert view.ports == (ServicePortView("http", "TCP", 80, 30080), ServicePortView("dns", "UDP", 53, None))
    assert view.node_ports == (ServicePortView("http", "TCP", 80, 30080),)
    assert (view.session_affinity, view.affinity_timeout_seconds) == ("ClientIP", 60)
    assert (view.internal_traffic_policy, view.external_traffic_policy) == ("Local", "Local")
    assert not view.headless


def test_defaults_of_a_sparse_service() -> None:
    view = service_view_from_k8s(service({"clusterIP": "198.19.0.11", "ports": [{"port": 53}],
                                          "sessionAffinity": "ClientIP"}))
    assert view is not None
    assert view.type == "ClusterIP" and view.ports[0].protocol == "TCP"
    assert view.affinity_timeout_seconds == 10800  # kube-proxy's default
    assert (view.internal_traffic_policy, view.external_traffic_policy) == ("Cluster", "Cluster")


def test_headless_has_no_cluster_ip() -> None:
    view = service_view_from_k8s(service({"clusterIP": "None", "clusterIPs": ["None"], "ports": [{"port": 80}]}))
    assert view is not None and view.headless and view.cluster_ips == ()


def test_load_balancer_ingress_ips() -> None:
    view = service_view_from_k8s(service({"type": "LoadBalancer", "clusterIP": "198.19.0.12"},
                                         {"loadBalancer": {"ingress": [{"ip": "198.18.250.1"}, {"hostname": "x"}]}}))
    assert view is not None and view.load_balancer_ips == ("198.18.250.1",)


def test_bounded_ports() -> None:
    view = service_view_from_k8s(service({"clusterIP": "198.19.0.13",
                                          "ports": [{"port": p} for p in range(1, 200)]}))
    assert view is not None and len(view.ports) == MAX_PORTS


def test_nameless_service_is_skipped() -> None:
    assert service_view_from_k8s({"metadata": {"name": "x"}, "spec": {}}) is None
    assert service_view_from_k8s({}) is None


def test_endpoints_from_a_slice() -> None:
    found = endpoints_from_slice({
        "metadata": {"namespace": "default", "name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
        "endpoints": [
            {"addresses": ["198.18.1.1"], "conditions": {"ready": True}, "nodeName": "ps-node-1",
             "targetRef": {"kind": "Pod", "name": "web-1"}},
            {"addresses": ["198.18.1.2"], "conditions": {"ready": False}, "nodeName": "ps-node-2"},
            {"addresses": ["198.18.1.3"], "hostname": "web-3"},  # no conditions: unknown means ready
            {"addresses": []},
            "garbage",
        ],
    })
    assert found == [
        EndpointView("default/web", "198.18.1.1", True, "ps-node-1", "web-1"),
        EndpointView("default/web", "198.18.1.2", False, "ps-node-2", None),
        EndpointView("default/web", "198.18.1.3", True, None, "web-3"),
    ]


def test_a_slice_without_a_service_label_gives_nothing() -> None:
    assert endpoints_from_slice({"metadata": {"namespace": "default"}, "endpoints": [{"addresses": ["1.2.3.4"]}]}) == []


def test_bounded_endpoints() -> None:
    body = {"metadata": {"namespace": "d", "labels": {"kubernetes.io/service-name": "s"}},
            "endpoints": [{"addresses": [f"198.18.{i // 250}.{i % 250 + 1}"]} for i in range(1500)]}
    assert len(endpoints_from_slice(body)) == MAX_ENDPOINTS_PER_SLICE


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=30)
KEYS = st.sampled_from(["metadata", "spec", "status", "endpoints", "ports", "clusterIP", "clusterIPs", "type",
                        "namespace", "name", "labels", "addresses", "conditions", "ready", "nodeName",
                        "sessionAffinity", "sessionAffinityConfig", "clientIP", "timeoutSeconds", "loadBalancer",
                        "ingress", "ip", "port", "nodePort", "protocol", "targetRef", "kubernetes.io/service-name"])
SHAPED = st.recursive(JSON, lambda inner: st.dictionaries(KEYS, inner, max_size=6), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(KEYS, SHAPED, max_size=5))
def test_any_json_is_tolerated(body: dict[str, Any]) -> None:
    view = service_view_from_k8s(body)
    if view is not None:
        assert len(view.ports) <= MAX_PORTS and all(1 <= p.port <= 65535 for p in view.ports)
    for endpoint in endpoints_from_slice(body):
        assert isinstance(endpoint.address, str) and isinstance(endpoint.ready, bool)
