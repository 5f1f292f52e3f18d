"""Hypothesis strategies shared by the behaviour tests: Services, endpoints, matrices."""

from __future__ import annotations

from hypothesis import strategies as st

from proxyshift.api.behaviour import AddressRole, BehaviourCell, BehaviourMatrix
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView

NODES = ["ps-node-1", "ps-node-2", "ps-node-3"]
NAMES = st.from_regex(r"\A[a-z]([a-z0-9-]{0,10}[a-z0-9])?\Z", fullmatch=True)
NAMESPACES = st.sampled_from(["default", "kube-system", "team-a", "team-b", "big"])
PORTS = st.builds(
    ServicePortView,
    name=st.just(""),
    protocol=st.sampled_from(["TCP", "UDP", "SCTP"]),
    port=st.integers(1, 65535),
    node_port=st.one_of(st.none(), st.integers(30000, 32767)),
)


@st.composite
def services(draw: st.DrawFn) -> ServiceView:
    headless = draw(st.booleans()) and draw(st.booleans())
    affinity = draw(st.sampled_from(["None", "None", "ClientIP"]))
    return ServiceView(
        namespace=draw(NAMESPACES),
        name=draw(NAMES),
        type=draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"])),
        cluster_ips=() if headless else (f"198.19.{draw(st.integers(0, 255))}.{draw(st.integers(1, 254))}",),
        headless=headless,
        ports=tuple(draw(st.lists(PORTS, min_size=0, max_size=3))),
        session_affinity=affinity,
        affinity_timeout_seconds=10800 if affinity == "ClientIP" else None,
        internal_traffic_policy=draw(st.sampled_from(["Cluster", "Cluster", "Local"])),
        external_traffic_policy=draw(st.sampled_from(["Cluster", "Cluster", "Local"])),
    )


@st.composite
def clusters(draw: st.DrawFn, max_services: int = 40) -> tuple[list[ServiceView], list[EndpointView]]:
    found = {s.key: s for s in draw(st.lists(services(), max_size=max_services))}
    endpoints = []
    for index, service in enumerate(found.values()):
        for n in range(draw(st.integers(0, 3))):
            endpoints.append(EndpointView(service=service.key, address=f"198.18.{1 + index % 200}.{n + 1}",
                                          ready=draw(st.booleans()) or draw(st.booleans()),
                                          node_name=draw(st.sampled_from([*NODES, None]))))
    return list(found.values()), endpoints


@st.composite
def cells(draw: st.DrawFn) -> BehaviourCell:
    role: AddressRole = draw(st.sampled_from(["clusterIP", "nodeIP", "otherAddress", "localhost"]))
    address = {"clusterIP": "198.19.0.10", "nodeIP": "198.18.0.11", "otherAddress": "198.18.200.11",
               "localhost": "127.0.0.1"}[role]
    answered = draw(st.booleans())
    return BehaviourCell(
        service=f"default/{draw(NAMES)}",
        kind=draw(st.sampled_from(["ClusterIP", "NodePort", "Affinity", "InternalLocal", "ExternalLocal",
                                   "NoEndpoints", "Named"])),
        protocol=draw(st.sampled_from(["TCP", "UDP"])),
        port=draw(st.integers(1, 65535)),
        address=address,
        address_role=role,
        path="node" if role == "localhost" else draw(st.sampled_from(["node", "pod"])),
        outcome="answered" if answered else draw(st.sampled_from(["refused", "timeout", "unreachable", "error"])),
        endpoints=draw(st.lists(st.sampled_from(["198.18.1.1", "198.18.1.2", "198.18.1.3"]), max_size=3,
                                unique=True)) if answered else [],
        sticky=draw(st.sampled_from([None, True, False])) if answered else None,
        local=draw(st.sampled_from([None, True, False])) if answered else None,
    )


@st.composite
def matrices(draw: st.DrawFn, mode: str = "iptables") -> BehaviourMatrix:
    found = {c.key: c for c in draw(st.lists(cells(), min_size=1, max_size=30))}
    return BehaviourMatrix(operation_id="before", mode=mode, cells=list(found.values()))
