"""The ProxyNode API: one per Node, the channel between operator and agent.

spec is written only by the operator (what the node should run, the step it
is in, the operation the agent should perform); status only by the node's own
agent (what is really there). `kubectl get proxynodes` is the fleet view.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from proxyshift.api.behaviour import BehaviourParams, NodeBehaviour
from proxyshift.api.common import KubeModel
from proxyshift.api.diagnostics import DiagnoseRequest, NodeDiagnostics, NodeDistribution

OperationType = Literal["Preflight", "Hold", "Cleanup", "Probe"]

# Bounds of what an agent writes (status), in the CRD and in the agent's own writes (clip_status), so a
# broken or hostile agent cannot grow a ProxyNode without limit, and a good one is never refused.
STATUS_TEXT_LIMIT = 256  # versions, kernel release, mode names, timestamps
STATUS_MESSAGE_LIMIT = 4000  # operation messages, probe errors
MAX_STATUS_MODULES = 128
MAX_STATUS_TOOLS = 16
MAX_STATUS_OBJECTS = 8
MAX_STATUS_LEFTOVERS = 8
OBJECT_SUMMARY_LIMIT = 1024
MAX_FOREIGN_VIRTUAL_SERVERS = 16
VIRTUAL_SERVER_TEXT_LIMIT = 64  # "TCP [fd00:1234::1]:65535 lblcr" and then some


class Operation(KubeModel):
    """A request from the operator to the agent, executed at most once per id."""

    id: str = Field(description="Unique id; the agent runs each id once and reports it in status.lastOperation.")
    type: OperationType = Field(description="Preflight, Hold, Cleanup or Probe.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Operation parameters: mode, scheduler, loadModules, extraModules, allowChanges, behaviour "
        "(Preflight, a PreflightParams); "
        "fromMode, toMode, ttlSeconds (Hold); removeModes, targetMode, services (Cleanup); "
        "services as ip:port, awaitMode, awaitSyncs, awaitSeconds, conntrack, behaviour (Probe). behaviour is a "
        "BehaviourParams (the Service sample to probe), conntrack a ConntrackParams (the Service destinations "
        "whose un-NATed entries are deleted after the switch).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class PreflightParams(KubeModel):
    """Operation params of a Preflight: what the operator takes from the policy for the agent's checks."""

    # An operator newer than the agent may send settings this agent does not know: it checks what it can.
    model_config = KubeModel.model_config | {"extra": "ignore"}

    mode: str = Field(max_length=16, description="Target kube-proxy mode.")
    scheduler: str | None = Field(default=None, max_length=16, description="Target IPVS scheduler (mode ipvs).")
    load_modules: bool = Field(default=False, description="spec.preflight.loadModules.")
    extra_modules: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=64, description="spec.preflight.extraModules.")
    # Plain names, not ChangeName: a change a newer operator knows must not fail this agent's preflight.
    allow_changes: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=32,
        description="spec.gate.behaviour.allowChanges: ForeignIPVSFlush lets a move to nftables pass a node "
        "holding IPVS virtual servers that are not kube-proxy's (the nftables kube-proxy deletes them).")
    behaviour: BehaviourParams | None = Field(default=None, description="The Service sample to probe before.")


class NodeMigration(KubeModel):
    """Where the operator is with this node. Lets a restarted operator resume from the API alone."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    phase: str = Field(default="Pending", description="Pending, Preflight, Cordon, Switch, Gate, Cleanup, "
                       "Verify, Uncordon, Done, Failed, RollingBack or RolledBack.")
    phase_since: str | None = Field(default=None, description="When the node entered this phase (RFC 3339).")
    from_revision: str | None = Field(
        default=None, description="Revision the node came from; empty means the baseline kube-proxy."
    )
    from_mode: str | None = Field(default=None, description="kube-proxy mode the node came from.")
    to_revision: str | None = Field(default=None, description="Revision the node is moving to.")
    switched_at: str | None = Field(default=None, description="When the node's revision label was changed.")
    cordoned_by_us: bool | None = Field(default=None, description="True when proxyshift cordoned the node.")
    attempt: int | None = Field(default=None, description="How many times this migration was started.")
    reason: str | None = Field(default=None, description="Reason of a failure or rollback.")
    message: str | None = Field(default=None, description="Details of the last failure or wait.")
    started_at: str | None = Field(default=None, description="When the migration of this node started.")
    finished_at: str | None = Field(default=None, description="When the node reached Done or RolledBack.")
    to_mode: str | None = Field(default=None, description="kube-proxy mode of the revision the node is moving to.")
    generation: int | None = Field(
        default=None, description="The policy's metadata.generation when this attempt started."
    )
    retry_token: str | None = Field(
        default=None, description="The policy's proxyshift.io/retry annotation when this attempt started."
    )
    rollback_step: str | None = Field(
        default=None, description="Step of a rollback: Label, Pod, Cleanup, Gate or Uncordon."
    )
    reverted_at: str | None = Field(
        default=None, description="When the revision label was moved back to fromRevision (RFC 3339)."
    )
    behaviour_differs_since: str | None = Field(
        default=None, description="When the gate first saw the node's Services answer differently than before "
        "the switch (RFC 3339); the difference rolls the node back once it has lasted gate.behaviour.confirm.",
    )
    foreign_ipvs_flushed: list[Annotated[str, Field(max_length=VIRTUAL_SERVER_TEXT_LIMIT)]] | None = Field(
        default=None, alias="foreignIPVSFlushed", max_length=MAX_FOREIGN_VIRTUAL_SERVERS,
        description="IPVS virtual servers that were not kube-proxy's, found by this migration's preflight, which "
        "the switch to nftables deletes (the policy accepted ForeignIPVSFlush), e.g. 'TCP 198.18.5.1:80 rr'.",
    )


class ProxyNodeSpec(KubeModel):
    """Written by the operator."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    policy: str | None = Field(default=None, description="The ProxyPolicy that owns this node, if any.")
    revision: str | None = Field(
        default=None, description="Target revision (<policy>-<hash>); empty means the baseline kube-proxy."
    )
    mode: str | None = Field(default=None, description="Target kube-proxy mode.")
    scheduler: str | None = Field(default=None, description="Target IPVS scheduler (mode ipvs).")
    migration: NodeMigration | None = Field(default=None, description="Progress of this node's migration.")
    operation: Operation | None = Field(default=None, description="The operation the agent should perform.")
    diagnose: DiagnoseRequest | None = Field(
        default=None, description="Kernel counters to read for some Services (proxyshift diagnose), once per id."
    )


class KubeProxyFacts(KubeModel):
    """What the node's kube-proxy says about itself, from its own endpoints."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    proxy_mode: str | None = Field(default=None, description="Answer of /proxyMode on the metrics port.")
    healthz_status: int | None = Field(default=None, description="HTTP status of /healthz on the health port.")
    process_start_time: float | None = Field(
        default=None, description="process_start_time_seconds (Unix time) of kube-proxy."
    )
    last_sync_timestamp: float | None = Field(
        default=None, description="kubeproxy_sync_proxy_rules_last_timestamp_seconds (Unix time)."
    )
    sync_count: int | None = Field(default=None, description="Rule syncs counted by the sync-duration histogram.")
    sync_duration_p99_seconds: float | None = Field(
        default=None, description="p99 of kubeproxy_sync_proxy_rules_duration_seconds, from the histogram."
    )
    sync_failures: int | None = Field(
        default=None, description="iptables-restore failures plus nftables sync failures, as counted."
    )
    error: str | None = Field(default=None, max_length=STATUS_MESSAGE_LIMIT,
                              description="Why the probe could not read kube-proxy, if it failed.")
    metrics_invalid: str | None = Field(
        default=None,
        max_length=STATUS_MESSAGE_LIMIT,
        description="Why kube-proxy's /metrics answer was refused (malformed, oversized, NaN, negative or "
        "impossible values), if it was. The gate fails on it: a kube-proxy reporting nonsense is not proven.",
    )
    probed_at: str | None = Field(default=None, description="When the probe ran (RFC 3339).")


class ModeObjects(KubeModel):
    """kube-proxy objects of one mode found on the node."""

    mode: str = Field(max_length=16, description="iptables, ipvs or nftables.")
    count: int = Field(description="Number of objects (chains, tables, virtual servers, sets, interfaces).")
    summary: str = Field(default="", max_length=OBJECT_SUMMARY_LIMIT,
                         description="e.g. 'nat: 2011 chains; filter: 6 chains'.")


class ForeignIPVS(KubeModel):
    """IPVS virtual servers on the node that kube-proxy did not create (a keepalived's, a hand-made LVS)."""

    count: int = Field(default=0, ge=0, description="How many there are.")
    virtual_servers: list[Annotated[str, Field(max_length=VIRTUAL_SERVER_TEXT_LIMIT)]] = Field(
        default_factory=list, max_length=MAX_FOREIGN_VIRTUAL_SERVERS,
        description="The first of them, as 'TCP 198.18.5.1:80 rr' (protocol, address:port or FWM mark, "
        "scheduler). An nftables kube-proxy deletes every one of them at each start.",
    )

    def describe(self, shown: int = 5) -> str:
        """ "2 IPVS virtual servers that are not kube-proxy's (TCP 198.18.5.1:80 rr, FWM 7 sh)", bounded."""
        names = self.virtual_servers[:shown]
        more = self.count - len(names)
        listed = ", ".join(names) + (f" and {more} more" if more > 0 else "")
        one = self.count == 1
        return (f"{self.count} IPVS virtual server{'' if one else 's'} that {'is' if one else 'are'} not "
                f"kube-proxy's ({listed})")


class OperationStatus(KubeModel):
    """The agent's account of the last operation it was asked to run."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    id: str = Field(description="Id of the operation (spec.operation.id).")
    type: str = Field(description="Preflight, Hold, Cleanup or Probe.")
    state: Literal["Running", "Succeeded", "Failed"] = Field(description="Running, Succeeded or Failed.")
    message: str = Field(default="", max_length=STATUS_MESSAGE_LIMIT,
                         description="Result for a person: what passed, what is missing.")
    started_at: str | None = Field(default=None, description="RFC 3339.")
    finished_at: str | None = Field(default=None, description="RFC 3339.")
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="Structured result (missing modules, objects removed, connect results).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class ProxyNodeStatus(KubeModel):
    """Written by the node's agent: the node's real state."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    observed_mode: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                      description="kube-proxy's own /proxyMode answer.")
    kernel_release: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT, description="uname -r of the node.")
    modules: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=MAX_STATUS_MODULES, description="Proxy-relevant kernel modules present."
    )
    tools: dict[str, Annotated[str, Field(max_length=STATUS_TEXT_LIMIT)]] = Field(
        default_factory=dict, max_length=MAX_STATUS_TOOLS,
        description="Versions: nft, iptables, iptablesBackend, ipset, ipvsadm.",
    )
    kube_proxy: KubeProxyFacts | None = Field(default=None, description="Latest kube-proxy probe.")
    objects: list[ModeObjects] = Field(default_factory=list, max_length=MAX_STATUS_OBJECTS,
                                       description="kube-proxy objects per mode on the node.")
    leftovers: list[Annotated[str, Field(max_length=16)]] = Field(
        default_factory=list, max_length=MAX_STATUS_LEFTOVERS,
        description="Modes other than the observed one that still have objects here.",
    )
    leftover_objects: int | None = Field(
        default=None, ge=0,
        description="How many kube-proxy objects of those modes are still here (chains, tables, virtual servers, "
        "ipsets, the kube-ipvs0 interface); kubectl get proxynodes shows it. Absent until the agent's first inventory.",
    )
    foreign_ipvs: ForeignIPVS | None = Field(
        default=None, alias="foreignIPVS",
        description="IPVS virtual servers that are not kube-proxy's (not on kube-ipvs0, not in its ipsets); "
        "preflight for nftables refuses them unless the policy accepts ForeignIPVSFlush.",
    )
    last_operation: OperationStatus | None = Field(default=None, description="Result of the last operation.")
    behaviour: NodeBehaviour | None = Field(
        default=None, description="How the node served a sample of Services before the switch and after it."
    )
    diagnostics: NodeDiagnostics | None = Field(
        default=None, description="The answer to spec.diagnose: each endpoint's share from the kernel's counters."
    )
    distribution: NodeDistribution | None = Field(
        default=None, description="spec.diagnose answers the operator recorded before and after the migration."
    )
    heartbeat: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                  description="Last time the agent wrote status (RFC 3339).")
    agent_version: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                      description="proxyshift version of the agent.")


class ProxyNode(KubeModel):
    """One node's kube-proxy: target (spec, by the operator) and reality (status, by the agent)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    api_version: str = Field(default="proxyshift.io/v1alpha1")
    kind: str = Field(default="ProxyNode")
    metadata: dict = Field(default_factory=dict)
    spec: ProxyNodeSpec = Field(default_factory=ProxyNodeSpec)
    status: ProxyNodeStatus = Field(default_factory=ProxyNodeStatus)

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))


def _clip(value: Any, limit: int) -> Any:
    return value[:limit] if isinstance(value, str) else value


def clip_status(status: dict[str, Any]) -> dict[str, Any]:
    """An agent's status patch cut to the CRD's bounds: a long kernel string or tool version is shortened
    rather than the whole write refused (which would leave the node without a heartbeat)."""
    out = dict(status)
    for key in ("observedMode", "kernelRelease", "heartbeat", "agentVersion"):
        if key in out:
            out[key] = _clip(out[key], STATUS_TEXT_LIMIT)
    if isinstance(out.get("modules"), list):
        out["modules"] = [_clip(m, 64) for m in out["modules"][:MAX_STATUS_MODULES]]
    if isinstance(out.get("tools"), dict):
        out["tools"] = {k: _clip(v, STATUS_TEXT_LIMIT) for k, v in list(out["tools"].items())[:MAX_STATUS_TOOLS]}
    if isinstance(out.get("objects"), list):
        out["objects"] = [dict(o, summary=_clip(o.get("summary", ""), OBJECT_SUMMARY_LIMIT))
                          if isinstance(o, dict) else o for o in out["objects"][:MAX_STATUS_OBJECTS]]
    if isinstance(out.get("leftovers"), list):
        out["leftovers"] = out["leftovers"][:MAX_STATUS_LEFTOVERS]
    foreign = out.get("foreignIPVS")
    if isinstance(foreign, dict) and isinstance(foreign.get("virtualServers"), list):
        out["foreignIPVS"] = dict(foreign, virtualServers=[
            _clip(v, VIRTUAL_SERVER_TEXT_LIMIT) for v in foreign["virtualServers"][:MAX_FOREIGN_VIRTUAL_SERVERS]])
    for key, field in (("kubeProxy", "error"), ("kubeProxy", "metricsInvalid"), ("lastOperation", "message")):
        part = out.get(key)
        if isinstance(part, dict) and field in part:
            out[key] = dict(part, **{field: _clip(part[field], STATUS_MESSAGE_LIMIT)})
    return out
