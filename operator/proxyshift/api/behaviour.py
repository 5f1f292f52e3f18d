"""The Service-behaviour contract: what the operator asks a node to probe, and what the node answers.

A mode change can leave kube-proxy healthy and still change what users see (KEP-3866's list of
nftables differences, what leaving ipvs loses). So before the switch (with Preflight) and after it
(with the gate's Probe) the agent probes a bounded, deterministic sample of the cluster's Services
from the node's own network namespace (OUTPUT path) and, through the pod-network probe server on
the node, from a pod (PREROUTING path). Each answer is one `BehaviourCell`; the two matrices are
compared by `proxyshift.planner.behaviour`, which names every difference with a `ChangeName` the
policy may accept in `gate.behaviour.allowChanges`.

What is compared is reachability, stickiness and locality, never endpoint identities: those may
change across a restart (affinity state does not survive one).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field

from proxyshift.api.common import KubeModel

ServiceKind = Literal["ClusterIP", "NodePort", "Affinity", "InternalLocal", "ExternalLocal", "NoEndpoints", "Named"]
Protocol = Literal["TCP", "UDP"]
ProbePath = Literal["node", "pod"]
# Where a cell's address came from: a Service's ClusterIP, one of the node's own addresses that the
# Node object lists (nodeIP), another local address of the node (otherAddress: a second NIC, a VIP),
# or 127.0.0.1.
AddressRole = Literal["clusterIP", "nodeIP", "otherAddress", "localhost"]
Outcome = Literal["answered", "refused", "timeout", "unreachable", "error"]
BOTH_PATHS: tuple[ProbePath, ...] = ("node", "pod")
BOTH_PROTOCOLS: tuple[Protocol, ...] = ("TCP", "UDP")

# Named, documented behaviour differences a policy may accept (gate.behaviour.allowChanges).
# Each is one of KEP-3866's or the ipvs docs' known differences; docs/migration-guide.md lists them
# with the kube-proxy setting that keeps today's behaviour where one exists.
ChangeName = Literal[
    "LocalhostNodePorts",  # NodePorts on 127.0.0.1 stop answering (nftables never serves them)
    "NodePortAddresses",  # NodePorts on addresses other than the node's primary IPs stop answering
    "SessionAffinity",  # ClientIP stickiness differs (ipvs persistence vs iptables/nftables affinity)
    "TrafficPolicyLocal",  # Local traffic policy served from other nodes' endpoints, or not at all
    "NodePortFirewall",  # nftables opens no firewall holes for NodePorts
    "ConntrackInvalid",  # conntrack INVALID packets are no longer dropped (or now are)
    "IPVSScheduler",  # leaving ipvs loses the scheduler's balancing (rr, lc, sh, mh...)
    "StrictARP",  # ipvs binds Service addresses on kube-ipvs0; MetalLB needs strictARP
    "ForeignIPVSFlush",  # an nftables kube-proxy deletes every IPVS virtual server, a user's too
    "SocketLoadBalancing",  # Cilium KPR translates at connect(): no per-packet DNAT, no Service IP on the wire
]
CHANGE_NAMES: tuple[ChangeName, ...] = get_args(ChangeName)

MAX_TARGETS = 48
MAX_CELLS = 128
MAX_ATTEMPTS = 8
MAX_IDENTITIES = 8
MAX_LOCAL_ENDPOINTS = 32
IDENTITY_MAX_LENGTH = 64


class BehaviourTarget(KubeModel):
    """One Service port the agent should try, chosen by the operator from Services and EndpointSlices."""

    service: str = Field(max_length=127, description="namespace/name of the Service.")
    kind: ServiceKind = Field(description="Why it is in the sample: the Service kind it stands for.")
    protocol: Protocol = Field(default="TCP", description="TCP or UDP.")
    port: int = Field(ge=1, le=65535, description="Port to dial: the Service port, or the nodePort.")
    address: str | None = Field(
        default=None,
        max_length=45,
        description="Address to dial (a ClusterIP). Unset for a NodePort: the agent dials the port on each of "
        "the node's own addresses and on 127.0.0.1 (node path only).",
    )
    attempts: int = Field(
        default=1, ge=1, le=MAX_ATTEMPTS,
        description="Connections from one source port range in a row; more than 1 judges ClientIP stickiness.",
    )
    local_endpoints: list[str] | None = Field(
        default=None,
        max_length=MAX_LOCAL_ENDPOINTS,
        description="Endpoint addresses on this node (Local traffic policies): every answer must come from "
        "one of them. Unset: locality is not judged.",
    )
    paths: list[ProbePath] = Field(default_factory=lambda: list(BOTH_PATHS), max_length=2,
                                   description="node (the node's own namespace), pod (from a pod on the node).")


class BehaviourParams(KubeModel):
    """Operation params of a behaviour probe (Preflight's `behaviour`, Probe's `behaviour`)."""

    targets: list[BehaviourTarget] = Field(default_factory=list, max_length=MAX_TARGETS,
                                           description="The sample, in the order to probe it.")
    node_ips: list[str] = Field(
        default_factory=list, max_length=8,
        description="The Node object's InternalIP/ExternalIP addresses: a local address in this list is a "
        "nodeIP cell, any other one an otherAddress cell.",
    )
    pod_probe: str | None = Field(
        default=None, max_length=64,
        description="ip:port of the pod-network probe server on this node; unset: no pod path this time.",
    )
    attempt_timeout_seconds: float = Field(default=0.25, gt=0, le=5, description="Per connection attempt.")
    budget_seconds: float = Field(default=1.0, gt=0, le=30, description="The whole probe, both paths.")


class BehaviourCell(KubeModel):
    """How one (service, address, port, protocol, path) answered."""

    service: str = Field(max_length=127, description="namespace/name of the Service.")
    kind: ServiceKind = Field(description="The Service kind the cell stands for.")
    protocol: Protocol = Field(description="TCP or UDP.")
    port: int = Field(ge=1, le=65535, description="Port dialled.")
    address: str = Field(max_length=45, description="Address dialled.")
    address_role: AddressRole = Field(description="clusterIP, nodeIP, otherAddress or localhost.")
    path: ProbePath = Field(description="node or pod.")
    outcome: Outcome = Field(description="answered, refused, timeout, unreachable or error.")
    endpoints: list[Annotated[str, Field(max_length=IDENTITY_MAX_LENGTH)]] = Field(
        default_factory=list, max_length=MAX_IDENTITIES,
        description="Endpoint identities that answered: the endpoint address the kernel NATed to, or the first "
        "line the endpoint sent.",
    )
    sticky: bool | None = Field(default=None, description="All attempts reached one endpoint (attempts > 1).")
    local: bool | None = Field(default=None, description="Every answer came from a local endpoint (when judged).")
    detail: str = Field(default="", max_length=200, description="Why it failed, for a person.")

    @property
    def key(self) -> tuple[str, str, str, int, str, str]:
        """Cells before and after are matched on this; the address role keeps a renumbered node comparable."""
        return (self.service, self.address_role, self.address, self.port, self.protocol, self.path)


class BehaviourMatrix(KubeModel):
    """One probe's answers, as the agent wrote them to ProxyNode.status.behaviour."""

    operation_id: str = Field(max_length=253, description="The operation that took it.")
    mode: str | None = Field(default=None, max_length=16, description="kube-proxy's /proxyMode when it was taken.")
    taken_at: str | None = Field(default=None, max_length=40, description="RFC 3339.")
    duration_seconds: float | None = Field(default=None, ge=0, description="How long the probe took.")
    cells: list[BehaviourCell] = Field(default_factory=list, max_length=MAX_CELLS, description="The answers.")
    truncated: bool = Field(default=False, description="The budget ran out before every target was probed.")
    pod_path_error: str | None = Field(
        default=None, max_length=200, description="Why the pod path could not be probed, if it could not."
    )


class NodeBehaviour(KubeModel):
    """The two matrices a migration compares. Written by the agent."""

    before: BehaviourMatrix | None = Field(default=None, description="Taken with the Preflight, before the switch.")
    after: BehaviourMatrix | None = Field(default=None, description="Taken with the latest gate Probe.")


class BehaviourChange(KubeModel):
    """One difference between before and after, as the gate and the policy's conditions report it."""

    name: ChangeName | Literal["Reachability"] = Field(
        description="The documented change it is, or Reachability for any other cell that stopped answering "
        "(never allowed by name: turn the probe off or fix the Service)."
    )
    service: str = Field(max_length=127, description="namespace/name of the Service it was seen on.")
    message: str = Field(max_length=400, description="What changed and what keeps today's behaviour.")


MAX_SERVICE_ADDRESSES = 256
MAX_NODE_PORTS = 256
MAX_CONNTRACK_DELETIONS = 512
MAX_REPORTED_ENTRIES = 16


class ConntrackParams(KubeModel):
    """Probe's `conntrack`: which destinations are Service addresses, for the post-switch conntrack step.

    Only entries whose original destination is one of these and that carry no DNAT (reply source equals
    original destination) are deleted: TCP in SYN_SENT, UDP unreplied.
    """

    service_cidrs: list[str] = Field(default_factory=list, max_length=4,
                                     description="The cluster's Service CIDRs (ClusterIP ranges).")
    service_ips: list[str] = Field(
        default_factory=list, max_length=MAX_SERVICE_ADDRESSES,
        description="Further Service addresses outside the CIDRs: externalIPs, LoadBalancer ingress IPs.",
    )
    node_ports: list[int] = Field(
        default_factory=list, max_length=MAX_NODE_PORTS,
        description="NodePorts in use; an entry to one of them on a local address of the node counts too.",
    )
    protocols: list[Protocol] = Field(default_factory=lambda: list(BOTH_PROTOCOLS), max_length=2,
                                      description="TCP (SYN_SENT entries), UDP (unreplied entries).")
    max_deletions: int = Field(default=MAX_CONNTRACK_DELETIONS, ge=1, le=MAX_CONNTRACK_DELETIONS,
                               description="At most this many entries are deleted in one step.")


class ConntrackReport(KubeModel):
    """What the conntrack step did; the agent puts it in the Probe's details as `conntrack`."""

    scanned: int = Field(default=0, ge=0, description="Entries to Service destinations looked at.")
    deleted_tcp: int = Field(default=0, ge=0, description="Un-NATed TCP SYN_SENT entries deleted.")
    deleted_udp: int = Field(default=0, ge=0, description="Un-NATed unreplied UDP entries deleted.")
    entries: list[str] = Field(default_factory=list, max_length=MAX_REPORTED_ENTRIES,
                               description="The first deleted entries, as 'tcp SRC:PORT -> DST:PORT'.")
    truncated: bool = Field(default=False, description="More entries matched than maxDeletions allowed.")
    error: str | None = Field(default=None, max_length=300, description="Why the step failed, if it did.")
