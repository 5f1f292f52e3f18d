"""The ProxyNode API: one per Node, the channel between operator and agent.

spec is written only by the operator (what the node should run, the step it
is in, the operation the agent should perform); status only by the node's own
agent (what is really there). `kubectl get proxynodes` is the fleet view.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeGuard, TypeVar, get_args

from pydantic import AliasChoices, Field, ValidationError, field_validator

from proxyshift.api.behaviour import BehaviourParams, ConntrackParams, ConntrackReport, NodeBehaviour
from proxyshift.api.common import KubeModel
from proxyshift.api.diagnostics import DiagnoseRequest, NodeDiagnostics, NodeDistribution
from proxyshift.api.replacement import ReplacementFacts, ReplacementParams

OperationType = Literal["Preflight", "Hold", "Cleanup", "Probe"]
OPERATION_TYPES: tuple[OperationType, ...] = get_args(OperationType)
# The kube-proxy modes, for the planner, the executor and the agent alike, and cilium-kpr: no kube-proxy on
# the node, Cilium's eBPF kube-proxy replacement serves its Services (issue 19; its facts say what differs,
# proxyshift.modes.cilium_kpr). The wire fields that carry a mode stay plain strings: a node may report one this
# version does not know, and that must be a fact, not a refused object.
Mode = Literal["iptables", "ipvs", "nftables", "cilium-kpr"]
MODES: tuple[Mode, ...] = get_args(Mode)
# Where the operator is with a node (spec.migration.phase; a string on the wire, see NodeMigration.phase).
Phase = Literal[
    "Pending", "Preflight", "Prepared", "Cordon", "Switch", "Gate", "Cleanup", "Verify", "Uncordon", "Done",
    "Failed", "RollingBack", "RolledBack",
]
PHASES: tuple[Phase, ...] = get_args(Phase)
# A migration between its start and its end: the operator steps these (planner/machine.py), and the agent keeps
# a rule hold only while its migration is in one of them (agent/hold.py).
IN_FLIGHT: frozenset[Phase] = frozenset(
    {"Preflight", "Prepared", "Cordon", "Switch", "Gate", "Cleanup", "Verify", "Uncordon", "RollingBack"})


def is_phase(text: str) -> TypeGuard[Phase]:
    return text in PHASES


def is_mode(text: str | None) -> TypeGuard[Mode]:
    return text in MODES

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
# An operation id is "<revision>.<attempt>.<start time digits>.<step>.<n>" (planner/machine.py op_id), the
# revision a label value (at most 63): about 110 at most. 253, a DNS subdomain, as BehaviourMatrix.operationId.
OPERATION_ID_LIMIT = 253
OPERATION_TYPE_LIMIT = 64  # Preflight, Hold, Cleanup, Probe; a newer agent's type is a word too
# Keys of status.lastOperation.details: a PreflightResult has 10, the most of the four result models. Its
# values have no schema (x-kubernetes-preserve-unknown-fields, so a newer agent's keys are kept): the key
# count is what the CRD can bound, the API server's request size bounds the rest.
MAX_DETAILS_PROPERTIES = 32


class Operation(KubeModel):
    """A request from the operator to the agent, executed at most once per id."""

    id: str = Field(max_length=OPERATION_ID_LIMIT,
                    description="Unique id; the agent runs each id once and reports it in status.lastOperation.")
    type: OperationType = Field(description="Preflight, Hold, Cleanup or Probe.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Operation parameters, one model per type: mode, scheduler, loadModules, extraModules, "
        "allowChanges, behaviour (Preflight, a PreflightParams); fromMode, toMode, ttlSeconds (Hold, a HoldParams); "
        "removeModes, targetMode, services (Cleanup, a CleanupParams); services as ip:port, awaitMode, awaitSyncs, "
        "awaitSeconds, conntrack, behaviour (Probe, a ProbeParams). Keys an agent does not know are ignored. "
        "behaviour is a "
        "BehaviourParams (the Service sample to probe), conntrack a ConntrackParams (the Service destinations "
        "whose un-NATed entries are deleted after the switch).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @classmethod
    def request(cls, id: str, params: OperationParams) -> Operation:
        """The operation that carries `params`; its type follows from the params model."""
        return cls(id=id, type=params.operation_type, params=params.to_params())

    def params_as(self, model: builtins.type[ParamsT]) -> ParamsT:
        """params read as this operation type's model: unknown keys ignored, missing ones defaulted.

        The raw dict stays as it came, so a write of the ProxyNode spec keeps what this version does not know.
        """
        if PARAMS_MODELS[self.type] is not model:
            raise TypeError(f"a {self.type} operation carries {PARAMS_MODELS[self.type].__name__}, "
                            f"not {model.__name__}")
        return model.model_validate(self.params)

    def typed_params(self) -> OperationParams:
        return PARAMS_MODELS[self.type].model_validate(self.params)


class _Params(KubeModel):
    """Base of the per-type operation params (spec.operation.params).

    Skew rule: an operator newer than the agent may send keys this agent does not know (ignored), an older
    one may leave out keys this agent knows (defaulted). The wire shape is the dict `to_params` writes,
    the same keys an operator of the version before the typed contract wrote.
    """

    model_config = KubeModel.model_config | {"extra": "ignore"}
    operation_type: ClassVar[OperationType]

    def to_params(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class HoldParams(_Params):
    """Operation params of a Hold: the move the old mode's service rules are copied for (agent/hold.py)."""

    operation_type: ClassVar[OperationType] = "Hold"

    from_mode: str | None = Field(default=None, description="The mode the node leaves (whose rules are held).")
    to_mode: str | None = Field(default=None, description="The mode the node moves to.")
    ttl_seconds: int = Field(default=600, description="The hold goes after this long at the latest.")

    def to_params(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")  # null modes stay: the shape every agent knows


class PreflightParams(_Params):
    """Operation params of a Preflight: what the operator takes from the policy for the agent's checks."""

    operation_type: ClassVar[OperationType] = "Preflight"

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
    # None: the operator did not say (one older than this field); the agent then does not check what an ipvs
    # kube-proxy would delete, as before. A list (maybe empty): the target revision's ipvs.excludeCIDRs.
    ipvs_exclude_cidrs: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None, validation_alias=AliasChoices("ipvsExcludeCIDRs", "ipvs_exclude_cidrs"),
        serialization_alias="ipvsExcludeCIDRs", max_length=64,
        description="The target's ipvs.excludeCIDRs (mode ipvs): a foreign IPVS virtual server outside them is "
        "deleted by the ipvs kube-proxy at every sync, so preflight refuses it unless ForeignIPVSFlush is allowed.")
    replacement: ReplacementParams | None = Field(
        default=None, description="A target that runs no kube-proxy (cilium-kpr): where its agent's API is.")
    # An agent older than this key ignores it and makes no hold: the operator then asks for the Hold at the switch.
    hold: HoldParams | None = Field(
        default=None, description="Once the checks passed, make the rule hold for this move (iptables <-> "
        "nftables), so the switch needs no Hold round trip; the result's details.hold says how it went.")

    def to_params(self) -> dict[str, Any]:
        # scheduler: null stays on the wire (an older agent reads the key); no allowChanges, behaviour,
        # ipvsExcludeCIDRs, replacement or hold leaves the key out.
        wire = self.model_dump(by_alias=True, exclude={"behaviour", "allow_changes", "ipvs_exclude_cidrs",
                                                       "replacement", "hold"}, mode="json")
        if self.hold is not None:
            wire["hold"] = self.hold.to_params()
        if self.replacement is not None:
            wire["replacement"] = self.replacement.model_dump(by_alias=True, mode="json")
        if self.allow_changes:
            wire["allowChanges"] = list(self.allow_changes)
        if self.ipvs_exclude_cidrs is not None:
            wire["ipvsExcludeCIDRs"] = list(self.ipvs_exclude_cidrs)
        if self.behaviour is not None:
            wire["behaviour"] = self.behaviour.model_dump(by_alias=True, exclude_none=True, mode="json")
        return wire


class CleanupParams(_Params):
    """Operation params of a Cleanup: the modes whose stale kube-proxy objects the agent flushes."""

    operation_type: ClassVar[OperationType] = "Cleanup"

    # Plain strings, not Mode: the agent's flush names a mode it does not know in its report.
    remove_modes: list[str] = Field(default_factory=list, description="Modes whose objects to remove.")
    target_mode: str | None = Field(default=None, description="The mode kube-proxy runs now (never flushed).")
    services: list[str] = Field(default_factory=list,
                                description="The gate's Services as ip:port, connected to right after the flush.")

    def to_params(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"removeModes": list(self.remove_modes), "targetMode": self.target_mode}
        if self.services:
            wire["services"] = list(self.services)
        return wire


class ProbeParams(_Params):
    """Operation params of a Probe: read kube-proxy (waiting for a sync), connect, clean conntrack, probe."""

    operation_type: ClassVar[OperationType] = "Probe"

    services: list[str] = Field(default_factory=list, description="The gate's Services as ip:port.")
    await_mode: str | None = Field(default=None, description="Wait until kube-proxy runs this mode and synced.")
    await_syncs: int = Field(default=1, description="How many syncs the wait asks for.")
    await_seconds: float = Field(default=0.0, description="How long the agent may wait (it caps this itself).")
    conntrack: ConntrackParams | None = Field(default=None, description="The conntrack step, first.")
    behaviour: BehaviourParams | None = Field(default=None, description="The Service sample to probe after.")
    replacement: ReplacementParams | None = Field(
        default=None, description="The node runs no kube-proxy (cilium-kpr): read its replacement's API instead.")
    cleanup: CleanupParams | None = Field(
        default=None, description="Flush these stale objects once kube-proxy runs await_mode and synced, "
        "beside the conntrack step and the connects (they need nothing of it), before the behaviour probe.")

    def to_params(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"services": list(self.services), "awaitMode": self.await_mode,
                                "awaitSyncs": self.await_syncs, "awaitSeconds": self.await_seconds}
        if self.cleanup is not None:
            wire["cleanup"] = self.cleanup.to_params()
        for key, part in (("conntrack", self.conntrack), ("behaviour", self.behaviour),
                          ("replacement", self.replacement)):
            if part is not None:
                wire[key] = part.model_dump(by_alias=True, exclude_none=True, mode="json")
        return wire


OperationParams = PreflightParams | HoldParams | CleanupParams | ProbeParams
ParamsT = TypeVar("ParamsT", bound=_Params)
PARAMS_MODELS: dict[OperationType, type[OperationParams]] = {
    model.operation_type: model for model in (PreflightParams, HoldParams, CleanupParams, ProbeParams)
}


class NodeMigration(KubeModel):
    """Where the operator is with this node. Lets a restarted operator resume from the API alone."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    # A string on the wire, not Phase: the agent reads the whole spec, and an agent one version older must
    # not refuse a ProxyNode whose phase is one a newer operator added. The operator writes only Phase values.
    phase: str = Field(default="Pending", description="Pending, Preflight, Prepared, Cordon, Switch, Gate, "
                       "Cleanup, Verify, Uncordon, Done, Failed, RollingBack or RolledBack. A passed preflight "
                       "waiting for a maxUnavailable slot stays Preflight here (the policy's status and "
                       "`proxyshift status` show it as Prepared); Prepared is written only by older operators.")
    phase_since: str | None = Field(default=None, description="When the node entered this phase (RFC 3339).")
    from_revision: str | None = Field(
        default=None, description="Revision the node came from; empty means the baseline kube-proxy."
    )
    from_mode: str | None = Field(default=None, description="kube-proxy mode the node came from.")
    to_revision: str | None = Field(default=None, description="Revision the node is moving to.")
    touched_at: str | None = Field(
        default=None, description="When the migration first changed the node (its cordon, else its switch): the "
        "start of its maxUnavailable slot. Unset while it is in Preflight or Prepared.")
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
    probe_said: str | None = Field(
        default=None, description="What the last answered probe round of the gate under way (forward or the "
        "rollback's) said, written with the next round: a timeout while that round runs names why the node waited.",
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


def attempt_key(m: NodeMigration) -> str:
    """Names one migration of one node, the prefix of its operation ids ("<toRevision|baseline>.<attempt>.
    <startedAt digits>"). The start time is part of it because `attempt` starts again at 1 when a released node is
    taken by another policy, and an agent runs each operation id only once."""
    started = "".join(ch for ch in (m.started_at or "") if ch.isdigit())
    return f"{m.to_revision or 'baseline'}.{m.attempt or 0}.{started or '0'}"


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

    proxy_mode: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                   description="Answer of /proxyMode on the metrics port.")
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
    probed_at: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                  description="When the probe ran (RFC 3339).")

    def synced_since_start(self) -> bool:
        """Whether this kube-proxy process has completed a rule sync since it started (both from its clock)."""
        start, last = self.process_start_time, self.last_sync_timestamp
        return start is not None and last is not None and last >= start


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

    id: str = Field(max_length=OPERATION_ID_LIMIT, description="Id of the operation (spec.operation.id).")
    # A string, not OperationType: an agent newer than the operator may report a type this one does not know.
    type: str = Field(max_length=OPERATION_TYPE_LIMIT, description="Preflight, Hold, Cleanup or Probe.")
    state: Literal["Running", "Succeeded", "Failed"] = Field(description="Running, Succeeded or Failed.")
    message: str = Field(default="", max_length=STATUS_MESSAGE_LIMIT,
                         description="Result for a person: what passed, what is missing.")
    started_at: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT, description="RFC 3339.")
    finished_at: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT, description="RFC 3339.")
    details: dict[str, Any] = Field(
        default_factory=dict, max_length=MAX_DETAILS_PROPERTIES,
        description="Structured result, one model per type: a PreflightResult (missing modules, tools, foreign "
        "IPVS), HoldResult (empty), CleanupResult (objects removed, connect results) or ProbeResult (connect "
        "results, the conntrack step).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    def result_as(self, model: builtins.type[ResultT]) -> ResultT:
        """details read as an operation type's result model: unknown keys ignored, missing ones defaulted,
        and a malformed one read as not reported (an agent's bad field must not stop the operator's plan)."""
        try:
            return model.model_validate(self.details)
        except ValidationError as exc:
            bad = {err["loc"][0] for err in exc.errors() if err["loc"]}
        try:
            return model.model_validate({k: v for k, v in self.details.items() if k not in bad})
        except ValidationError:
            return model()


class _Result(KubeModel):
    """Base of the per-type operation results (status.lastOperation.details), the agent's structured report.

    Skew rule as for params: an operator reads what it knows of a newer agent's details and defaults what an
    older agent did not send (None: not reported, which the operator tells apart from empty).
    """

    model_config = KubeModel.model_config | {"extra": "ignore"}
    operation_type: ClassVar[OperationType]

    def to_details(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _connect_results(raw: Any) -> Any:
    """{target: true | "ok" | error} as agents write it, or [{target, ok, error}] as the first ones did."""
    if isinstance(raw, list):
        return {str(item["target"]): True if item.get("ok") else str(item.get("error") or "failed")
                for item in raw if isinstance(item, Mapping) and "target" in item}
    if isinstance(raw, Mapping):
        return {str(k): v if isinstance(v, bool | str) else bool(v) for k, v in raw.items()}
    return raw


Connects = dict[str, bool | str]


class MissingItem(KubeModel):
    """Something the node lacks for the target mode (agent/preflight.py Missing)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    what: str = Field(description="e.g. 'kernel module ip_vs'.")
    why: str = Field(default="", description="Why the mode needs it.")
    fix: str = Field(default="", description="What a person does about it.")


class ForeignIPVSFound(KubeModel):
    """A preflight's foreign IPVS virtual servers (ForeignIPVS), and whether the policy accepted losing them.

    Unbounded here: the operator clips what it copies into its own objects (planner/machine.py).
    """

    model_config = KubeModel.model_config | {"extra": "ignore"}

    count: int = 0
    virtual_servers: list[str] = Field(default_factory=list)
    accepted: bool = Field(default=False, description="The policy's allowChanges names ForeignIPVSFlush.")


class HoldOutcome(KubeModel):
    """The rule hold a passed preflight made (PreflightParams.hold)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    ok: bool = False
    message: str = ""


class PreflightResult(_Result):
    """details of a Preflight: the kernel and tools checked for the target mode."""

    operation_type: ClassVar[OperationType] = "Preflight"

    mode: str | None = None
    scheduler: str | None = None
    kernel_release: str | None = None
    missing: list[MissingItem] = Field(default_factory=list)
    missing_modules: list[str] = Field(default_factory=list)
    modules_present: list[str] = Field(default_factory=list)
    loaded: list[str] = Field(default_factory=list)
    on_demand: list[str] = Field(default_factory=list)
    tools: dict[str, str] = Field(default_factory=dict)
    foreign_ipvs: ForeignIPVSFound | None = Field(default=None, alias="foreignIPVS")
    replacement: ReplacementFacts | None = None
    hold: HoldOutcome | None = None  # the rule hold params.hold asked for; None: not asked, or an older agent


class HoldResult(_Result):
    """details of a Hold: none; the message says what was copied."""

    operation_type: ClassVar[OperationType] = "Hold"


class FlushStepResult(KubeModel):
    """One tool's part of a flush (agent/flush/base.py FlushStep)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    tool: str
    removed: dict[str, int] = Field(default_factory=dict)
    skipped: list[str] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)


class CleanupResult(_Result):
    """details of a Cleanup: the flush, the hold it dropped, the gate's Services reached right after.

    A restarted agent that finds its Cleanup left Running reports `recovered` and what is `remaining` instead.
    """

    operation_type: ClassVar[OperationType] = "Cleanup"

    remove_modes: list[str] | None = None
    target_mode: str | None = None
    steps: list[FlushStepResult] | None = None
    hold: str | None = None
    connects: Connects | None = None
    recovered: bool | None = None
    remaining: dict[str, int] | None = None
    # A Cleanup's own state says whether it succeeded; a flush inside a Probe says it here (the Probe succeeds
    # as a reading either way), with `message` for people.
    ok: bool | None = None
    message: str | None = None

    @field_validator("connects", mode="before")
    @classmethod
    def _either_connects_shape(cls, value: Any) -> Any:
        return _connect_results(value)


class ProbeResult(_Result):
    """details of a Probe: the gate's Services reached, the conntrack step's account and, when the probe was
    asked to flush, the flush's (None: it did not flush, kube-proxy had not synced in the mode awaited)."""

    operation_type: ClassVar[OperationType] = "Probe"

    connects: Connects | None = None
    conntrack: ConntrackReport | None = None
    cleanup: CleanupResult | None = None

    @field_validator("connects", mode="before")
    @classmethod
    def _either_connects_shape(cls, value: Any) -> Any:
        return _connect_results(value)


OperationResult = PreflightResult | HoldResult | CleanupResult | ProbeResult
ResultT = TypeVar("ResultT", bound=_Result)
RESULT_MODELS: dict[OperationType, type[OperationResult]] = {
    model.operation_type: model for model in (PreflightResult, HoldResult, CleanupResult, ProbeResult)
}


class RuleHold(KubeModel):
    """A rule hold the agent keeps on the node (status.hold)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    operation_id: str | None = Field(
        default=None, max_length=STATUS_TEXT_LIMIT,
        description="The operation that made it (a Preflight asked to hold, or a Hold); null: found on the node "
        "by a restarted agent.")
    expires: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                description="When it goes at the latest, on the agent's clock (RFC 3339).")


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
    replacement: ReplacementFacts | None = Field(
        default=None, description="Latest read of the node's kube-proxy replacement (Cilium's /v1/healthz and "
        "/v1/service), on a node moving to or running cilium-kpr.")
    objects: list[ModeObjects] = Field(default_factory=list, max_length=MAX_STATUS_OBJECTS,
                                       description="kube-proxy objects per mode on the node.")
    leftovers: list[Annotated[str, Field(max_length=16)]] = Field(
        default_factory=list, max_length=MAX_STATUS_LEFTOVERS,
        description="Modes other than the observed one that still have objects here.",
    )
    leftover_objects: int | None = Field(
        default=None, ge=0,
        description="How many kube-proxy objects of those modes are still here (chains, tables, virtual servers, "
        "ipsets, the kube-ipvs0 interface and each address on it); kubectl get proxynodes shows it. Absent until "
        "the agent's first inventory.",
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
    hold: RuleHold | None = Field(
        default=None, description="The rule hold on the node now (agent/hold.py), null when there is none. "
        "Absent from an agent older than this field.")
    heartbeat: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                  description="Last time the agent wrote status (RFC 3339).")
    agent_version: str | None = Field(default=None, max_length=STATUS_TEXT_LIMIT,
                                      description="proxyshift version of the agent.")


class ProxyNode(KubeModel):
    """One node's kube-proxy: target (spec, by the operator) and reality (status, by the agent)."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    api_version: str = Field(default="proxyshift.io/v1alpha1")
    kind: str = Field(default="ProxyNode")
    metadata: dict[str, Any] = Field(default_factory=dict)
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
    for key, field, limit in (("kubeProxy", "error", STATUS_MESSAGE_LIMIT),
                              ("kubeProxy", "metricsInvalid", STATUS_MESSAGE_LIMIT),
                              ("kubeProxy", "proxyMode", STATUS_TEXT_LIMIT),
                              ("kubeProxy", "probedAt", STATUS_TEXT_LIMIT),
                              ("lastOperation", "message", STATUS_MESSAGE_LIMIT),
                              # The id is the spec's, which the CRD bounds the same: a cut never happens to a
                              # good operator's id, and keeps a bad one from stopping every status write.
                              ("lastOperation", "id", OPERATION_ID_LIMIT),
                              ("lastOperation", "type", OPERATION_TYPE_LIMIT),
                              ("lastOperation", "startedAt", STATUS_TEXT_LIMIT),
                              ("lastOperation", "finishedAt", STATUS_TEXT_LIMIT)):
        part = out.get(key)
        if isinstance(part, dict) and field in part:
            out[key] = dict(part, **{field: _clip(part[field], limit)})
    return out
