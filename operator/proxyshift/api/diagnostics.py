"""The diagnostics contract: which Services a node should read the kernel's counters for, and its answer.

`proxyshift diagnose service NS/NAME` (or the operator around a migration) writes a
`DiagnoseRequest` to `ProxyNode.spec.diagnose`; the node's agent answers once per id in
`ProxyNode.status.diagnostics` with what the kernel itself counted: the packet counters of
kube-proxy's iptables rules, `ipvsadm --stats`, and conntrack entries by endpoint (the only
per-endpoint source in nftables mode, whose rules keep no counters). The verdict on uneven load is
pure and lives in `proxyshift.planner.diagnosis`.

A separate field rather than an operation: spec.operation belongs to the migration's state machine,
and a person asking why a Service is uneven must never displace a Preflight or a Cleanup.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from proxyshift.api.common import KubeModel

MAX_DIAGNOSE_SERVICES = 8
MAX_SERVICE_PORTS = 16
MAX_ENDPOINTS = 64
MAX_RULES = 32
MAX_ERRORS = 4

CounterSource = Literal["iptables", "ipvs", "conntrack", "none"]
Address = Annotated[str, Field(max_length=64)]  # ip, ip:port or [v6]:port
RuleText = Annotated[str, Field(max_length=96)]
ErrorText = Annotated[str, Field(max_length=200)]


class DiagnosePort(KubeModel):
    """One port of the Service, as the Service object lists it."""

    name: str = Field(default="", max_length=63, description="The port's name (kube-proxy's rule comments use it).")
    port: int = Field(ge=1, le=65535, description="The Service port.")
    protocol: Literal["TCP", "UDP", "SCTP"] = Field(default="TCP", description="TCP, UDP or SCTP.")
    node_port: int | None = Field(default=None, ge=1, le=65535, description="The nodePort, if it has one.")


class DiagnoseService(KubeModel):
    """What the node needs to find one Service's rules and flows."""

    namespace: str = Field(max_length=63, description="The Service's namespace.")
    name: str = Field(max_length=63, description="The Service's name.")
    cluster_ips: list[Address] = Field(default_factory=list, max_length=2, alias="clusterIPs",
                                   description="The Service's ClusterIPs (one per family).")
    ports: list[DiagnosePort] = Field(default_factory=list, max_length=MAX_SERVICE_PORTS,
                                      description="The Service's ports.")
    endpoints: list[Address] = Field(
        default_factory=list, max_length=MAX_ENDPOINTS,
        description="Endpoints from the EndpointSlices, ready or not, as ip:port (ip alone when the slice "
        "names no port): conntrack entries are counted for these.",
    )

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class DiagnoseRequest(KubeModel):
    """spec.diagnose: read the kernel's counters for these Services, once per id."""

    id: str = Field(max_length=253, description="Unique id; the agent answers each id once in status.diagnostics.")
    services: list[DiagnoseService] = Field(default_factory=list, max_length=MAX_DIAGNOSE_SERVICES,
                                            description="The Services to read.")
    requested_at: str | None = Field(default=None, max_length=40, description="RFC 3339.")
    record: Literal["before", "after"] | None = Field(
        default=None,
        description="Set by the operator around a migration: the answer goes to status.distribution.before or "
        ".after (kept for proxyshift status) instead of status.diagnostics.",
    )


class EndpointCounters(KubeModel):
    """What the kernel counted for one endpoint of one Service on this node."""

    address: str = Field(max_length=64, description="ip:port of the endpoint (ip alone when the port is unknown).")
    flows: int | None = Field(
        default=None, ge=0,
        description="New flows sent to it: packets of its DNAT rule (the nat table sees only a flow's first "
        "packet) in iptables mode, the real server's Conns in ipvs mode.",
    )
    packets: int | None = Field(default=None, ge=0, description="ipvs InPkts of the real server.")
    weight: int | None = Field(default=None, ge=0, description="ipvs weight of the real server.")
    conntrack_entries: int = Field(default=0, ge=0, description="conntrack entries to it now, any state.")
    conntrack_established: int = Field(default=0, ge=0, description="Of those, TCP ESTABLISHED (or assured UDP).")


class ServiceCounters(KubeModel):
    """One Service as this node's kernel sees it."""

    service: str = Field(max_length=127, description="namespace/name.")
    source: CounterSource = Field(
        description="Where `flows` came from: iptables rule counters, ipvs stats, or conntrack alone "
        "(nftables mode keeps no per-endpoint counters), none if nothing was found."
    )
    rules: list[RuleText] = Field(
        default_factory=list, max_length=MAX_RULES,
        description="The Service's kube-proxy chains with their rule counts, or its IPVS virtual servers.",
    )
    scheduler: str | None = Field(default=None, max_length=16, description="IPVS scheduler (ipvs mode).")
    persistence_seconds: int | None = Field(default=None, ge=0,
                                            description="IPVS persistence (ClientIP affinity in ipvs mode).")
    endpoints: list[EndpointCounters] = Field(default_factory=list, max_length=MAX_ENDPOINTS,
                                              description="Per endpoint.")
    errors: list[ErrorText] = Field(default_factory=list, max_length=MAX_ERRORS,
                              description="What could not be read, for a person.")
    truncated: bool = Field(default=False, description="Output was larger than the agent reads; counts are partial.")


class NodeDiagnostics(KubeModel):
    """status.diagnostics: the answer to spec.diagnose with the same id. Written by the agent."""

    id: str = Field(max_length=253, description="The request it answers.")
    taken_at: str | None = Field(default=None, max_length=40, description="RFC 3339.")
    mode: str | None = Field(default=None, max_length=16, description="kube-proxy's /proxyMode when it was taken.")
    duration_seconds: float | None = Field(default=None, ge=0, description="How long reading took.")
    services: list[ServiceCounters] = Field(default_factory=list, max_length=MAX_DIAGNOSE_SERVICES,
                                            description="Per Service.")
    error: str | None = Field(default=None, max_length=400, description="Why the request could not be served.")


class NodeDistribution(KubeModel):
    """status.distribution: the node's counters recorded before and after its migration. Written by the agent."""

    before: NodeDiagnostics | None = Field(default=None, description="Recorded with the migration's Preflight.")
    after: NodeDiagnostics | None = Field(default=None, description="Recorded once the node runs the target mode.")
