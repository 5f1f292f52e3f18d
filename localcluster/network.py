"""The node half of the local cluster's network: bridge, node and endpoint namespaces, node simulators.

Layout (docs/architecture.md, "Local cluster contracts"):

- bridge `psbr0` in the root namespace, 198.18.0.1/16 (the apiserver advertises it);
- node i: namespace `ps-node-<i>`, veth `psn<i>` <-> `eth0`, 198.18.0.<10+i>/16;
- endpoint n: namespace `ps-ep-<n>`, veth `pse<n>` <-> `eth0`, 198.18.1.<n>/16;
- node i's pod namespace `ps-node-<i>-pod` (pod range a /27 in 198.18.32.0/19) and its
  second address 198.18.2.<10+i>/32: see localcluster.podnet.

No namespace gets a default route. A node does need *some* route to the
Service CIDR, because a locally generated packet is routed before the OUTPUT
hook where kube-proxy DNATs it (with no route, connect() fails with
ENETUNREACH and kube-proxy never sees the packet). That route points into a
veth pair that lives entirely inside the node (`svcsink0` <-> `svcsink1`;
the kernel here has no dummy driver), so a ClusterIP packet that no rule
rewrites dies inside the node instead of reaching the bridge. The route goes
via a gateway that exists only as a permanent neighbour entry: such a packet
is sent and silently lost, as on a real node whose default route takes it to
a router that drops it. An on-link route would make the node ARP for the
ClusterIP itself and fail every socket waiting on it with EHOSTUNREACH three
seconds later, which no real node does (and which would hide what a client
caught in a switch's rule gap really suffers: its SYN retransmissions hang on
an un-NATed conntrack entry).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localcluster import kubeapi, paths, podnet, state
from localcluster.nodesim import node as sim_node

# Node naming lives in paths, which the node simulator reads too (it must not import this module,
# which starts it); these names stay importable from here.
from localcluster.paths import MAX_NODES, NODE_PREFIX, node_index, node_ip, node_name
from proxyshift.commands import CommandError, run

log = logging.getLogger(__name__)

ENDPOINT_PREFIX = "ps-ep-"
NODE_VETH_PREFIX = "psn"
ENDPOINT_VETH_PREFIX = "pse"
VM_TAP_PREFIX = "pstap"  # pstap<n>: a QEMU guest's tap device on the bridge (localcluster.vmnodes)
SINK_LINK = "svcsink0"
SINK_PEER = "svcsink1"
SINK_GATEWAY = "198.18.3.254"  # on no interface: only a permanent neighbour entry on SINK_LINK
SINK_GATEWAY_MAC = "02:00:c6:12:03:fe"  # locally administered; svcsink1 drops frames to it
NODE_SYSCTLS = ("net.ipv4.ip_forward=1",)
MAX_ENDPOINTS = 254  # 198.18.1.1 .. 198.18.1.254
SIMULATOR_START_TIMEOUT = 90.0
CREATED_PATHS_FILE = "created-host-paths.txt"
GUARD_METRIC = "4242"  # names our unreachable route, so teardown removes exactly that one
DEFAULT_KUBELET_VERSION = "v1.37.2"


def endpoint_name(n: int) -> str:
    return f"{ENDPOINT_PREFIX}{n}"


def endpoint_ip(n: int) -> str:
    if not 1 <= n <= MAX_ENDPOINTS:
        raise ValueError(f"endpoint index {n} outside 1..{MAX_ENDPOINTS}")
    return f"198.18.1.{n}"


@dataclass(frozen=True)
class ClusterAccess:
    """What the node half needs from the control plane half's `cluster_info`."""

    kubeconfig: Path
    bin_dir: Path
    api_url: str

    @property
    def api_host_port(self) -> tuple[str, int]:
        rest = self.api_url.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = rest.rpartition(":")
        return (host, int(port)) if host else (rest, 443)


def cluster_access(cluster_info: Any) -> ClusterAccess:
    """Read kubeconfig, bin dir and API URL from a mapping or an object with those attributes.

    Takes controlplane.ClusterInfo or a dict: `kubeconfig`, `bin_dir`, and the API
    URL the nodes use: `node_api_url`, else `api_url`, else https://198.18.0.1:6443
    (the address the apiserver advertises).
    """

    def get(*names: str) -> Any:
        for name in names:
            value = cluster_info.get(name) if isinstance(cluster_info, Mapping) else getattr(
                cluster_info, name, None)
            if value:
                return value
        return None

    kubeconfig = get("kubeconfig", "admin_kubeconfig", "kubeconfig_path")
    bin_dir = get("bin_dir", "bindir")
    if not kubeconfig or not bin_dir:
        raise ValueError(f"cluster_info needs a kubeconfig and a bin_dir, got {cluster_info!r}")
    api_url = get("node_api_url", "api_url") or \
        f"https://{paths.BRIDGE_ADDRESS}:{paths.APISERVER_PORT}"
    return ClusterAccess(Path(kubeconfig), Path(bin_dir), str(api_url))


# --- namespaces and links -------------------------------------------------

def _links() -> set[str]:
    out = run(["ip", "-o", "link", "show"]).stdout
    return {line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line}


def list_namespaces(prefixes: tuple[str, ...] = (NODE_PREFIX, ENDPOINT_PREFIX)) -> list[str]:
    """Our namespaces. Only node and endpoint prefixes: other ps-* namespaces (the dataplane
    tests' ps-test-*) belong to someone else and may be in use."""
    out = run(["ip", "netns", "list"]).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.split() and
                  line.split()[0].startswith(prefixes))


def _guard_route() -> list[str]:
    return ["unreachable", paths.CLUSTER_CIDR, "metric", GUARD_METRIC]


def ensure_bridge() -> None:
    """Create psbr0 with 198.18.0.1/16 in the root namespace (idempotent).

    Also an `unreachable 198.18.0.0/15` route of last resort in the root namespace:
    without it, root-namespace traffic to the cluster's range that the bridge does not
    cover (the Service CIDR 198.19.0.0/16) would follow the host's default route off
    the machine. The bridge's own /16 is more specific and wins.
    """
    name = paths.BRIDGE_NAME
    if f"unreachable {paths.CLUSTER_CIDR}" not in run(["ip", "route", "show", "type", "unreachable"]).stdout:
        run(["ip", "route", "replace", *_guard_route()])
    if name not in _links():
        run(["ip", "link", "add", name, "type", "bridge"])
    address = f"{paths.BRIDGE_ADDRESS}/{paths.BRIDGE_PREFIX}"
    if address not in run(["ip", "-o", "-4", "addr", "show", "dev", name]).stdout:
        run(["ip", "addr", "add", address, "dev", name])
    run(["ip", "link", "set", name, "up"])


def _ensure_netns(netns: str, veth: str, address: str) -> None:
    """Namespace + veth into the bridge + address, with lo up and no default route (idempotent)."""
    if netns not in list_namespaces((netns,)):
        run(["ip", "netns", "add", netns])
    if veth not in _links():
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns])
    run(["ip", "link", "set", veth, "master", paths.BRIDGE_NAME, "up"])
    cidr = f"{address}/{paths.BRIDGE_PREFIX}"
    if cidr not in run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"], netns=netns).stdout:
        run(["ip", "addr", "add", cidr, "dev", "eth0"], netns=netns)
    run(["ip", "link", "set", "eth0", "up"], netns=netns)
    run(["ip", "link", "set", "lo", "up"], netns=netns)


def node_indices() -> list[int]:
    """Indices of the nodes whose namespaces exist (ps-node-<i>, not their pod namespaces)."""
    return sorted(int(n[len(NODE_PREFIX):]) for n in list_namespaces((NODE_PREFIX,))
                  if n[len(NODE_PREFIX):].isdigit())


def endpoint_namespaces() -> list[str]:
    return [n for n in list_namespaces((ENDPOINT_PREFIX,)) if n[len(ENDPOINT_PREFIX):].isdigit()]


def create_node_netns(index: int) -> str:
    """The network side of node `index`: namespace, veth, address, service sink route, sysctls,
    its pod namespace and second address (podnet), and host-gw routes to and from its pod range."""
    netns, ip = node_name(index), node_ip(index)
    _ensure_netns(netns, f"{NODE_VETH_PREFIX}{index}", ip)
    links = run(["ip", "-o", "link", "show"], netns=netns).stdout
    if f" {SINK_LINK}@" not in links:
        run(["ip", "link", "add", SINK_LINK, "type", "veth", "peer", "name", SINK_PEER], netns=netns)
    for link in (SINK_LINK, SINK_PEER):
        run(["ip", "link", "set", link, "up"], netns=netns)
    run(["ip", "neigh", "replace", SINK_GATEWAY, "lladdr", SINK_GATEWAY_MAC, "dev", SINK_LINK, "nud", "permanent"],
        netns=netns)
    run(["ip", "route", "replace", paths.SERVICE_CIDR, "via", SINK_GATEWAY, "dev", SINK_LINK, "onlink", "src", ip],
        netns=netns)
    run(["sysctl", "-q", "-w", *NODE_SYSCTLS], netns=netns)
    podnet.create_pod_netns(netns, index)
    podnet.add_second_address(netns, index)
    nodes = node_indices()
    ips = {i: node_ip(i) for i in nodes}
    podnet.route_pod_ranges(netns, nodes, ips, skip=index)
    for neighbour in [None, *endpoint_namespaces(), *(node_name(i) for i in nodes if i != index)]:
        podnet.route_pod_ranges(neighbour, [index], ips)
    return netns


def create_endpoint_netns(n: int) -> str:
    """Endpoint `n`'s namespace on the bridge, with host-gw routes to every node's pod range."""
    netns = endpoint_name(n)
    _ensure_netns(netns, f"{ENDPOINT_VETH_PREFIX}{n}", endpoint_ip(n))
    nodes = node_indices()
    podnet.route_pod_ranges(netns, nodes, {i: node_ip(i) for i in nodes})
    return netns


# --- nodes ------------------------------------------------------------------

def _node_plan(pools: Mapping[str, int]) -> list[tuple[int, str]]:
    plan: list[tuple[int, str]] = []
    for pool, count in pools.items():
        if count < 0:
            raise ValueError(f"pool {pool!r}: negative node count")
        plan.extend((len(plan) + 1, pool) for _ in range(count))
    if len(plan) > MAX_NODES:
        raise ValueError(f"{len(plan)} nodes requested, at most {MAX_NODES}")
    return plan


def node_dir(state_dir: Path, node: str) -> Path:
    return paths.StateLayout(Path(state_dir)).nodes / node


def simulator_argv(access: ClusterAccess, state_dir: Path, node: str, pool: str,
                   kubelet_version: str = DEFAULT_KUBELET_VERSION, probe_time_scale: float = 1.0) -> list[str]:
    return [sys.executable, "-m", "localcluster.nodesim", "--node", node, "--pool", pool,
            "--node-ip", node_ip(node_index(node)), "--kubeconfig", str(access.kubeconfig),
            "--bin-dir", str(access.bin_dir), "--state-dir", str(state_dir), "--api-url", access.api_url,
            "--kubelet-version", kubelet_version,
            *(["--probe-time-scale", f"{probe_time_scale:g}"] if probe_time_scale != 1 else [])]


def create_nodes(state_dir: Path, cluster_info: Any, pools: dict[str, int], *,
                 kubelet_version: str = DEFAULT_KUBELET_VERSION) -> list[str]:
    """Make the nodes of `pools` (e.g. {"blue": 2, "green": 1}) and return their names.

    For each node: namespace and veth, the Node object and its Lease (created
    here so the scheduler sees the node when this returns), and a detached
    simulator process recorded in state.json. Waits until every simulator has
    reported the node once. Idempotent: an existing namespace or object is kept.
    """
    ensure_bridge()
    return start_nodes(Path(state_dir), cluster_access(cluster_info), _node_plan(pools),
                       kubelet_version=kubelet_version)


def start_nodes(state_dir: Path, access: ClusterAccess, plan: list[tuple[int, str]], *,
                kubelet_version: str = DEFAULT_KUBELET_VERSION,
                start_timeout: float = SIMULATOR_START_TIMEOUT, probe_time_scale: float = 1.0) -> list[str]:
    """The nodes of `plan` ([(index, pool)]) on an existing bridge: what `create_nodes` does after
    `ensure_bridge`. The QEMU guest's nodes (localcluster.vmnodes) start here on a bridge of the guest's
    own, which must not carry the host bridge's address."""
    layout = paths.StateLayout(state_dir)
    state.record_path(state_dir, layout.nodes)
    layout.nodes.mkdir(parents=True, exist_ok=True)
    api = kubeapi.api_client(access.kubeconfig)
    names = []
    started = []
    for index, pool in plan:
        name = node_name(index)
        names.append(name)
        create_node_netns(index)
        sim_node.ensure_node(api, sim_node.node_manifest(name, node_ip(index), pool, kubelet_version,
                                                         str(podnet.node_pod_cidr(index))))
        sim_node.renew_lease(api, name)
        ready_file = node_dir(state_dir, name) / sim_node.READY_FILE
        ready_file.unlink(missing_ok=True)
        proc_name = f"nodesim-{name}"
        if any(r["name"] == proc_name and r["alive"] for r in state.running(state_dir)):
            continue
        node_dir(state_dir, name).mkdir(parents=True, exist_ok=True)
        _mount_node_bpffs(node_dir(state_dir, name))
        argv = simulator_argv(access, state_dir, name, pool, kubelet_version, probe_time_scale)
        proc = state.spawn(state_dir, proc_name, argv)
        started.append((name, proc, ready_file))
    deadline = time.monotonic() + start_timeout
    for name, proc, ready_file in started:
        while not ready_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"node simulator for {name} exited {proc.returncode}; see "
                                   f"{layout.log('nodesim-' + name)}: {_tail(layout.log('nodesim-' + name))}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node simulator for {name} did not report within "
                                   f"{start_timeout:g}s; see {layout.log('nodesim-' + name)}")
            time.sleep(0.1)
    return names


def _mount_node_bpffs(directory: Path) -> None:
    """The node's bpffs (its hostPath /sys/fs/bpf), before any of its containers copies the host's mounts."""
    from localcluster import cilium
    from localcluster.nodesim import volumes

    try:
        volumes.node_bpffs(directory)
    except (OSError, cilium.CiliumError) as exc:
        log.warning("no bpffs for node %s: %s (its Cilium, if any, cannot pin)", directory.name, exc)


def _remove_node_bpffs(directory: Path) -> None:
    """Unpin and unmount the bpffs instances under a node folder (or all nodes'): what the node's Cilium
    left pinned there goes with the node, as a real node's /sys/fs/bpf goes with the machine."""
    from localcluster import cilium

    for mount in sorted(cilium.bpffs_mount_points(), key=lambda p: len(p.parts), reverse=True):
        if mount.is_relative_to(directory):
            try:
                cilium.remove_bpffs(mount)
            except OSError as exc:
                log.warning("node bpffs %s: %s", mount, exc)


def remove_node(state_dir: Path, cluster_info: Any, node: str) -> None:
    """Take one node away: its simulator and containers, its namespace and veth, its Node object.

    For tests of a node that disappears; the Lease goes with the Node (owner reference).
    Idempotent.
    """
    index = node_index(node)
    simulator = simulator_pid(state_dir, node)
    _kill_all([simulator] if simulator else [], grace=5.0)
    for netns in (podnet.pod_netns(node), node):
        if netns in list_namespaces((netns,)):
            _kill_all(_namespace_pids(netns), grace=5.0)
            run(["ip", "netns", "del", netns], check=False)
    for neighbour in [None, *endpoint_namespaces(), *(node_name(i) for i in node_indices())]:
        podnet.unroute_pod_range(neighbour, index)
    if f"{NODE_VETH_PREFIX}{index}" in _links():
        run(["ip", "link", "del", f"{NODE_VETH_PREFIX}{index}"], check=False)
    forget_node(kubeapi.api_client(cluster_access(cluster_info).kubeconfig), node)
    _remove_node_bpffs(node_dir(state_dir, node))
    shutil.rmtree(node_dir(state_dir, node), ignore_errors=True)


def forget_node(kube: kubeapi.Kube, node: str) -> None:
    """Delete a gone node's Node object and its pods from the API (idempotent)."""
    paths_ = [f"/api/v1/nodes/{node}"]
    # The pod garbage collector would delete the pods of a vanished node; it is not among the
    # local cluster's controllers, and a DaemonSet counts such a pod forever.
    pods = kube.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")["items"]
    paths_ += [f"/api/v1/namespaces/{p['metadata']['namespace']}/pods/{p['metadata']['name']}" for p in pods]
    for path in paths_:
        try:
            kube.delete(path, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        except kubeapi.KubeError as exc:
            if exc.status != 404:
                raise


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def container_pid(state_dir: Path, node: str, namespace: str, pod: str, container: str) -> int | None:
    """The pid of a running container (as the node simulator recorded it), or None."""
    pid_file = node_dir(state_dir, node) / "pids" / f"{namespace}_{pod}_{container}.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _state_of(pid) not in ("Z", "X") else None


def simulator_pid(state_dir: Path, node: str) -> int | None:
    """The pid of the node's simulator, or None when it is not running."""
    try:
        pid = int(paths.StateLayout(Path(state_dir)).pid(f"nodesim-{node}").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if "localcluster.nodesim" in _cmdline(pid) and _state_of(pid) not in ("Z", "X") \
        else None


# --- teardown ---------------------------------------------------------------

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _simulator_pids(state_dir: Path) -> list[int]:
    """Running simulators and listeners of this package (by pid file, confirmed by cmdline)."""
    pids = []
    for pid_file in paths.StateLayout(Path(state_dir)).pids.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            cmd = _cmdline(pid)
            if "localcluster.nodesim" in cmd or "localcluster.listener" in cmd:
                pids.append(pid)
    return pids


def _processes_in(netns_inodes: set[int]) -> list[int]:
    """Live processes whose network namespace is one of these (by the namespace's inode)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.stat(proc / "ns" / "net").st_ino in netns_inodes and _state_of(int(proc.name)) not in "ZX":
                    found.append(int(proc.name))
    return found


def _launchers() -> list[int]:
    """Container launchers started for our nodes that may not have joined them yet."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            cmd = _cmdline(int(proc.name))
            if ("localcluster.container" in cmd or "localcluster.cilium confine" in cmd) and \
                    f"--netns {NODE_PREFIX}" in cmd and \
                    _state_of(int(proc.name)) not in "ZX":
                found.append(int(proc.name))
    return found


def _namespace_pids(netns: str) -> list[int]:
    try:
        out = run(["ip", "netns", "pids", netns], check=False).stdout
    except CommandError:
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all(pids: list[int], grace: float) -> None:
    pids = [p for p in set(pids) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Simulators and containers lead their own process groups: take their helpers too.
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if not any(Path(f"/proc/{pid}").exists() and _state_of(pid) not in ("Z", "X") for pid in pids):
                return
            time.sleep(0.05)


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _remove_created_host_paths(state_dir: Path) -> None:
    """Remove mount points the containers had to create on the host, if still empty."""
    record = paths.StateLayout(Path(state_dir)).nodes / CREATED_PATHS_FILE
    try:
        created = [Path(line) for line in record.read_text().splitlines() if line.startswith("/")]
    except OSError:
        return
    for path in sorted(set(created), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.is_file() and path.stat().st_size == 0:
                path.unlink()


def _remove_cilium_cgroups() -> None:
    """The nodes' Cilium cgroups (localcluster.cilium), left by a simulator stopped before its pods.

    Removing one detaches the socket-LB programs attached there; only ps-node-* ones are the cluster's
    (the dataplane tests' agents have cgroups named after their own namespaces).
    """
    from localcluster import cilium

    try:
        root = cilium.cgroup2_mount()
    except cilium.CiliumError:
        return  # no cgroup v2 here: no Cilium ever ran
    for path in root.glob(f"{cilium.CGROUP_PREFIX}{NODE_PREFIX}*"):
        with contextlib.suppress(OSError):
            cilium.remove_cgroup(path)


def remove_all(state_dir: Path) -> None:
    """Remove everything the node half made (idempotent, and safe on a half-made cluster).

    Simulators and listeners first (so nothing restarts a container), then every
    process inside a ps-node-*/ps-ep-* namespace, then the namespaces (which takes their
    veths along), stray veths, the bridge, host mount points and nodes/.
    """
    state_dir = Path(state_dir)
    _kill_all(_simulator_pids(state_dir), grace=3.0)
    namespaces = list_namespaces()
    inodes = set()
    for netns in namespaces:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(Path("/run/netns") / netns).st_ino)
    # Until none is left: a container launcher still starting up sits in the root namespace
    # (it joins the node only just before exec), so `ip netns pids` alone can miss it.
    for attempt in range(5):
        pids = _processes_in(inodes) + _launchers()
        if not pids:
            break
        _kill_all(pids, grace=5.0 if attempt == 0 else 1.0)
    _remove_cilium_cgroups()
    for netns in namespaces:
        run(["ip", "netns", "del", netns], check=False)
    for link in _links():
        if link.startswith((NODE_VETH_PREFIX, ENDPOINT_VETH_PREFIX)) and link[3:].isdigit():
            run(["ip", "link", "del", link], check=False)
        elif link.startswith(VM_TAP_PREFIX) and link[len(VM_TAP_PREFIX):].isdigit():
            # A QEMU guest's NIC on the bridge (localcluster.vmnodes), left by a killed test.
            run(["ip", "link", "del", link], check=False)
    if paths.BRIDGE_NAME in _links():
        run(["ip", "link", "del", paths.BRIDGE_NAME], check=False)
    run(["ip", "route", "del", *_guard_route()], check=False)
    _remove_created_host_paths(state_dir)
    _remove_node_bpffs(paths.StateLayout(state_dir).nodes)
    shutil.rmtree(paths.StateLayout(state_dir).nodes, ignore_errors=True)


def status(state_dir: Path) -> dict[str, Any]:
    """The node half for `localcluster status`: namespaces, bridge ports, simulators."""
    sims = {}
    for pid_file in sorted(paths.StateLayout(Path(state_dir)).pids.glob("nodesim-*.pid")):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            sims[pid_file.stem.removeprefix("nodesim-")] = {
                "pid": pid, "alive": "localcluster.nodesim" in _cmdline(pid)}
    links = _links()
    return {
        "namespaces": list_namespaces(),
        "bridge": paths.BRIDGE_NAME in links,
        "veths": sorted(link for link in links if link.startswith((NODE_VETH_PREFIX, ENDPOINT_VETH_PREFIX))
                        and link[3:].isdigit()),
        "simulators": sims,
    }
