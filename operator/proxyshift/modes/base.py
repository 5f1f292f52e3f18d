"""The one shape every mode's pure facts take (ModeFacts), and the facts that concern more than one mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from proxyshift.api.diagnostics import CounterSource
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicySpec
from proxyshift.api.proxynode import Mode

# The change a policy names in gate.behaviour.allowChanges to move a node holding foreign IPVS virtual servers.
FOREIGN_IPVS_CHANGE = "ForeignIPVSFlush"
NFTABLES_DELETES_IPVS = ("every start of an nftables kube-proxy deletes them (kube-proxy 1.37 platformCleanup runs "
                         "the ipvs cleanup, which flushes every IPVS virtual server on the host)")
IPVS_PRUNES_UNEXCLUDED = ("an ipvs kube-proxy deletes, at every sync, each IPVS virtual server of its IP family "
                          "that it did not create and whose address is not in ipvs.excludeCIDRs (kube-proxy 1.37 "
                          "cleanLegacyService)")

# Keys of ProxyNode.status.tools and attributes of the agent's ToolVersions.
Tool = Literal["iptables", "ipset", "nft"]

# The kinds of kernel object a mode's kube-proxy leaves on a node. The agent has one prober and one flusher per
# kind, not per mode, because two modes share a tool: ipvs mode's KUBE-* chains are iptables chains, and one
# iptables-save/-restore per family must see both modes' chains to tell the shared ones apart. The order is the
# flush's only safe order: rules first (ipvs mode's rules reference the ipsets the ipvs flush destroys).
# A replacement's devices (Cilium's cilium_host/cilium_net) go next: nothing else references them. Its BPF
# attachments last: its pinned links in the node's BPF filesystem and its legacy tc filters (Cilium's own unload
# order does not matter against the devices: a device's tcx links die with it, their pins stay to be removed).
ObjectKind = Literal["iptables-chains", "ipvs-objects", "nft-tables", "replacement-devices", "bpf-attachments"]
OBJECT_KINDS: tuple[ObjectKind, ...] = get_args(ObjectKind)

# nodePortAddresses when unset, as kube-proxy 1.37 defaults it per mode: every local address, or the node's IPs.
NodePortDefault = Literal["all", "primary"]

# How a mode keeps a ClientIP-affinity Service's client on one endpoint: a per-client timer (iptables' recent
# match, nftables' sets with timeouts), IPVS persistence (per Service port, renewed by every connection), or
# Cilium's affinity map keyed, for socket-LB, by the client's network namespace cookie rather than its address.
AffinityKind = Literal["client-timer", "ipvs-persistence", "netns-cookie"]

# What a mode that replaces kube-proxy needs from the node beyond modules and a minimum release
# (agent/preflight.py checks each one from /proc and /sys): the cgroup v2 hierarchy its socket-LB attaches to,
# the BPF filesystem its maps are pinned in, the kernel's BTF. The BPF program types (sched_cls,
# cgroup_sock_addr with getpeername hooks) come with the minimum release.
KernelFeature = Literal["cgroup2", "bpffs", "btf"]


@dataclass(frozen=True)
class FeatureNeed:
    """A kernel feature the mode needs, and why (the preflight report quotes `why`)."""

    feature: KernelFeature
    why: str


def _no_node_config(spec: ProxyPolicySpec) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Replacement:
    """What runs a node's Services when no kube-proxy does (a mode with kube_proxy False): the agent that
    replaces it, how the node is handed to it, and where its own status is read."""

    # For a person: "Cilium" (as in "Cilium's kube-proxy replacement", "Cilium's agent").
    agent: str
    # The label the node carries while it is in this mode (the replacement's DaemonSet and node config select on
    # it); the node loses it when it moves back to a kube-proxy mode.
    node_label: tuple[str, str]
    # Where the agent's REST API listens on the node, unless the policy says otherwise.
    default_socket: str
    # The per-node config object that turns the replacement on for the labelled nodes (apiVersion, kind), and
    # its settings from the policy (strings, as the agent reads its options).
    node_config_kind: tuple[str, str] = ("", "")
    node_config: Callable[[ProxyPolicySpec], dict[str, str]] = field(default=_no_node_config)


@dataclass(frozen=True)
class ToolNeed:
    """A userspace tool the mode's kube-proxy runs, and the oldest version it accepts (None: any)."""

    tool: Tool
    min_version: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModuleNeed:
    """A kernel module the mode needs, and why (the preflight report quotes `why`)."""

    module: str
    why: str
    # The kernel itself loads it when kube-proxy first uses it (see agent/preflight.py's module doc).
    on_demand: bool = False


@dataclass(frozen=True)
class Owned:
    """The kernel objects one mode's kube-proxy creates, by exact name or a kube-proxy-specific shape, never a
    bare "KUBE-" prefix: a user's KUBE-MYTHING chain or KUBE-ALLOWED ipset is never kube-proxy's.

    Names follow kube-proxy 1.33-1.37 (pkg/proxy/iptables, pkg/proxy/ipvs, pkg/proxy/nftables); agent/ownership.py
    answers "whose is this object?" from every mode's Owned.
    """

    # (table, chain) of the iptables chains it creates; a chain two modes list is shared between them.
    chains: frozenset[tuple[str, str]] = frozenset()
    # Per-Service nat chains: <prefix><16 base32 characters of a hash>.
    service_chain_prefixes: tuple[str, ...] = ()
    # (family, name) of its nft tables.
    nft_tables: tuple[tuple[str, str], ...] = ()
    # The dummy interface it binds Service addresses on.
    interface: str | None = None
    ipsets: frozenset[str] = frozenset()
    # Network devices it creates (a replacement's, e.g. cilium_host/cilium_net), besides `interface`, which is
    # where ipvs mode binds Service addresses (the compatibility report's StrictARP finding asks for that one).
    devices: tuple[str, ...] = ()
    # Where its BPF programs are attached: tc/tcx on its devices, cgroup hooks for socket-LB. For a person;
    # the agent finds the attachments by the two facts below, not by this text.
    bpf_attachments: tuple[str, ...] = ()
    # Its own directory in the node's BPF filesystem (relative to the bpffs root, /sys/fs/bpf): every pin under
    # it is its own. A pinned bpf_link stays attached after its process is gone; unpinning it (the last
    # reference) detaches the program. Never a directory another program shares (tc/globals is iproute2's).
    bpffs_dir: str | None = None
    # The folder names below bpffs_dir that hold its link pins (removed first, as its own unload does).
    bpffs_link_dirs: frozenset[str] = frozenset()
    # The programs it attaches as legacy tc filters (kernels before tcx, or tcx off): the kernel lists such a
    # filter under the name "<program>-<device>", so a filter is its own only by that exact name.
    tc_filter_programs: frozenset[str] = frozenset()


def _no_modules(scheduler: str | None) -> tuple[ModuleNeed, ...]:
    return ()


def _no_localhost(config: KubeProxyConfiguration | None, addresses: list[str]) -> set[str]:
    return set()


def _no_settings(config: KubeProxyConfiguration, spec: ProxyPolicySpec) -> None:
    return None


# (summary, the setting that keeps today's behaviour or None) of a move into a mode that loses localhost NodePorts.
LocalhostLoss = Callable[[frozenset[str]], tuple[str, str | None]]


@dataclass(frozen=True)
class ModeFacts:
    """What one kube-proxy mode needs from a node, what it leaves there, how its settings render and how it
    treats Services differently from the other modes."""

    mode: Mode
    tools: tuple[ToolNeed, ...]
    owned: Owned
    # The kinds of object `owned` names, plus what is found by evidence rather than name (IPVS virtual servers).
    objects: tuple[ObjectKind, ...]
    # Its revision runs a kube-proxy DaemonSet (the revision's ConfigMap holds a KubeProxyConfiguration). False:
    # the node runs no kube-proxy and `replacement` says what serves its Services instead.
    kube_proxy: bool = True
    replacement: Replacement | None = None
    # Kernel features beyond modules and a minimum release (a replacement's eBPF datapath).
    features: tuple[FeatureNeed, ...] = ()
    # It balances a host-network client's connection at connect() (socket-LB, cgroup BPF): the socket talks to
    # the endpoint from the start, so no DNAT is in conntrack and the Service address is never on the wire.
    # The kube-proxy modes NAT per packet.
    socket_lb: bool = False
    session_affinity: AffinityKind = "client-timer"
    # Words for where it serves NodePorts when nodePortAddresses is unset, if not the node-port default's.
    node_port_words: str | None = None
    min_kernel: tuple[int, int] | None = None
    # The mode's kernel modules for an IPVS scheduler (only ipvs mode has one).
    modules: Callable[[str | None], tuple[ModuleNeed, ...]] = field(default=_no_modules)
    # It balances with an IPVS scheduler (spec.ipvs.scheduler) and keeps ClientIP affinity as IPVS persistence.
    ipvs_scheduler: bool = False
    # Modes whose rules this mode's kube-proxy deletes at start, before its first sync (platformCleanup).
    startup_cleans_rules_of: frozenset[Mode] = frozenset()
    # Its kube-proxy flushes every IPVS virtual server at every start, kube-proxy's or not.
    deletes_foreign_ipvs: bool = False
    # At every sync its kube-proxy deletes the IPVS virtual servers (with an address) it did not create, except
    # those whose address is in ipvs.excludeCIDRs.
    prunes_unexcluded_ipvs: bool = False
    # The kind of its objects a rule hold copies under proxyshift's names (agent/hold.py); None: not holdable.
    held_as: ObjectKind | None = None
    # While this mode's kube-proxy still has its rules, they bind a new connection before the hold's copy does:
    # a hold made ahead of the switch (with the preflight, while the node waits for a slot) then serves only what
    # the live rules no longer match. False where the copy runs first and would serve every connection from a
    # frozen snapshot: such a hold is made only at the switch, right before kube-proxy's start deletes the rules.
    hold_yields_to_live_rules: bool = False
    # Lays the policy's settings for this mode (spec.<mode>) onto the rendered KubeProxyConfiguration.
    render_settings: Callable[[KubeProxyConfiguration, ProxyPolicySpec], None] = field(default=_no_settings)
    # Why a cluster should leave it even without a measured speed-up (`proxyshift plan`'s advice).
    deprecation: str | None = None
    # Where `proxyshift diagnose` finds per-endpoint counters on its nodes: its own rules (iptables), the IPVS
    # table's stats (ipvs), or only conntrack (nftables: kube-proxy's rules keep no per-endpoint counters).
    counters: CounterSource = "conntrack"
    # Service behaviour (planner/compat.py, planner/behaviour.py):
    node_port_default: NodePortDefault = "all"
    # It adds filter rules accepting NodePort traffic, so a default-drop host firewall still lets it in.
    opens_node_ports: bool = False
    # It drops conntrack INVALID packets unless conntrack.tcpBeLiberal is set.
    drops_invalid: bool = False
    # The protocols whose NodePorts answer on 127.0.0.1, given its config and nodePortAddresses as IPv4 sees it.
    localhost_protocols: Callable[[KubeProxyConfiguration | None, list[str]], set[str]] = field(
        default=_no_localhost)
    # The setting with which it serves localhost NodePorts only when asked (None: it needs none, or has none).
    localhost_opt_in: str | None = None
    # The compatibility report's words for a move into it that loses localhost NodePorts of these protocols
    # (None: the report's generic words).
    localhost_loss: LocalhostLoss | None = None
    # The behaviour gate's reason, after a move into it, why a localhost NodePort of this protocol stopped
    # answering (None: the gate's generic words).
    localhost_cause: Callable[[str, KubeProxyConfiguration | None], str] | None = None


def overlay(target: Any, settings: Any) -> None:
    """Lay a policy's settings model onto a KubeProxyConfiguration section: only what the policy says is applied,
    a setting it leaves out keeps the baseline's value."""
    for name, value in settings.model_dump(exclude_none=True).items():
        setattr(target, name, value)


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
