"""The local cluster's pod network: one pod namespace per node, wired as a host-gw CNI wires it.

Real pod traffic enters a node from a veth and crosses PREROUTING (and FORWARD), where the
node's own traffic takes OUTPUT; a gate that only dials from the node never sees the first
path. So each node gets one pod namespace:

- pod range of node i: a /27 in 198.18.32.0/19, node 1 198.18.32.0/27, node 2
  198.18.32.32/27, ..., node 200 198.18.56.224/27 (`pod_cidr(i)`). 198.18.32.0/19 is
  inside the bridge's 198.18.0.0/16 (and so inside kube-proxy's clusterCIDR, the same
  198.18.0.0/16: pods count as cluster-local sources, as on a real cluster) but clear of
  the nodes (198.18.0.0/24), the endpoints (198.18.1.0/24) and the second node
  addresses (198.18.2.0/24); the more specific /27 routes win over the bridge's
  on-link /16 wherever they are installed.
- namespace `ps-node-<i>-pod` (it shares the node prefix, so everything that finds and
  removes a node's namespaces finds this one too), `eth0` = range + 2 (`pod_ip(i)`), one
  route `198.18.0.0/15 via <range + 1>`: the nodes, endpoints, other pods and the
  Service CIDR, through the node. No default route: nothing routes out.
- in the node: veth `pspod0` = range + 1, so the node routes the pod range back over
  the veth (a connected route), and forwards (ip_forward is on in every node).
- host-gw routes `<pod range of node j> via <node j's IP>` in every endpoint namespace,
  in every other node and in the root namespace (where the apiserver listens), so
  replies to a pod come back through its node, where conntrack undoes the DNAT.
  Root's routes go through psbr0 and go away with it.

Only one pod namespace per node: every non-hostNetwork pod the node simulator runs on
a node shares it (and its address), so two such pods on one node must not listen on
the same port.

A node also gets a second address, 198.18.2.<10+i>/32 on its eth0 (`second_address(i)`),
which the Node object does not list: iptables mode serves NodePorts on every local
address, nftables mode with nodePortAddresses unset only on the Node's primary IP, and
this is the address that shows the difference. (The kernel here has no dummy driver,
hence eth0.)

This module only wires what it is told: which namespaces exist is the caller's
(localcluster.network) to know.
"""

from __future__ import annotations

import ipaddress

from localcluster import paths
from proxyshift.commands import run

POD_RANGE = ipaddress.IPv4Network("198.18.32.0/19")
POD_PREFIX = 27
POD_NETNS_SUFFIX = "-pod"
POD_NODE_LINK = "pspod0"
POD_LINK = "eth0"
SECOND_ADDRESS_NETWORK = ipaddress.IPv4Network("198.18.2.0/24")
# The Nodes' spec.podCIDR (`node_pod_cidr`): what a CNI's IPAM hands out on the node (Cilium's
# `--ipam=kubernetes` takes its cilium_host router address from it). A /27 per node in 198.18.64.0/19,
# in kube-proxy's clusterCIDR (198.18.0.0/16) like the pod ranges above but apart from them: an
# address Cilium allocates there never meets a pod namespace's gateway or address.
NODE_POD_CIDR_RANGE = ipaddress.IPv4Network("198.18.64.0/19")
SECOND_ADDRESS_OFFSET = 10  # node i: 198.18.2.<10+i>, the same last octet as its node IP 198.18.0.<10+i>
MAX_POD_NODES = POD_RANGE.num_addresses // 2 ** (32 - POD_PREFIX)  # 256 ranges, more than network.MAX_NODES
IP_TIMEOUT = 10.0


def _check_index(index: int) -> None:
    if not 1 <= index <= min(MAX_POD_NODES, 255 - SECOND_ADDRESS_OFFSET):
        raise ValueError(f"node index {index} has no pod range")


def pod_netns(node: str) -> str:
    """The pod namespace of a node (`ps-node-3` -> `ps-node-3-pod`)."""
    return f"{node}{POD_NETNS_SUFFIX}"


def is_pod_netns(netns: str) -> bool:
    return netns.endswith(POD_NETNS_SUFFIX)


def pod_cidr(index: int) -> ipaddress.IPv4Network:
    """Node `index`'s pod range (a /27)."""
    _check_index(index)
    size = 2 ** (32 - POD_PREFIX)
    return ipaddress.IPv4Network((int(POD_RANGE.network_address) + size * (index - 1), POD_PREFIX))


def node_pod_cidr(index: int) -> ipaddress.IPv4Network:
    """Node `index`'s spec.podCIDR (a /27 of NODE_POD_CIDR_RANGE): for a CNI's IPAM, not podnet's wiring."""
    _check_index(index)
    size = 2 ** (32 - POD_PREFIX)
    return ipaddress.IPv4Network((int(NODE_POD_CIDR_RANGE.network_address) + size * (index - 1), POD_PREFIX))


def pod_gateway(index: int) -> str:
    """The node's end of the pod veth: the pod's next hop."""
    return str(pod_cidr(index).network_address + 1)


def pod_ip(index: int) -> str:
    """The address of node `index`'s pod namespace (what pods there report as status.podIP)."""
    return str(pod_cidr(index).network_address + 2)


def second_address(index: int) -> str:
    """A local address of node `index` that its Node object does not list."""
    _check_index(index)
    return str(SECOND_ADDRESS_NETWORK.network_address + SECOND_ADDRESS_OFFSET + index)


def _ip_batch(netns: str | None, commands: list[str]) -> None:
    """Several `ip` commands in one process (`ip -batch`): one exec per namespace, not per route."""
    if commands:
        run(["ip", *(["-n", netns] if netns else []), "-batch", "-"], input="\n".join(commands) + "\n",
            timeout=IP_TIMEOUT)


def _addresses(netns: str, link: str) -> str:
    return run(["ip", "-n", netns, "-o", "-4", "addr", "show", "dev", link], timeout=IP_TIMEOUT).stdout


def create_pod_netns(node_netns: str, index: int) -> str:
    """Node `index`'s pod namespace, its veth into the node and both ends' addresses and routes (idempotent)."""
    netns = pod_netns(node_netns)
    gateway, address = pod_gateway(index), pod_ip(index)
    if netns not in run(["ip", "netns", "list"], timeout=IP_TIMEOUT).stdout.split():
        run(["ip", "netns", "add", netns], timeout=IP_TIMEOUT)
    node_links = run(["ip", "-n", node_netns, "-o", "link", "show"], timeout=IP_TIMEOUT).stdout
    if f" {POD_NODE_LINK}@" not in node_links:
        run(["ip", "-n", node_netns, "link", "add", POD_NODE_LINK, "type", "veth", "peer", "name", POD_LINK,
             "netns", netns], timeout=IP_TIMEOUT)
    node_side = [] if f" {gateway}/" in _addresses(node_netns, POD_NODE_LINK) else \
        [f"addr add {gateway}/{POD_PREFIX} dev {POD_NODE_LINK}"]
    _ip_batch(node_netns, [*node_side, f"link set {POD_NODE_LINK} up"])
    pod_side = [] if f" {address}/" in _addresses(netns, POD_LINK) else \
        [f"addr add {address}/{POD_PREFIX} dev {POD_LINK}"]
    _ip_batch(netns, [*pod_side, f"link set {POD_LINK} up", "link set lo up",
                      # Everything of the cluster's own (nodes, endpoints, pods, Services), through the node.
                      f"route replace {paths.CLUSTER_CIDR} via {gateway} dev {POD_LINK} src {address}"])
    return netns


def add_second_address(node_netns: str, index: int) -> str:
    """Put node `index`'s second address on its eth0 (idempotent); returns it."""
    address = second_address(index)
    _ip_batch(node_netns, [f"addr replace {address}/32 dev eth0"])
    return address


def host_gw_routes(indices: list[int], node_ips: dict[int, str], *, skip: int | None = None) -> list[str]:
    """`ip` batch lines routing each node's pod range via that node's IP (host-gw), except node `skip`'s."""
    return [f"route replace {pod_cidr(i)} via {node_ips[i]}" for i in indices if i != skip]


def route_pod_ranges(netns: str | None, indices: list[int], node_ips: dict[int, str], *,
                     skip: int | None = None) -> None:
    """Install host-gw routes to these nodes' pod ranges in `netns` (None: the root namespace)."""
    _ip_batch(netns, host_gw_routes(indices, node_ips, skip=skip))


def unroute_pod_range(netns: str | None, index: int) -> None:
    """Remove the route to node `index`'s pod range from `netns`, if it is there."""
    run(["ip", *(["-n", netns] if netns else []), "route", "del", str(pod_cidr(index))], check=False,
        timeout=IP_TIMEOUT)
