"""The ProxyPolicy API: what a platform engineer writes.

The pydantic validators here and the CEL rules attached to the schema say the
same things; the CRD generator carries the CEL rules into the CRD so the API
server refuses a bad spec with the same message.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from proxyshift.api.behaviour import CHANGE_NAMES, ChangeName
from proxyshift.api.common import (
    Condition,
    Duration,
    KubeModel,
    LabelSelector,
    with_rules,
)
from proxyshift.api.proxynode import Mode, Phase

# One Mode and one Phase for the whole package (api/proxynode.py); the names here are the policy's words.
ProxyMode = Mode
IPVSScheduler = Literal["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh"]
# One regex for the model and the CEL rule, so both accept exactly 1%..100% (no leading zeros):
# it needs no CEL string extensions and costs the API server one bounded regex match.
PERCENT_PATTERN = "^(100|[1-9][0-9]?)%$"
PERCENT_RE = re.compile(PERCENT_PATTERN)
MAX_UNAVAILABLE_MESSAGE = "maxUnavailable must be at least 1, or a percentage from 1% to 100%"
MAX_STAGES = 10
MAX_EXTRA_MODULES = 32
MAX_EXCLUDE_CIDRS = 64
MAX_PROBE_SERVICES = 16
MODULE_NAME_PATTERN = "^[a-z0-9_]+$"
MAX_NODE_PORT_ADDRESSES = 16
# kube-proxy 1.37's keywords for nodePortAddresses (pkg/proxy/apis/config: primary, localhost, all).
NODE_PORT_ADDRESS_KEYWORDS = ("primary", "localhost", "all")
# IPv4 CIDRs exactly as ipaddress parses them (no leading zeros); IPv6 only roughly (the API server's
# CEL here has no isCIDR we can test against), so the model parses every CIDR for real.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
NODE_PORT_ADDRESS_PATTERN = (
    rf"^(primary|localhost|all|({_OCTET}\.){{3}}{_OCTET}/(3[0-2]|[12]?[0-9])|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*/"
    r"(12[0-8]|1[01][0-9]|[1-9]?[0-9]))$"
)
NODE_PORT_ADDRESS_MESSAGE = "must be a CIDR (like 198.18.0.0/16) or one of the keywords primary, localhost, all"
# ipvs.excludeCIDRs: CIDRs only (kube-proxy 1.37 refuses to start on anything else, after the switch).
CIDR_PATTERN = (rf"^(({_OCTET}\.){{3}}{_OCTET}/(3[0-2]|[12]?[0-9])|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*/"
                r"(12[0-8]|1[01][0-9]|[1-9]?[0-9]))$")
CIDR_MESSAGE = "must be a CIDR (like 198.18.5.0/24)"
# kube-proxy's alpha feature gate (1.37) that serves TCP NodePorts on loopback in nftables mode
# through a userspace proxy, when nodePortAddresses names loopback explicitly.
NFTABLES_LOCALHOST_GATE = "KubeProxyNFTablesLocalhostNodePorts"
NFTABLES_LOCALHOST_MESSAGE = (
    "nftables.localhostNodePorts needs nodePortAddresses to name loopback (for example [primary, localhost]): "
    "kube-proxy serves localhost NodePorts in nftables mode only when the list names it"
)
UNIQUE_MESSAGE = "must not list the same value twice"
# mode cilium-kpr (issue 19): the node runs no kube-proxy; Cilium's agent serves its Services.
CILIUM_KPR_MODE: Mode = "cilium-kpr"
# Cilium's agent's REST API (pkg/defaults SockPath); a unix socket path must fit sun_path (108 bytes with its NUL).
DEFAULT_CILIUM_SOCKET = "/var/run/cilium/cilium.sock"
SOCKET_PATH_PATTERN = "^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$"
SOCKET_PATH_MAX = 107
SOCKET_PATH_DOT_DOT = "(^|/)[.][.](/|$)"
SOCKET_PATH_MESSAGE = ("cilium.socketPath must be an absolute path of at most 107 characters (letters, digits, "
                       "'_', '.', '-' between slashes), without '..'")
CILIUM_CONNTRACK_MESSAGE = ("conntrack settings are kube-proxy's and are not allowed with mode: cilium-kpr "
                            "(Cilium's eBPF datapath keeps its own connection tracking)")
CILIUM_NODE_PORT_MESSAGE = ("with mode: cilium-kpr nodePortAddresses must be CIDRs (Cilium's nodeport-addresses); "
                            "the keywords primary, localhost and all are kube-proxy's")


def names_loopback(address: str) -> bool:
    """True for a nodePortAddresses entry that names loopback explicitly (what kube-proxy 1.37 looks for)."""
    return address == "localhost" or address.startswith(("127.", "::1/"))


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class IPVSSettings(KubeModel):
    """Settings of kube-proxy's ipvs mode (KubeProxyConfiguration.ipvs). Only valid with mode ipvs."""

    scheduler: IPVSScheduler = Field(
        default="rr",
        description="IPVS scheduler: rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq or mh. "
        "The node needs the kernel module ip_vs_<scheduler>.",
    )
    strict_arp: bool | None = Field(
        default=None, alias="strictARP", description="Set arp_ignore/arp_announce strictly (MetalLB needs it)."
    )
    sync_period: Duration | None = Field(default=None, description="Full resync interval, e.g. 30s.")
    min_sync_period: Duration | None = Field(default=None, description="Minimum interval between syncs, e.g. 1s.")
    tcp_timeout: Duration | None = Field(default=None, description="IPVS TCP session timeout; 0s keeps the kernel's.")
    tcp_fin_timeout: Duration | None = Field(default=None, description="IPVS TCP FIN_WAIT timeout.")
    udp_timeout: Duration | None = Field(default=None, description="IPVS UDP timeout.")
    exclude_cidrs: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None,
        alias="excludeCIDRs",
        max_length=MAX_EXCLUDE_CIDRS,
        description="CIDRs whose IPVS virtual servers kube-proxy must not touch: an ipvs kube-proxy deletes, at "
        "every sync, each virtual server it did not create outside them (list your own, e.g. keepalived's).",
        json_schema_extra={"items": {"type": "string", "maxLength": 64, "pattern": CIDR_PATTERN}},
    )

    @field_validator("exclude_cidrs")
    @classmethod
    def _exclude_cidrs(cls, values: list[str] | None) -> list[str] | None:
        return _check_cidrs(values, (), CIDR_MESSAGE)


class IPTablesSettings(KubeModel):
    """Settings of kube-proxy's iptables mode (KubeProxyConfiguration.iptables)."""

    sync_period: Duration | None = Field(default=None, description="Full resync interval, e.g. 30s.")
    min_sync_period: Duration | None = Field(default=None, description="Minimum interval between syncs, e.g. 1s.")
    masquerade_all: bool | None = Field(default=None, description="SNAT all traffic sent to Service IPs.")
    masquerade_bit: int | None = Field(
        default=None, ge=0, le=31, description="fwmark bit used to mark packets for SNAT (0-31)."
    )
    localhost_node_ports: bool | None = Field(
        default=None, description="Accept NodePort connections on localhost (route_localnet)."
    )


class NFTablesSettings(KubeModel):
    """Settings of kube-proxy's nftables mode (KubeProxyConfiguration.nftables)."""

    sync_period: Duration | None = Field(default=None, description="Full resync interval, e.g. 30s.")
    min_sync_period: Duration | None = Field(default=None, description="Minimum interval between syncs, e.g. 1s.")
    masquerade_all: bool | None = Field(default=None, description="SNAT all traffic sent to Service IPs.")
    masquerade_bit: int | None = Field(
        default=None, ge=0, le=31, description="fwmark bit used to mark packets for SNAT (0-31)."
    )
    localhost_node_ports: bool | None = Field(
        default=None,
        description="Serve TCP NodePorts on 127.0.0.1 as iptables mode does, through kube-proxy's userspace "
        f"localhost proxy (the alpha feature gate {NFTABLES_LOCALHOST_GATE} of kube-proxy 1.37, rendered into "
        "the revision's featureGates). Needs nodePortAddresses to name loopback, e.g. [primary, localhost]. "
        "UDP NodePorts on localhost stay unserved in nftables mode.",
    )


class CiliumKPRSettings(KubeModel):
    """Settings of Cilium's kube-proxy replacement on the pool's nodes (rendered into the revision's
    CiliumNodeConfig). Only valid with mode cilium-kpr."""

    # The schema's pattern cannot say "no '..' segment" (no lookahead in RE2): a CEL rule does.
    model_config = with_rules(cel(f"!self.socketPath.matches('{SOCKET_PATH_DOT_DOT}')", SOCKET_PATH_MESSAGE,
                                  ".socketPath"))

    socket_path: str = Field(
        default=DEFAULT_CILIUM_SOCKET, max_length=SOCKET_PATH_MAX,
        description="The Cilium agent's REST API socket on the node, which the proxyshift agent reads for "
        "preflight (the agent is present and healthy) and the gate (KubeProxyReplacement on, its Service table "
        "covers the cluster's Services).",
        json_schema_extra={"pattern": SOCKET_PATH_PATTERN},
    )
    load_balancer_algorithm: Literal["random", "maglev"] | None = Field(
        default=None,
        description="How Cilium picks a Service's backend (bpf-lb-algorithm): random, or maglev (consistent "
        "hashing, so a client keeps its backend across nodes). Unset keeps Cilium's default, random.",
    )
    host_namespace_only: bool | None = Field(
        default=None,
        description="Socket-LB only for the node's own processes, pods' traffic balanced per packet "
        "(bpf-lb-sock-hostns-only; for pods whose own proxy, e.g. Istio's sidecar, must see the Service "
        "address). Unset keeps Cilium's default, false.",
    )

    @field_validator("socket_path")
    @classmethod
    def _socket_path(cls, value: str) -> str:
        if not re.match(SOCKET_PATH_PATTERN, value) or re.search(SOCKET_PATH_DOT_DOT, value):
            raise ValueError(SOCKET_PATH_MESSAGE)
        return value


class Stage(KubeModel):
    """One step of a staged rollout: how far to go, then how long to wait."""

    model_config = with_rules(
        cel("has(self.nodes) != has(self.percent)", "a stage sets exactly one of nodes or percent"),
    )

    nodes: int | None = Field(
        default=None, ge=1, description="Migrate this many nodes in total by the end of the stage."
    )
    percent: int | None = Field(
        default=None, ge=1, le=100, description="Migrate this percentage of the selected nodes by the end of the stage."
    )
    pause: Duration | None = Field(
        default=None, description="Wait this long after the stage before the next one starts, e.g. 10m."
    )

    @model_validator(mode="after")
    def _one_target(self) -> Stage:
        if (self.nodes is None) == (self.percent is None):
            raise ValueError("a stage sets exactly one of nodes or percent")
        return self


def _check_max_unavailable(value: int | str) -> int | str:
    # One message for both branches: it is the CEL rule's, what the API server tells the user.
    if (value < 1) if isinstance(value, int) else not PERCENT_RE.match(value):
        raise ValueError(MAX_UNAVAILABLE_MESSAGE)
    return value


class RolloutSettings(KubeModel):
    """How fast the policy moves through its nodes."""

    model_config = with_rules(
        cel(
            "type(self.maxUnavailable) == int ? self.maxUnavailable >= 1 : "
            f"self.maxUnavailable.matches('{PERCENT_PATTERN}')",
            MAX_UNAVAILABLE_MESSAGE,
            ".maxUnavailable",
        ),
        cel(
            "!has(self.stages) || (size(self.stages) > 0 && "
            "has(self.stages[size(self.stages) - 1].percent) && "
            "self.stages[size(self.stages) - 1].percent == 100)",
            "stages must not be empty and the last stage must be percent: 100",
            ".stages",
        ),
        cel("!self.drain || self.cordon", "drain needs cordon: set cordon: true", ".drain"),
    )

    max_unavailable: int | str = Field(
        default=1,
        description="How many selected nodes may be mid-migration at once: a number (>= 1) or a percentage "
        "(1%-100%, rounded down, at least 1).",
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )
    stages: list[Stage] | None = Field(
        default=None,
        max_length=MAX_STAGES,
        description="Optional canary stages, e.g. [{nodes: 1, pause: 10m}, {percent: 50}, {percent: 100}]. "
        "Must end with percent: 100.",
    )
    pause_between_nodes: Duration | None = Field(
        default=None, description="Wait this long after a node is done before starting the next one."
    )
    preflight_ahead: bool = Field(
        default=True,
        description="Run the next nodes' preflight (kernel checks, the Service-behaviour matrix before the switch) "
        "while other nodes are switched and gated; they wait Prepared until a maxUnavailable slot is free (their "
        "ProxyNode keeps phase Preflight with the preflight's answer Succeeded: waiting costs no write). Never "
        "more than maxUnavailable nodes are touched at once either way. Off with pauseBetweenNodes.",
    )
    cordon: bool = Field(default=False, description="Cordon each node while its kube-proxy is switched.")
    drain: bool = Field(
        default=False, description="Evict pods (respecting PodDisruptionBudgets) before the switch; needs cordon."
    )
    drain_timeout: Duration = Field(
        default="10m",
        description="Give up a drain that PodDisruptionBudgets still block after this long: the node is "
        "uncordoned (if we cordoned it) and fails with DrainTimeout, untouched, and the rollout halts.",
    )
    hold_rules: bool = Field(
        default=True,
        description="Between iptables and nftables: before the switch the agent copies the old mode's service "
        "rules under proxyshift's names, so connections the node itself opens keep working while the new "
        "kube-proxy, which deletes the old mode's rules when it starts, has not synced yet. Released as soon as "
        "the new kube-proxy has synced, and by the cleanup.",
    )
    conntrack_cleanup: bool = Field(
        default=True,
        description="After every switch (forward or back) the agent deletes the conntrack entries to Service "
        "addresses that carry no DNAT (TCP SYN_SENT, unreplied UDP): a client whose first packet went out while "
        "the node had no Service rules keeps matching such an entry with its retransmissions, because NAT is "
        "decided on a flow's first packet. Only those entries are touched. False leaves conntrack alone.",
    )
    paused: bool = Field(
        default=False, description="Start no new node while true; nodes already switched finish their step "
        "sequence, nodes not switched yet (in Preflight or Prepared) go back to Pending."
    )

    @field_validator("max_unavailable")
    @classmethod
    def _max_unavailable_in_range(cls, value: int | str) -> int | str:
        return _check_max_unavailable(value)

    @field_validator("stages")
    @classmethod
    def _stages_end_at_100(cls, stages: list[Stage] | None) -> list[Stage] | None:
        if stages is None:
            return None
        if not stages or stages[-1].percent != 100:
            raise ValueError("stages must not be empty and the last stage must be percent: 100")
        return stages

    @model_validator(mode="after")
    def _drain_needs_cordon(self) -> RolloutSettings:
        if self.drain and not self.cordon:
            raise ValueError("drain needs cordon: set cordon: true")
        return self


class PreflightSettings(KubeModel):
    """What the agent checks on a node before anything changes there."""

    load_modules: bool = Field(
        default=False, description="Let the agent modprobe missing kernel modules (grants it SYS_MODULE)."
    )
    extra_modules: list[str] | None = Field(
        default=None,
        max_length=MAX_EXTRA_MODULES,
        description="More kernel modules the node must have, e.g. nf_conntrack_netlink.",
        json_schema_extra={"items": {"type": "string", "pattern": MODULE_NAME_PATTERN, "maxLength": 64}},
    )

    @field_validator("extra_modules")
    @classmethod
    def _module_names(cls, names: list[str] | None) -> list[str] | None:
        for name in names or []:
            if not re.match(MODULE_NAME_PATTERN, name) or len(name) > 64:
                raise ValueError(f"{name!r} is not a kernel module name (lowercase letters, digits, _)")
        return names


class ConntrackSettings(KubeModel):
    """kube-proxy's conntrack settings (KubeProxyConfiguration.conntrack) the policy may set."""

    tcp_be_liberal: bool | None = Field(
        default=None,
        description="Run conntrack in liberal mode for TCP (nf_conntrack_tcp_be_liberal): out-of-window packets "
        "are not marked INVALID. iptables mode drops INVALID packets itself; nftables mode does not, so a "
        "cluster that relied on that drop keeps its behaviour with tcpBeLiberal: true.",
    )


def _unique_rule(field: str) -> dict[str, str]:
    # A list bounded to a few items: the quadratic check stays inside the API server's CEL cost budget.
    return cel(f"!has(self.{field}) || self.{field}.all(x, self.{field}.exists_one(y, y == x))",
               UNIQUE_MESSAGE, f".{field}")


def _check_cidrs(values: list[str] | None, keywords: tuple[str, ...], message: str) -> list[str] | None:
    """Each value a CIDR with its prefix length (or one of `keywords`), none twice."""
    for value in values or []:
        if value in keywords:
            continue
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ValueError(f"{value!r} {message}") from None
        if "/" not in value:
            raise ValueError(f"{value!r} {message}")
    return _check_unique(values)


def _check_unique(values: list[Any] | None) -> list[Any] | None:
    if values is not None and len(set(values)) != len(values):
        raise ValueError(UNIQUE_MESSAGE)
    return values


class BehaviourGateSettings(KubeModel):
    """The behaviour matrix: the node's Services must answer after the switch as they did before."""

    model_config = with_rules(_unique_rule("allowChanges"))

    enabled: bool = Field(
        default=True,
        description="Probe a sample of the cluster's Services from the node and from a pod on it before the "
        "switch and again in the gate; a Service that answered before and does not now fails the gate.",
    )
    sample_per_kind: int = Field(
        default=2, ge=1, le=8,
        description="Services probed per kind (ClusterIP TCP, ClusterIP UDP, NodePort, ClientIP affinity, "
        "internal and external traffic policy Local, no endpoints), chosen in a stable order; the Services "
        "named in gate.probeServices are always probed as well.",
    )
    allow_changes: list[ChangeName] | None = Field(
        default=None,
        max_length=len(CHANGE_NAMES),
        description="Documented behaviour differences this policy accepts (docs/migration-guide.md, \"Service "
        "behaviour\"), e.g. LocalhostNodePorts. A Service that simply stops answering (Reachability) can never "
        "be allowed by name.",
    )
    budget_seconds: float = Field(
        default=1.0, gt=0, le=30, description="Time the probe may take on one node, both paths together."
    )
    confirm: Duration = Field(
        default="30s",
        description="How long a difference must last, probe after probe, before it rolls the node back: a "
        "Service briefly down for a reason of its own (an API server restarting, an endpoint rolling) must not "
        "undo a good migration. A difference the mode makes lasts; within gate.timeout it is confirmed.",
    )

    @field_validator("allow_changes")
    @classmethod
    def _unique_changes(cls, values: list[ChangeName] | None) -> list[ChangeName] | None:
        return _check_unique(values)


class ServiceRef(KubeModel):
    """A ClusterIP Service the gate connects to from the node."""

    namespace: str = Field(default="default", max_length=63, description="Namespace of the Service.")
    name: str = Field(max_length=63, description="Name of the Service.")
    port: int = Field(ge=1, le=65535, description="Service port to connect to over TCP.")


class GateSettings(KubeModel):
    """What the new kube-proxy must prove before a node counts as migrated."""

    timeout: Duration = Field(default="5m", description="Roll the node back if the gate has not passed by then.")
    min_syncs: int = Field(default=1, ge=1, description="Full rule syncs the new kube-proxy must have completed.")
    max_sync_duration_seconds: float | None = Field(
        default=None, gt=0, description="Upper bound on the p99 of kube-proxy's sync duration (seconds)."
    )
    healthz: bool = Field(default=True, description="Require /healthz on the health port to answer 200.")
    probe_services: list[ServiceRef] | None = Field(
        default=None,
        max_length=MAX_PROBE_SERVICES,
        description="ClusterIP Services that must accept a TCP connection from the node; the behaviour probe "
        "always includes them in its sample."
    )
    behaviour: BehaviourGateSettings = Field(
        default_factory=BehaviourGateSettings,
        description="The behaviour matrix compared before and after the switch.",
    )


class CleanupSettings(KubeModel):
    """What happens to the rules of the mode a node left."""

    stale_rules: bool = Field(
        default=True, description="Flush kube-proxy's own objects of the old mode (never a user's rules)."
    )
    in_gate: bool = Field(
        default=True,
        description="Flush inside the gate's probe, right after the new kube-proxy's first sync, so the "
        "behaviour matrix judges the node as it stays, where the new kube-proxy already deleted the old "
        "mode's Service rules at its start (iptables <-> nftables): a rollback finds none either way. "
        "false: always a step of its own after the gate passed (one more agent round trip per node).",
    )


class ProxyPolicySpec(KubeModel):
    """Desired kube-proxy mode for a pool of nodes, and how to get there."""

    model_config = with_rules(
        cel("!has(self.ipvs) || self.mode == 'ipvs'", "ipvs settings are only allowed with mode: ipvs",
            ".ipvs"),
        cel("!has(self.iptables) || self.mode == 'iptables'",
            "iptables settings are only allowed with mode: iptables", ".iptables"),
        cel("!has(self.nftables) || self.mode == 'nftables'",
            "nftables settings are only allowed with mode: nftables", ".nftables"),
        cel(f"!has(self.cilium) || self.mode == '{CILIUM_KPR_MODE}'",
            f"cilium settings are only allowed with mode: {CILIUM_KPR_MODE}", ".cilium"),
        cel(f"self.mode != '{CILIUM_KPR_MODE}' || !has(self.conntrack)", CILIUM_CONNTRACK_MESSAGE, ".conntrack"),
        cel(f"self.mode != '{CILIUM_KPR_MODE}' || !has(self.nodePortAddresses) || "
            "self.nodePortAddresses.all(a, !(a in ['primary', 'localhost', 'all']))",
            CILIUM_NODE_PORT_MESSAGE, ".nodePortAddresses"),
        cel("!has(self.nftables) || !has(self.nftables.localhostNodePorts) || "
            "!self.nftables.localhostNodePorts || (has(self.nodePortAddresses) && "
            "self.nodePortAddresses.exists(a, a == 'localhost' || a.startsWith('127.') || "
            "a.startsWith('::1/')))",
            NFTABLES_LOCALHOST_MESSAGE, ".nftables.localhostNodePorts"),
        _unique_rule("nodePortAddresses"),
    )

    node_selector: LabelSelector = Field(
        description="The pool: nodes whose labels match. {} selects every node."
    )
    control_plane_nodes: Literal["Skip", "Include"] = Field(
        default="Skip",
        description="Skip leaves control-plane nodes (label node-role.kubernetes.io/control-plane or "
        "node-role.kubernetes.io/master) alone even when the selector matches them, and says so in the "
        "ControlPlaneSkipped condition; Include migrates them like any other node.",
    )
    mode: ProxyMode = Field(
        description="The kube-proxy mode the pool runs: iptables, ipvs or nftables; or cilium-kpr: no kube-proxy, "
        "Cilium's eBPF kube-proxy replacement serves the nodes' Services (the node is labelled "
        "proxyshift.io/kube-proxy-replacement=cilium, and the revision's CiliumNodeConfig turns "
        "kube-proxy-replacement on there; see docs/migration-guide.md).")
    ipvs: IPVSSettings | None = Field(default=None, description="ipvs mode settings; only with mode: ipvs.")
    iptables: IPTablesSettings | None = Field(
        default=None, description="iptables mode settings; only with mode: iptables."
    )
    nftables: NFTablesSettings | None = Field(
        default=None, description="nftables mode settings; only with mode: nftables."
    )
    cilium: CiliumKPRSettings | None = Field(
        default=None, description="Cilium kube-proxy replacement settings; only with mode: cilium-kpr."
    )
    node_port_addresses: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None,
        max_length=MAX_NODE_PORT_ADDRESSES,
        description="Addresses kube-proxy serves NodePorts on (KubeProxyConfiguration.nodePortAddresses, every "
        "mode): CIDRs and the keywords primary (the Node's own IPs), localhost, all. Unset keeps the "
        "baseline's value; an unset value means every local address in iptables and ipvs mode but only the "
        "primary node IPs in nftables mode. Set it (e.g. [0.0.0.0/0]) to keep iptables' NodePorts on every "
        "address after a move to nftables. With mode cilium-kpr: CIDRs only, rendered as Cilium's "
        "nodeport-addresses (unset: the addresses of Cilium's devices).",
        json_schema_extra={"items": {"type": "string", "maxLength": 64, "pattern": NODE_PORT_ADDRESS_PATTERN}},
    )
    conntrack: ConntrackSettings | None = Field(
        default=None, description="kube-proxy's conntrack settings, for every kube-proxy mode (not cilium-kpr)."
    )
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Pace of the rollout.")
    preflight: PreflightSettings = Field(default_factory=PreflightSettings, description="Node checks.")
    gate: GateSettings = Field(default_factory=GateSettings, description="What the new kube-proxy must prove.")
    cleanup: CleanupSettings = Field(default_factory=CleanupSettings, description="Stale rule cleanup.")
    deletion_policy: Literal["Revert", "Orphan"] = Field(
        default="Revert",
        description="On delete: Revert returns the nodes to the baseline kube-proxy node by node; "
        "Orphan leaves them where they are.",
    )

    @field_validator("node_port_addresses")
    @classmethod
    def _node_port_addresses(cls, values: list[str] | None) -> list[str] | None:
        return _check_cidrs(values, NODE_PORT_ADDRESS_KEYWORDS, NODE_PORT_ADDRESS_MESSAGE)

    @model_validator(mode="after")
    def _settings_match_mode(self) -> ProxyPolicySpec:
        for name in ("ipvs", "iptables", "nftables"):
            if getattr(self, name) is not None and self.mode != name:
                raise ValueError(f"{name} settings are only allowed with mode: {name}")
        return self

    @model_validator(mode="after")
    def _cilium_kpr_settings(self) -> ProxyPolicySpec:
        if self.cilium is not None and self.mode != CILIUM_KPR_MODE:
            raise ValueError(f"cilium settings are only allowed with mode: {CILIUM_KPR_MODE}")
        if self.mode == CILIUM_KPR_MODE:
            if self.conntrack is not None:
                raise ValueError(CILIUM_CONNTRACK_MESSAGE)
            if any(a in NODE_PORT_ADDRESS_KEYWORDS for a in self.node_port_addresses or []):
                raise ValueError(CILIUM_NODE_PORT_MESSAGE)
        return self

    @model_validator(mode="after")
    def _nftables_localhost_needs_loopback(self) -> ProxyPolicySpec:
        wanted = self.nftables is not None and self.nftables.localhost_node_ports
        if wanted and not any(names_loopback(a) for a in self.node_port_addresses or []):
            raise ValueError(NFTABLES_LOCALHOST_MESSAGE)
        return self

    @property
    def scheduler(self) -> str | None:
        if self.mode != "ipvs":
            return None
        return (self.ipvs or IPVSSettings()).scheduler


NodePhase = Phase


class NodeProgress(KubeModel):
    """A node that is mid-migration."""

    name: str = Field(description="Node name.")
    phase: str = Field(description="Current step of the node.")
    since: str = Field(description="When the node entered this step (RFC 3339).")
    revision: str | None = Field(default=None, description="The revision the node is moving to.")
    message: str = Field(default="", description="What the step is waiting for.")


class NodeFailure(KubeModel):
    """A node that failed or was rolled back, with the reason."""

    name: str = Field(description="Node name.")
    phase: str = Field(description="Failed, RollingBack or RolledBack.")
    reason: str = Field(description="CamelCase reason, e.g. PreflightFailed, GateTimeout.")
    message: str = Field(default="", description="What went wrong, for a person.")
    at: str = Field(description="When it failed (RFC 3339).")


class NodeCounts(KubeModel):
    """How many selected nodes are in each state."""

    selected: int = Field(default=0, description="Nodes the selector matches (and this policy owns).")
    updated: int = Field(default=0, description="Nodes running the policy's current revision.")
    in_flight: int = Field(default=0, description="Nodes mid-migration.")
    pending: int = Field(default=0, description="Nodes still to migrate.")
    failed: int = Field(default=0, description="Nodes that failed or were rolled back.")
    conflicting: int = Field(default=0, description="Selected nodes owned by an older policy.")
    skipped_control_plane: int = Field(
        default=0, description="Control-plane nodes the selector matches, left alone (controlPlaneNodes: Skip)."
    )


class ProxyPolicyStatus(KubeModel):
    """What the operator observed and did. Bounded in size: no list of every node."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    observed_generation: int | None = Field(default=None, description="The spec generation last acted on.")
    phase: str | None = Field(
        default=None, description="Pending, Progressing, Paused, Ready, Degraded, Conflict or Deleting."
    )
    current_revision: str | None = Field(default=None, description="The revision the spec renders to.")
    revision_since: str | None = Field(
        default=None,
        description="When currentRevision last changed to another revision (RFC 3339). No node starts until "
        "the spec has rendered to the same revision for 10s, so a spec edited in quick succession does not move "
        "nodes on every edit.",
    )
    progress: str | None = Field(default=None, description="updated/selected, e.g. 3/5.")
    stage: int | None = Field(default=None, description="Index of the current rollout stage, when staged.")
    stage_started_at: str | None = Field(default=None, description="When the current stage was reached.")
    nodes: NodeCounts = Field(default_factory=NodeCounts, description="Node counts by state.")
    in_flight: list[NodeProgress] = Field(default_factory=list, description="Nodes mid-migration (bounded).")
    failed: list[NodeFailure] = Field(
        default_factory=list, description="Most recent failed or rolled-back nodes (at most 20)."
    )
    conflicting_nodes: list[str] = Field(
        default_factory=list, description="Some nodes owned by an older policy (at most 20 names)."
    )
    retry_token: str | None = Field(default=None, description="Last proxyshift.io/retry value acted on.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, "
                                        "Paused, Conflict and ControlPlaneSkipped.")
    kopf: dict[str, Any] | None = Field(
        default=None,
        description="The operator framework's own bookkeeping (handler progress, last handled spec).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class ProxyPolicy(KubeModel):
    """A desired kube-proxy mode for the nodes a selector picks, rolled out node by node."""

    model_config = KubeModel.model_config | {"extra": "ignore"}

    api_version: str = Field(default="proxyshift.io/v1alpha1")
    kind: str = Field(default="ProxyPolicy")
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ProxyPolicySpec
    status: ProxyPolicyStatus = Field(default_factory=ProxyPolicyStatus)

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))
