"""What crosses the operator-agent contract about a kube-proxy replacement (Cilium's KPR, issue 19), and the
typed reading of the Cilium agent's own REST answers.

Operator -> agent: `ReplacementParams` (in a Preflight's and a Probe's params): where the replacement's API is
on the node and which Service frontends its table must hold. Agent -> operator: `ReplacementFacts`
(ProxyNode.status.replacement): what Cilium's /v1/healthz, /v1/service and /v1/endpoint said, bounded.

The Cilium side (`CiliumHealth`, `CiliumService`, `CiliumEndpoint`) reads only the fields proxyshift judges, from
Cilium v1.20's API (api/v1/openapi.yaml: StatusResponse, Service, Endpoint); every other field is ignored, so a
newer Cilium's additions are no error.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from proxyshift.api.common import KubeModel

# Cilium's host endpoint: the reserved identity 1 with the label reserved:host (pkg/identity, pkg/labels).
HOST_IDENTITY_ID = 1
HOST_LABEL = "reserved:host"
HOST_ENDPOINT_READY = "ready"
HOST_ENDPOINT_ABSENT = "absent"
MAX_FRONTENDS = 64  # the frontends one probe asks about
MAX_MISSING = 16  # the missing ones the agent names (it counts them all)
FRONTEND_TEXT_LIMIT = 64  # "198.19.0.10:80/TCP", "[fd00::a]:65535/SCTP"
REPLACEMENT_TEXT_LIMIT = 256
REPLACEMENT_MESSAGE_LIMIT = 1024


def frontend_key(ip: str, port: int, protocol: str) -> str:
    """One Service frontend as both sides write it: "198.19.0.10:80/TCP", "[fd00::a]:53/UDP"."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"{host}:{port}/{protocol.upper()}"


class ReplacementParams(KubeModel):
    """What the agent reads of the node's kube-proxy replacement, and the Service frontends it must serve."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    socket_path: str = Field(max_length=107, description="The replacement agent's REST API socket on the node.")
    frontends: list[Annotated[str, Field(max_length=FRONTEND_TEXT_LIMIT)]] = Field(
        default_factory=list, max_length=MAX_FRONTENDS,
        description="ClusterIP frontends (ip:port/PROTOCOL) its Service table must hold: the gate's sample.")
    expected_frontends: int = Field(
        default=0, ge=0, description="How many ClusterIP frontends the cluster's Services have in all: the table "
        "must hold at least as many.")


class ReplacementFacts(KubeModel):
    """The node's kube-proxy replacement as its own API describes it (Cilium: /v1/healthz and /v1/service)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    agent_state: str | None = Field(default=None, max_length=REPLACEMENT_TEXT_LIMIT,
                                    description="The agent's own state (Cilium: Ok, Warning, Failure, Disabled).")
    agent_message: str | None = Field(default=None, max_length=REPLACEMENT_MESSAGE_LIMIT,
                                      description="The agent's message with its state, if any.")
    kube_proxy_replacement: str | None = Field(
        default=None, max_length=REPLACEMENT_TEXT_LIMIT,
        description="The replacement's mode as the agent reports it (Cilium: True or False).")
    enabled: bool = Field(default=False, description="The agent replaces kube-proxy on this node.")
    cluster_ip_frontends: int | None = Field(
        default=None, ge=0, description="ClusterIP frontends in the agent's Service table (None: not read).")
    missing: list[Annotated[str, Field(max_length=FRONTEND_TEXT_LIMIT)]] = Field(
        default_factory=list, max_length=MAX_MISSING,
        description="Frontends the operator asked about that the table does not hold (the first of them).")
    missing_count: int = Field(default=0, ge=0, description="How many of the asked frontends are missing.")
    host_endpoint: str | None = Field(
        default=None, max_length=REPLACEMENT_TEXT_LIMIT,
        description="The state of the agent's host endpoint (Cilium: reserved:host in /v1/endpoint): 'ready' once "
        "its host datapath is loaded, 'absent' when it lists none. Unset: not read (an agent older than this "
        "field does not report it, and the gate then does not judge it).")
    error: str | None = Field(default=None, max_length=REPLACEMENT_MESSAGE_LIMIT,
                              description="Why the agent's API could not be read, if it could not.")
    probed_at: str | None = Field(default=None, max_length=REPLACEMENT_TEXT_LIMIT,
                                  description="When it was read (RFC 3339).")

    def proves(self, expected_frontends: int) -> bool:
        """Everything the replacement gate asks of the replacement itself (planner/gate.py): read without
        error, Ok, replacing kube-proxy, every asked frontend and as many as the cluster has in its table, its
        host endpoint ready (or not reported). The agent waits on the node until this holds."""
        return (self.error is None and self.agent_state == "Ok" and self.enabled
                and self.cluster_ip_frontends is not None and self.cluster_ip_frontends >= expected_frontends
                and self.missing_count == 0 and self.host_endpoint in (None, HOST_ENDPOINT_READY))


# ---- the Cilium agent's answers, read (not part of proxyshift's wire) ----

class _CiliumModel(BaseModel):
    # Cilium's JSON keys are kebab-case; anything proxyshift does not judge is ignored.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class CiliumState(_CiliumModel):
    state: str | None = None
    msg: str | None = None


class CiliumKubeProxyReplacement(_CiliumModel):
    # "True" or "False" since Cilium 1.14 ("Strict", "Partial", "Disabled" before).
    mode: str | None = None


class CiliumHealth(_CiliumModel):
    """The part of GET /v1/healthz (a StatusResponse) the gate judges."""

    cilium: CiliumState | None = None
    kube_proxy_replacement: CiliumKubeProxyReplacement | None = Field(default=None, alias="kube-proxy-replacement")

    @property
    def enabled(self) -> bool:
        mode = (self.kube_proxy_replacement.mode if self.kube_proxy_replacement else None) or ""
        # "Strict" is how Cilium before 1.14 said what "True" says now.
        return mode.lower() in ("true", "strict")


class CiliumFrontendAddress(_CiliumModel):
    ip: str | None = None
    port: int | None = None
    protocol: str | None = None


class CiliumServiceFlags(_CiliumModel):
    type: str | None = None
    name: str | None = None
    namespace: str | None = None


class CiliumServiceSpec(_CiliumModel):
    frontend_address: CiliumFrontendAddress | None = Field(default=None, alias="frontend-address")
    backend_addresses: list[dict[str, object]] | None = Field(default=None, alias="backend-addresses")
    flags: CiliumServiceFlags | None = None


class CiliumService(_CiliumModel):
    """One entry of GET /v1/service: a frontend and its backends."""

    spec: CiliumServiceSpec | None = None

    @property
    def cluster_ip_frontends(self) -> tuple[str, ...]:
        """"ip:port/PROTO" of a ClusterIP frontend with an address; none for NodePort, LoadBalancer, ... entries.
        Cilium writes protocol ANY for a frontend that serves every protocol: it covers TCP and UDP."""
        spec = self.spec
        if spec is None or spec.flags is None or spec.flags.type != "ClusterIP" or spec.frontend_address is None:
            return ()
        address = spec.frontend_address
        if not address.ip or address.port is None:
            return ()
        protocol = (address.protocol or "TCP").upper()
        protocols = ("TCP", "UDP") if protocol == "ANY" else (protocol,)
        return tuple(frontend_key(address.ip, address.port, p) for p in protocols)


class CiliumIdentity(_CiliumModel):
    id: int | None = None
    labels: list[str] | None = None


class CiliumEndpointStatus(_CiliumModel):
    state: str | None = None
    identity: CiliumIdentity | None = None


class CiliumEndpoint(_CiliumModel):
    """One entry of GET /v1/endpoint: its state and security identity."""

    id: int | None = None
    status: CiliumEndpointStatus | None = None

    @property
    def is_host(self) -> bool:
        """The node's own endpoint, whose datapath (bpf_host on the node's devices) Cilium loads at its start."""
        identity = self.status.identity if self.status else None
        if identity is None:
            return False
        return identity.id == HOST_IDENTITY_ID or HOST_LABEL in (identity.labels or ())


def host_endpoint_state(endpoints: list[CiliumEndpoint]) -> str:
    """The host endpoint's state ('ready', 'regenerating', ...), or 'absent' when the list has none."""
    for endpoint in endpoints:
        if endpoint.is_host:
            return (endpoint.status.state if endpoint.status else None) or "unknown"
    return HOST_ENDPOINT_ABSENT
