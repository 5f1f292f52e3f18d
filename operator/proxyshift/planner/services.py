"""Services and their endpoints as the behaviour probe and the compatibility report see them.

Pure views built from the API's JSON dicts (what the operator's caches and `kubectl get -o json`
hold), never from kubernetes client objects. The converters tolerate missing and malformed fields
(a Service that cannot be read is skipped, not fatal) and bound what they keep, so one hostile or
huge object cannot grow a probe or a report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from proxyshift.api.replacement import frontend_key

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MAX_PORTS = 32
MAX_CLUSTER_IPS = 2  # a dual-stack Service has at most one per family
MAX_LOAD_BALANCER_IPS = 8
MAX_ENDPOINTS_PER_SLICE = 1000  # the EndpointSlice API's own maximum
MAX_NAME_LENGTH = 253
MAX_ADDRESS_LENGTH = 45  # the longest textual IPv6 address


@dataclass(frozen=True)
class ServicePortView:
    name: str
    protocol: str  # TCP, UDP or SCTP
    port: int
    node_port: int | None = None


@dataclass(frozen=True)
class ServiceView:
    namespace: str
    name: str
    type: str = "ClusterIP"  # ClusterIP, NodePort, LoadBalancer, ExternalName
    cluster_ips: tuple[str, ...] = ()
    headless: bool = False
    ports: tuple[ServicePortView, ...] = ()
    session_affinity: str = "None"  # None or ClientIP
    affinity_timeout_seconds: int | None = None
    internal_traffic_policy: str = "Cluster"  # Cluster or Local
    external_traffic_policy: str = "Cluster"  # Cluster or Local (NodePort and LoadBalancer only)
    load_balancer_ips: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """namespace/name, as BehaviourTarget.service and EndpointView.service spell it."""
        return f"{self.namespace}/{self.name}"

    @property
    def node_ports(self) -> tuple[ServicePortView, ...]:
        return tuple(p for p in self.ports if p.node_port)


@dataclass(frozen=True)
class EndpointView:
    service: str  # namespace/name of the Service the slice belongs to
    address: str  # the first address: the one kube-proxy uses
    ready: bool
    node_name: str | None = None
    target: str | None = None  # targetRef name (the pod), else the endpoint's hostname


def _text(value: Any, limit: int = MAX_NAME_LENGTH) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= limit else None


def _port(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535 else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _texts(value: Any, limit: int, length: int = MAX_ADDRESS_LENGTH) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(t for t in (_text(v, length) for v in value[:limit]) if t)


def service_view_from_k8s(body: Mapping[str, Any]) -> ServiceView | None:
    """A Service's view, or None when it has no namespace/name to refer to it by."""
    meta, spec, status = _mapping(body.get("metadata")), _mapping(body.get("spec")), _mapping(body.get("status"))
    namespace, name = _text(meta.get("namespace"), 63), _text(meta.get("name"), 63)
    if namespace is None or name is None:
        return None
    cluster_ips = _texts(spec.get("clusterIPs"), MAX_CLUSTER_IPS) or _texts([spec.get("clusterIP")], 1)
    headless = "None" in cluster_ips
    ports = []
    raw_ports = spec.get("ports")
    for raw in raw_ports if isinstance(raw_ports, list) else []:
        raw = _mapping(raw)
        port = _port(raw.get("port"))
        if port is None:
            continue
        protocol = str(raw["protocol"]) if raw.get("protocol") in ("TCP", "UDP", "SCTP") else "TCP"
        ports.append(ServicePortView(name=_text(raw.get("name"), 63) or "", protocol=protocol, port=port,
                                     node_port=_port(raw.get("nodePort"))))
        if len(ports) == MAX_PORTS:
            break
    affinity = "ClientIP" if spec.get("sessionAffinity") == "ClientIP" else "None"
    timeout = _mapping(_mapping(spec.get("sessionAffinityConfig")).get("clientIP")).get("timeoutSeconds")
    ingress = _mapping(status.get("loadBalancer")).get("ingress")
    lb_ips = _texts([_mapping(i).get("ip") for i in ingress[:MAX_LOAD_BALANCER_IPS]]
                    if isinstance(ingress, list) else [], MAX_LOAD_BALANCER_IPS)
    return ServiceView(
        namespace=namespace,
        name=name,
        type=str(spec["type"]) if spec.get("type") in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
        else "ClusterIP",
        cluster_ips=() if headless else cluster_ips,
        headless=headless,
        ports=tuple(ports),
        session_affinity=affinity,
        # kube-proxy's default for ClientIP affinity is 10800 s (3 h).
        affinity_timeout_seconds=(timeout if isinstance(timeout, int) and not isinstance(timeout, bool) else 10800)
        if affinity == "ClientIP" else None,
        internal_traffic_policy="Local" if spec.get("internalTrafficPolicy") == "Local" else "Cluster",
        external_traffic_policy="Local" if spec.get("externalTrafficPolicy") == "Local" else "Cluster",
        load_balancer_ips=lb_ips,
    )


def endpoints_from_slice(body: Mapping[str, Any]) -> list[EndpointView]:
    """The endpoints of one EndpointSlice; empty when the slice names no Service."""
    meta = _mapping(body.get("metadata"))
    namespace = _text(meta.get("namespace"), 63)
    service = _text(_mapping(meta.get("labels")).get(SERVICE_NAME_LABEL), 63)
    raw_endpoints = body.get("endpoints")
    if namespace is None or service is None or not isinstance(raw_endpoints, list):
        return []
    found = []
    for raw in raw_endpoints[:MAX_ENDPOINTS_PER_SLICE]:
        raw = _mapping(raw)
        addresses = _texts(raw.get("addresses"), 1)
        if not addresses:
            continue
        # The API: a nil ready is an unknown state, which consumers should read as ready.
        ready = _mapping(raw.get("conditions")).get("ready")
        found.append(EndpointView(
            service=f"{namespace}/{service}",
            address=addresses[0],
            ready=ready is not False,
            node_name=_text(raw.get("nodeName")),
            target=_text(_mapping(raw.get("targetRef")).get("name")) or _text(raw.get("hostname"), 63),
        ))
    return found


def endpoints_by_service(endpoints: Iterable[EndpointView]) -> dict[str, list[EndpointView]]:
    grouped: dict[str, list[EndpointView]] = {}
    for endpoint in endpoints:
        grouped.setdefault(endpoint.service, []).append(endpoint)
    return grouped


def cluster_ip_frontends(services: Iterable[ServiceView]) -> list[str]:
    """Every ClusterIP frontend of the cluster's Services ("198.19.0.10:80/TCP"), distinct and sorted: what a
    kube-proxy replacement's Service table must hold (a headless or ExternalName Service has none)."""
    return sorted({frontend_key(ip, port.port, port.protocol)
                   for service in services if not service.headless and service.type != "ExternalName"
                   for ip in service.cluster_ips for port in service.ports})
