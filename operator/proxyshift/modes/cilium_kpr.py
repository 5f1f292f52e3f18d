"""Cilium's kube-proxy replacement (KPR): the pure facts of a node that runs no kube-proxy (issue 19).

Not a kube-proxy mode: a revision of it has no kube-proxy DaemonSet. The node is handed to Cilium by a label
(REPLACEMENT_LABEL, which Cilium's DaemonSet and the revision's CiliumNodeConfig select on) and kube-proxy
leaves it by the revision mechanism, as for any other move. What differs for Services (Cilium v1.20's
"Kubernetes Without kube-proxy" documentation, bpf/bpf_sock.c):

- socket-LB: a host-network client's connect()/sendmsg() is translated by cgroup BPF programs before a packet
  exists, so the socket talks to the endpoint from the start; no DNAT is in conntrack and the Service address
  never appears on the wire (getpeername() is translated back). kube-proxy translates every packet.
- NodePorts: served on the addresses of Cilium's devices (--devices, auto-detected: the interfaces with the
  node's IPs and routes), or on nodeport-addresses when set; and on 127.0.0.1 for TCP and UDP from the node
  itself (socket-LB's wildcard lookup for loopback and host addresses).
- NodePort traffic is handled at tc ingress, before netfilter: a host firewall neither needs to open NodePorts
  nor can it drop them with iptables INPUT rules. Its own connection tracking reverse-translates replies, so
  the INVALID drop kube-proxy adds has nothing to protect.
- ClientIP session affinity is kept in Cilium's own map (default timeout three hours), keyed for socket-LB by
  the client's network namespace cookie rather than its address.
"""

from __future__ import annotations

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import DEFAULT_CILIUM_SOCKET, ProxyPolicySpec
from proxyshift.modes.base import FeatureNeed, ModeFacts, Owned, Replacement
from proxyshift.modes.iptables import contains_loopback

# The contract with whatever runs Cilium on the node (the test bed's DaemonSet, a real cluster's Cilium
# DaemonSet or CiliumNodeConfig): the node carries this label exactly while it is in mode cilium-kpr.
REPLACEMENT_LABEL = ("proxyshift.io/kube-proxy-replacement", "cilium")

# Cilium's devices on a node in native routing (no tunnel device: the test bed and the documented
# migration route both run without one), and its iptables chains (pkg/datapath/iptables: CILIUM_INPUT,
# CILIUM_OUTPUT_raw, CILIUM_POST_nat, ...).
CILIUM_DEVICES = ("cilium_host", "cilium_net")
# Exact names, never a bare CILIUM_ prefix: a user's CILIUM_MINE is not Cilium's. Cilium renames its chains
# OLD_<name> while it replaces them; a stop at that moment leaves those.
_CILIUM_CHAINS = (("filter", "CILIUM_INPUT"), ("filter", "CILIUM_OUTPUT"), ("filter", "CILIUM_FORWARD"),
                  ("nat", "CILIUM_PRE_nat"), ("nat", "CILIUM_POST_nat"), ("nat", "CILIUM_OUTPUT_nat"),
                  ("raw", "CILIUM_PRE_raw"), ("raw", "CILIUM_OUTPUT_raw"),
                  ("mangle", "CILIUM_PRE_mangle"), ("mangle", "CILIUM_POST_mangle"))
CILIUM_CHAINS = frozenset(_CILIUM_CHAINS) | {(table, f"OLD_{chain}") for table, chain in _CILIUM_CHAINS}

# Cilium's directory in the node's BPF filesystem (v1.20.2 pkg/bpf/bpffs_linux.go CiliumPath: <bpf-root>/cilium).
# It pins its bpf_links there, which keep its programs attached after the agent is gone:
#   socketlb/links/cgroup/<program>     socket-LB at its cgroup root (pkg/socketlb/socketlb.go cgroupLinkPath,
#                                       pkg/socketlb/cgroup.go attachCgroup)
#   devices/<device>/links/<program>    tcx (or XDP) on the node's devices and cilium_host/cilium_net
#                                       (pkg/datapath/loader/paths.go bpffsDeviceLinksDir, tcx.go attachTCX)
#   endpoints/<id>/links/<program>      tcx on a pod's veth (paths.go bpffsEndpointLinksDir)
# and plugin pins beside them (plugin_links, plugins, plugin_pins). Its maps are pinned in tc/globals (iproute2's
# shared folder, names cilium_*), which the flush leaves: no program reads them once the links are gone.
CILIUM_BPFFS_DIR = "cilium"
# The directory name under which Cilium pins links: unpinned first, as Cilium's own unload does (netdev.go: "remove
# the device links directory first", before plugin pins).
CILIUM_LINK_DIRS = frozenset({"links", "plugin_links"})
# Its tc programs (pkg/datapath/loader: host.go, endpoint.go, overlay.go, wireguard.go). With legacy tc (before
# tcx, or --enable-tcx=false) a filter is named "<program>-<device>" (tc.go upsertTCProgram) and no pin holds it.
CILIUM_TC_PROGRAMS = frozenset({"cil_from_netdev", "cil_to_netdev", "cil_from_host", "cil_to_host",
                                "cil_from_container", "cil_to_container", "cil_from_overlay", "cil_to_overlay",
                                "cil_from_wireguard", "cil_to_wireguard"})

OWNED = Owned(
    chains=CILIUM_CHAINS,
    devices=CILIUM_DEVICES,
    bpf_attachments=(
        "tc/tcx ingress and egress on its devices and on the node's native devices (cil_from_netdev, "
        "cil_to_netdev, cil_from_host, cil_to_host)",
        "cgroup connect4/sendmsg4/recvmsg4/getpeername4 (and the v6 ones) at its cgroup root: socket-LB",
    ),
    bpffs_dir=CILIUM_BPFFS_DIR,
    bpffs_link_dirs=CILIUM_LINK_DIRS,
    tc_filter_programs=CILIUM_TC_PROGRAMS,
)

FEATURES = (
    FeatureNeed("cgroup2", "socket-LB attaches its programs to a cgroup v2 hierarchy"),
    FeatureNeed("bpffs", "Cilium pins its maps in the BPF filesystem (/sys/fs/bpf), so they outlive a restart"),
    FeatureNeed("btf", "Cilium's datapath needs the kernel's BTF (/sys/kernel/btf/vmlinux)"),
)
# Cilium v1.20's minimum: its tc (sched_cls) datapath and socket-LB's cgroup_sock_addr programs with the
# getpeername hooks. It attaches with tcx on 6.6 and later, with tc's clsact before: both work.
CILIUM_MIN_KERNEL = (5, 10)


def node_config(spec: ProxyPolicySpec) -> dict[str, str]:
    """The Cilium agent options a revision sets on its nodes (CiliumNodeConfig.spec.defaults): strings, as Cilium
    reads them from its ConfigMap. What the policy leaves unset stays Cilium's own default."""
    defaults = {"kube-proxy-replacement": "true"}
    settings = spec.cilium
    if settings is not None and settings.load_balancer_algorithm is not None:
        defaults["bpf-lb-algorithm"] = settings.load_balancer_algorithm
    if settings is not None and settings.host_namespace_only is not None:
        defaults["bpf-lb-sock-hostns-only"] = "true" if settings.host_namespace_only else "false"
    if spec.node_port_addresses is not None:
        defaults["nodeport-addresses"] = ",".join(spec.node_port_addresses)
    return defaults


def render_settings(config: KubeProxyConfiguration, spec: ProxyPolicySpec) -> None:
    # No kube-proxy runs the revision: its settings are the CiliumNodeConfig's (node_config above, rendered by
    # render/replacement.py), and the KubeProxyConfiguration the compatibility report reads carries only mode and
    # nodePortAddresses.
    return None


def localhost_protocols(config: KubeProxyConfiguration | None, addresses: list[str]) -> set[str]:
    """socket-LB serves NodePorts on loopback from the node itself, TCP and UDP alike. With nodeport-addresses
    set and leaving loopback out the report reads them as lost: the conservative reading (the behaviour gate
    measures what the node really does)."""
    if not addresses or any(contains_loopback(a) for a in addresses):
        return {"TCP", "UDP"}
    return set()


def localhost_cause(protocol: str, config: KubeProxyConfiguration | None) -> str:
    return ("Cilium's socket-LB serves localhost NodePorts only to clients in its cgroup: check that Cilium's "
            "agent runs on the node with KubeProxyReplacement on (or allow the change LocalhostNodePorts)")


FACTS = ModeFacts(
    mode="cilium-kpr",
    # No kube-proxy tools: Cilium's agent brings its own datapath.
    tools=(),
    owned=OWNED,
    # What a stopped Cilium agent leaves: its chains (the iptables flusher removes them by name), its devices
    # with their routes, and its BPF attachments (its pinned links, which keep socket-LB and tcx attached after
    # it is gone, and legacy tc filters). Never while its agent answers (agent/flush/__init__.py).
    objects=("iptables-chains", "replacement-devices", "bpf-attachments"),
    kube_proxy=False,
    replacement=Replacement(agent="Cilium", node_label=REPLACEMENT_LABEL, default_socket=DEFAULT_CILIUM_SOCKET,
                            # Cilium's documented per-node migration (v1.16 and later: cilium.io/v2).
                            node_config_kind=("cilium.io/v2", "CiliumNodeConfig"), node_config=node_config),
    features=FEATURES,
    min_kernel=CILIUM_MIN_KERNEL,
    # Nothing of it to hold: a kube-proxy starting after it deletes nothing of Cilium's, and Cilium's agent
    # starting beside kube-proxy leaves kube-proxy's rules alone.
    held_as=None,
    render_settings=render_settings,
    counters="conntrack",
    socket_lb=True,
    session_affinity="netns-cookie",
    node_port_default="primary",
    node_port_words="the addresses of Cilium's devices (--devices: the interfaces with the node's IPs)",
    # NodePorts are handled at tc ingress, before netfilter: no filter rule is needed to let them in.
    opens_node_ports=True,
    drops_invalid=False,
    localhost_protocols=localhost_protocols,
    localhost_cause=localhost_cause,
)
