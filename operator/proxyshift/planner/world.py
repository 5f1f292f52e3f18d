"""What the planner sees and what it asks for: plain, immutable data, no I/O.

The operator builds a `World` from its indexes (Nodes, ProxyNodes, revision
DaemonSets, kube-proxy pods, policies), calls `plan(world, policy_name)` and
performs the returned actions, one idempotent step each. Everything the planner
needs to resume after a crash is in these objects, which come from the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proxyshift.api.diagnostics import DiagnoseRequest
from proxyshift.api.policy import ProxyPolicy, ProxyPolicyStatus
from proxyshift.api.proxynode import NodeMigration, Operation, ProxyNode
from proxyshift.modes import DEFAULT_MODE
from proxyshift.planner.services import EndpointView, ServiceView

REVISION_LABEL = "proxyshift.io/revision"
RETRY_ANNOTATION = "proxyshift.io/retry"
BASELINE_DAEMONSET = "kube-proxy"


def daemonset_for(revision: str | None) -> str:
    """Name of the kube-proxy DaemonSet a node with this revision label runs (None: the baseline)."""
    return BASELINE_DAEMONSET if revision is None else f"kube-proxy-{revision}"


@dataclass(frozen=True)
class NodeView:
    """The parts of a Node the planner reads."""

    name: str
    labels: dict[str, str]
    unschedulable: bool = False
    ready: bool = True
    exists: bool = True
    # status.addresses of type InternalIP/ExternalIP: a NodePort dialled there is a "nodeIP" cell.
    addresses: tuple[str, ...] = ()
    # Lets the operator wait until its own writes are visible before planning again.
    resource_version: str = field(default="", compare=False)

    @property
    def revision(self) -> str | None:
        """The revision label; None means the node runs the baseline kube-proxy."""
        return self.labels.get(REVISION_LABEL)


@dataclass(frozen=True)
class KubeProxyPodView:
    """The kube-proxy pod on a node: which DaemonSet it belongs to and whether it is up."""

    node: str
    name: str
    daemonset: str  # "kube-proxy" for the baseline, else "kube-proxy-<revision>"
    ready: bool
    running: bool
    deleting: bool
    started_at: datetime | None = None
    restarts: int = 0


@dataclass(frozen=True)
class RevisionView:
    """A revision (ConfigMap + DaemonSet pair) that exists in the cluster."""

    name: str  # "<policy>-<hash>" : the label value nodes carry
    policy: str
    mode: str
    config_hash: str


@dataclass(frozen=True)
class RevisionTarget:
    """The revision a policy's current spec renders to, computed by the operator with proxyshift.render.

    The planner never renders: it only compares names, so the hash rules live in one place.
    """

    name: str  # "<policy>-<hash>", the label value
    mode: str
    scheduler: str | None = None
    # The rendered ipvs.excludeCIDRs (the policy's over the baseline's): what an ipvs kube-proxy leaves alone.
    ipvs_exclude_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class World:
    """Everything the planner may look at, read at one instant."""

    now: datetime
    policies: dict[str, ProxyPolicy]
    nodes: dict[str, NodeView]
    proxynodes: dict[str, ProxyNode]
    revisions: dict[str, RevisionView]
    kube_proxy_pods: dict[str, list[KubeProxyPodView]]  # node name -> pods on it
    baseline_mode: str = DEFAULT_MODE
    # policy name -> the revision its current spec renders to. A live policy missing here gets no new
    # starts (the operator could not render it); in-flight nodes still finish.
    current_revisions: dict[str, RevisionTarget] = field(default_factory=dict)
    # policy name -> its compatibility report: what the target mode changes for this cluster's Services,
    # per source of its nodes (controller/compat_report.py; None or missing: not taken).
    compat: dict[str, Any] = field(default_factory=dict)
    # policy name -> why its revision could not be rendered (an unreadable baseline kube-proxy config).
    render_errors: dict[str, str] = field(default_factory=dict)
    # "namespace/name" -> ClusterIP of the Services named in gate.probeServices.
    service_ips: dict[str, str] = field(default_factory=dict)
    # The Services side, for the behaviour sample and the conntrack step (controller/service_cache.py).
    services: ServiceSide = field(default_factory=lambda: ServiceSide())
    # When the operator last saw the API server come back after it could not be reached (None: not seen
    # since the operator started). Every step's timeout counts from no earlier than a grace after this
    # (machine.RECONNECT_GRACE): what a step waits for (the DaemonSet controller, the scheduler,
    # kube-proxy's and the agent's watches) reconnects with its own back-off after the API server is back.
    api_back_at: datetime | None = None


@dataclass(frozen=True)
class ServiceSide:
    """The cluster's Services as the behaviour probe and the conntrack step need them."""

    services: dict[str, ServiceView] = field(default_factory=dict)  # "namespace/name" -> view
    endpoints: tuple[EndpointView, ...] = ()  # every EndpointSlice's endpoints; each names its Service
    service_cidrs: tuple[str, ...] = ()
    probe_pods: dict[str, str] = field(default_factory=dict)  # node -> "podIP:port" of its probe server


# ---- actions: each is one idempotent API step the operator performs ----


@dataclass(frozen=True)
class Action:
    """Base of every action. `reason` is the CamelCase reason used for the Event."""

    reason: str = field(default="", kw_only=True)
    message: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class EnsureRevision(Action):
    """Apply the revision's ConfigMap and DaemonSet for the policy's current spec (server-side apply: creates
    them, brings them back to their rendering, or writes nothing). `existing`: the revision exists
    already, this only keeps it as rendered."""

    policy: str
    revision: str
    existing: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class DeleteRevision(Action):
    """Delete a revision no node uses any more."""

    revision: str


@dataclass(frozen=True)
class EnsureProxyNode(Action):
    """Create the ProxyNode for a node (spec only), or set its owner policy."""

    node: str
    policy: str | None


@dataclass(frozen=True)
class SetMigration(Action):
    """Write ProxyNode.spec: target revision/mode, the node's migration record and operation."""

    node: str
    policy: str | None
    revision: str | None
    mode: str | None
    scheduler: str | None
    migration: NodeMigration | None
    operation: Operation | None
    # spec.diagnose: kernel counters the agent reads once per id (a distribution record, or a person's
    # `proxyshift diagnose`); the machine carries the current one over, as the spec is replaced whole.
    diagnose: DiagnoseRequest | None = None


@dataclass(frozen=True)
class SetRevisionLabel(Action):
    """Move the node to a revision's DaemonSet (None removes the label: back to the baseline).

    `labels` go in the same patch: the replacement labels of the revision's mode (proxyshift.modes
    replacement_labels: Cilium's label set for cilium-kpr, removed, as None, for every kube-proxy mode), so a node
    is handed to Cilium exactly when kube-proxy leaves it, and back."""

    node: str
    revision: str | None
    labels: tuple[tuple[str, str | None], ...] = ()


@dataclass(frozen=True)
class Cordon(Action):
    node: str


@dataclass(frozen=True)
class Drain(Action):
    """Evict the node's pods, respecting PodDisruptionBudgets, ignoring DaemonSet pods."""

    node: str


@dataclass(frozen=True)
class Uncordon(Action):
    node: str


@dataclass(frozen=True)
class RecordStatus(Action):
    """Replace the policy's status (the operator patches status subresource)."""

    policy: str
    status: ProxyPolicyStatus


@dataclass(frozen=True)
class RemoveFinalizer(Action):
    """The policy's deletion is complete."""

    policy: str


@dataclass(frozen=True)
class Event(Action):
    """An Event on the policy (node None) or on the node."""

    policy: str
    node: str | None
    type: str = "Normal"  # or Warning


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the actions to do now, and when to look again at the latest."""

    actions: list[Action]
    requeue_after_seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # Nodes whose steps may run only once every other node's steps of this plan succeeded: a slot another
    # node's step frees in this plan (its Done) was granted to them, and the record of that Done must come
    # first, or a failed write would leave more nodes touched than maxUnavailable allows.
    after_others: frozenset[str] = frozenset()
