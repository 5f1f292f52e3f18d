"""Test workloads for every Service kind the behaviour gate judges (issue 13), in namespace ps-behaviour.

    from localcluster import behaviour_workloads
    made = behaviour_workloads.create(state_dir, kubeconfig)        # or: localcluster workloads --behaviour
    made.service("nodeport-tcp").node_port                          # 30080
    made.local_endpoints("internal-local", "ps-node-1")             # the names of its endpoints there

Every endpoint is a real listener in its own namespace on the bridge (listener.py) that
answers with its own name, TCP on 8080 and UDP on 5353, so which endpoint answered is
observable. Endpoints are "on" a node only through their EndpointSlice entry's
`nodeName`: kube-proxy's Local policies choose by that field, and the bridge makes every
endpoint reachable from every node, so locality is kube-proxy's doing, nothing else's.
Placement: endpoint j is on node j mod (N-1) for N > 1 nodes, so the last node has no
endpoint at all (the case Local policies DROP on); with one node every endpoint is on it.

Services (selector-less, like workloads.py; each with one EndpointSlice `<name>-1`
whose entries carry nodeName, hostname and a Pod targetRef named after the endpoint):

| name | what |
|---|---|
| clusterip-tcp | ClusterIP, TCP 80 -> 8080, every endpoint |
| clusterip-udp | ClusterIP, UDP 53 -> 5353 (request/response, DNS-like), every endpoint |
| nodeport-tcp | NodePort 30080, TCP 80 -> 8080, externalTrafficPolicy Cluster |
| affinity | ClusterIP, sessionAffinity ClientIP (timeout 60 s), every endpoint |
| internal-local | ClusterIP, internalTrafficPolicy Local |
| external-local | NodePort 30081, externalTrafficPolicy Local |
| not-ready | ClusterIP whose only endpoint is ready=false, serving=false |
| no-endpoints | ClusterIP with no EndpointSlice at all |
| headless | clusterIP None, every endpoint |

What kube-proxy (1.37, iptables mode) does with them, read in pkg/proxy/iptables/proxier.go:
a Service with no usable endpoint gets a filter REJECT (connection refused); a Local
internal policy on a node with no local endpoint gets a filter DROP (timeout); an
external Local policy is bypassed for traffic from the node itself (src-type LOCAL) and
from pods (the clusterCIDR, 198.18.0.0/16, which covers every client address of this cluster),
which go to every endpoint: only a client outside the clusterCIDR would see locality.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from localcluster import network, podnet, workloads
from localcluster.kubeapi import Kube, KubeError
from proxyshift.api.behaviour import Outcome, ProbePath, Protocol, ServiceKind

NAMESPACE = "ps-behaviour"
ENDPOINT_COUNT = 4
TCP_PORT = 80
TCP_TARGET_PORT = 8080
UDP_PORT = 53
UDP_TARGET_PORT = 5353
NODE_PORT = 30080
LOCAL_NODE_PORT = 30081
AFFINITY_TIMEOUT_SECONDS = 60
MANAGED_BY = workloads.MANAGED_BY

TrafficPolicy = Literal["Cluster", "Local"]
ProxyMode = Literal["iptables", "nftables"]
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class BehaviourNode:
    """A node as the behaviour probes see it: its addresses and its pod namespace."""

    name: str
    ip: str  # the InternalIP the Node object lists
    second_address: str  # local to the node, not in the Node object
    pod_netns: str
    pod_ip: str


@dataclass(frozen=True)
class BehaviourEndpoint:
    name: str  # its namespace and what it answers
    ip: str
    node: str  # the nodeName its EndpointSlice entries carry
    tcp_port: int
    udp_port: int


@dataclass(frozen=True)
class BehaviourService:
    name: str
    namespace: str
    kind: ServiceKind | None  # what it stands for in a behaviour sample; None: not probed (headless)
    protocol: Protocol
    port: int
    target_port: int
    cluster_ip: str | None  # None for headless
    node_port: int | None
    endpoints: tuple[str, ...]  # endpoint names in its EndpointSlice
    ready: bool  # its endpoints are ready
    session_affinity_seconds: int | None = None
    internal_traffic_policy: TrafficPolicy = "Cluster"
    external_traffic_policy: TrafficPolicy | None = None  # NodePorts only

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class BehaviourWorkloads:
    """What `create` made: nodes, endpoints (and where they are), Services."""

    namespace: str
    nodes: tuple[BehaviourNode, ...]
    endpoints: tuple[BehaviourEndpoint, ...]
    services: tuple[BehaviourService, ...]

    def service(self, name: str) -> BehaviourService:
        for svc in self.services:
            if svc.name == name:
                return svc
        raise KeyError(f"no behaviour Service {name!r}; have {[s.name for s in self.services]}")

    def endpoint(self, name: str) -> BehaviourEndpoint:
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(name)

    def node(self, name: str) -> BehaviourNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def local_endpoints(self, service: str, node: str) -> tuple[str, ...]:
        """Names of the Service's endpoints whose EndpointSlice entry says they are on `node`."""
        return tuple(e for e in self.service(service).endpoints if self.endpoint(e).node == node)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace,
                "nodes": [vars(n) for n in self.nodes],
                "endpoints": [vars(e) for e in self.endpoints],
                "services": [vars(s) for s in self.services]}


def behaviour_node(name: str) -> BehaviourNode:
    index = network.node_index(name)
    return BehaviourNode(name, network.node_ip(index), podnet.second_address(index), podnet.pod_netns(name),
                         podnet.pod_ip(index))


def placement(endpoints: list[str], nodes: list[str]) -> dict[str, str]:
    """Endpoint name -> node name: round robin over every node but the last (which gets none)."""
    if not nodes:
        raise ValueError("behaviour workloads need at least one node")
    hosts = nodes[:-1] or nodes
    return {ep: hosts[j % len(hosts)] for j, ep in enumerate(endpoints)}


def _service_spec(svc: BehaviourService) -> dict[str, Any]:
    port: dict[str, Any] = {"name": svc.protocol.lower(), "port": svc.port, "targetPort": svc.target_port,
                            "protocol": svc.protocol}
    spec: dict[str, Any] = {"type": "NodePort" if svc.node_port else "ClusterIP", "ports": [port],
                            "internalTrafficPolicy": svc.internal_traffic_policy}
    if svc.node_port:
        port["nodePort"] = svc.node_port
        spec["externalTrafficPolicy"] = svc.external_traffic_policy or "Cluster"
    if svc.cluster_ip == "None":
        spec["clusterIP"] = "None"
    if svc.session_affinity_seconds:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": svc.session_affinity_seconds}}
    return spec


def service_manifest(svc: BehaviourService) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc.name, "namespace": svc.namespace,
                         "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
            "spec": _service_spec(svc)}


def slice_manifest(svc: BehaviourService, endpoints: dict[str, BehaviourEndpoint]) -> dict[str, Any]:
    ready = svc.ready
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{svc.name}-1", "namespace": svc.namespace,
                         "labels": {"kubernetes.io/service-name": svc.name,
                                    "endpointslice.kubernetes.io/managed-by": MANAGED_BY}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [endpoints[name].ip], "nodeName": endpoints[name].node,
                           "hostname": name,
                           "targetRef": {"kind": "Pod", "namespace": svc.namespace, "name": name},
                           "conditions": {"ready": ready, "serving": ready, "terminating": False}}
                          for name in svc.endpoints],
            "ports": [{"name": svc.protocol.lower(), "port": svc.target_port, "protocol": svc.protocol}]}


def plan_services(endpoints: list[str], namespace: str = NAMESPACE) -> list[BehaviourService]:
    """The Services to make over these endpoints (ClusterIPs still unknown: None until created)."""
    if len(endpoints) < 2:
        raise ValueError("behaviour workloads need at least two endpoints (ClientIP affinity)")
    every = tuple(endpoints)

    def tcp(name: str, kind: ServiceKind | None, **extra: Any) -> BehaviourService:
        fields: dict[str, Any] = {"protocol": "TCP", "port": TCP_PORT, "target_port": TCP_TARGET_PORT,
                                  "cluster_ip": None, "node_port": None, "endpoints": every, "ready": True}
        fields.update(extra)
        return BehaviourService(name=name, namespace=namespace, kind=kind, **fields)

    return [
        tcp("clusterip-tcp", "ClusterIP"),
        BehaviourService("clusterip-udp", namespace, "ClusterIP", "UDP", UDP_PORT, UDP_TARGET_PORT, None, None,
                         every, True),
        tcp("nodeport-tcp", "NodePort", node_port=NODE_PORT, external_traffic_policy="Cluster"),
        tcp("affinity", "Affinity", session_affinity_seconds=AFFINITY_TIMEOUT_SECONDS),
        tcp("internal-local", "InternalLocal", internal_traffic_policy="Local"),
        tcp("external-local", "ExternalLocal", node_port=LOCAL_NODE_PORT, external_traffic_policy="Local"),
        tcp("not-ready", "NoEndpoints", endpoints=every[:1], ready=False),
        tcp("no-endpoints", "NoEndpoints", endpoints=()),
        tcp("headless", None, cluster_ip="None"),
    ]


def _served_endpoints(state_dir: Path) -> set[int]:
    """Endpoint numbers a live listener process serves (listeners are named listener-<first>-<last>)."""
    from localcluster import state

    served: set[int] = set()
    for record in state.running(state_dir):
        first, _, last = str(record["name"]).removeprefix("listener-").partition("-")
        if record["alive"] and str(record["name"]).startswith("listener-") and first.isdigit() and last.isdigit():
            served.update(range(int(first), int(last) + 1))
    return served


def _existing_endpoints(state_dir: Path, kube: Kube, namespace: str) -> list[str] | None:
    """The endpoints of an earlier `create`, if their namespaces and listener still live (re-runs add nothing)."""
    body = kube.get_or_none(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/clusterip-tcp-1")
    if not body:
        return None
    names = [(e.get("targetRef") or {}).get("name", "") for e in body.get("endpoints") or []]
    alive, served = set(network.endpoint_namespaces()), _served_endpoints(state_dir)
    if names and all(n in alive and int(n[len(network.ENDPOINT_PREFIX):]) in served for n in names):
        return names
    return None


def _node_names(kube: Kube) -> list[str]:
    names = [n["metadata"]["name"] for n in kube.get("/api/v1/nodes")["items"]]
    return sorted((n for n in names if n.startswith(network.NODE_PREFIX)), key=network.node_index)


def _apply(kube: Kube, svc: BehaviourService, endpoints: dict[str, BehaviourEndpoint]) -> BehaviourService:
    base = f"/api/v1/namespaces/{svc.namespace}/services"
    # Look first: a second POST of a fixed nodePort fails validation (422) before the name clash (409).
    if kube.get_or_none(f"{base}/{svc.name}") is not None:
        made = kube.merge_patch(f"{base}/{svc.name}", {"spec": _service_spec(svc)})
    else:
        made = kube.post(base, service_manifest(svc))
    if svc.endpoints:
        slices = f"/apis/discovery.k8s.io/v1/namespaces/{svc.namespace}/endpointslices"
        body = slice_manifest(svc, endpoints)
        try:
            kube.post(slices, body)
        except KubeError as exc:
            if exc.status != 409:
                raise
            kube.merge_patch(f"{slices}/{svc.name}-1", body)
    cluster_ip = made["spec"].get("clusterIP")
    node_port = made["spec"]["ports"][0].get("nodePort") if svc.node_port else None
    return BehaviourService(**{**vars(svc), "cluster_ip": cluster_ip, "node_port": node_port})


def create(state_dir: Path, kube: Kube | Path | str, *, nodes: list[str] | None = None,
           namespace: str = NAMESPACE, endpoint_count: int = ENDPOINT_COUNT) -> BehaviourWorkloads:
    """Make (or find) the endpoints and Services above; idempotent. `nodes`: default every ps-node-* Node."""
    client = kube if isinstance(kube, Kube) else Kube(kube, pool_size=16)
    workloads.ensure_namespace(client, namespace)
    node_names = nodes if nodes is not None else _node_names(client)
    names = _existing_endpoints(Path(state_dir), client, namespace)
    if names is None:
        made = workloads.create_endpoints(Path(state_dir), endpoint_count, ports=(TCP_TARGET_PORT,),
                                          udp_ports=(UDP_TARGET_PORT,))
        names = [e.name for e in made]
    where = placement(names, node_names)
    endpoints = {n: BehaviourEndpoint(n, network.endpoint_ip(int(n[len(network.ENDPOINT_PREFIX):])), where[n],
                                      TCP_TARGET_PORT, UDP_TARGET_PORT) for n in names}
    planned = plan_services(names, namespace)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(planned)) as pool:
        services = list(pool.map(lambda svc: _apply(client, svc, endpoints), planned))
    return BehaviourWorkloads(namespace, tuple(behaviour_node(n) for n in node_names),
                              tuple(endpoints[n] for n in names), tuple(services))


def expected_outcome(made: BehaviourWorkloads, service: str, node: str, path: ProbePath, address: str,
                     mode: ProxyMode = "iptables") -> tuple[Outcome, frozenset[str]]:
    """What kube-proxy 1.37 does with one cell here, with the baseline's settings (nodePortAddresses and
    localhostNodePorts unset): the outcome, and the endpoints allowed to answer.

    A test oracle for this bed only (every client address is inside the clusterCIDR, so an
    external Local policy is always short-circuited), seen in tests/e2e/test_behaviour_workloads.py.
    """
    svc, where = made.service(service), made.node(node)
    if svc.kind == "NoEndpoints":
        return "refused", frozenset()  # filter REJECT: "has no endpoints"
    if address == svc.cluster_ip:
        if svc.internal_traffic_policy == "Local":
            local = frozenset(made.local_endpoints(service, node))
            return ("answered", local) if local else ("timeout", frozenset())  # DROP: "has no local endpoints"
        return "answered", frozenset(svc.endpoints)
    if svc.node_port is None or address not in (where.ip, where.second_address, LOCALHOST):
        raise ValueError(f"{address} is neither {service}'s ClusterIP nor one of {node}'s NodePort addresses")
    if path == "pod" and address == LOCALHOST:
        raise ValueError("127.0.0.1 in a pod is the pod's own loopback")
    if mode == "nftables" and address != where.ip:
        return "refused", frozenset()  # only the Node's primary IPs; never 127.0.0.1
    return "answered", frozenset(svc.endpoints)


def delete(kube: Kube | Path | str, namespace: str = NAMESPACE) -> None:
    """Remove the Services and their EndpointSlices (the endpoint namespaces go with `localcluster down`)."""
    client = kube if isinstance(kube, Kube) else Kube(kube, pool_size=16)
    for svc in plan_services(["a", "b"], namespace):
        for path in (f"/api/v1/namespaces/{namespace}/services/{svc.name}",
                     f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{svc.name}-1"):
            try:
                client.delete(path)
            except KubeError as exc:
                if exc.status != 404:
                    raise
