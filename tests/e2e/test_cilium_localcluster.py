"""Cilium in the local cluster (issue 19): the real agent as DaemonSet kube-system/cilium, against the API server.

Cilium is installed (CRDs, RBAC, ConfigMap, DaemonSet) but runs on no node until one is labelled
`proxyshift.io/kube-proxy-replacement=cilium`. Then the node simulator runs the pinned agent confined
to that node (its cgroup subtree, netns and mount namespace, localcluster.cilium), and:

- its pod turns Ready, `/v1/healthz` on /var/run/cilium/cilium.sock (the node's hostPath folder) says
  KubeProxyReplacement True, and a ClusterIP and a NodePort Service made through the API server, with
  the test bed's listeners as endpoints, answer a connect from the node's cgroup and netns, translated
  at connect() by socket-LB (no conntrack entry to the Service address, where kube-proxy's DNAT makes one);
- nothing of it is attached at the host's root cgroup, at any cgroup outside the node's subtree, or in
  the host's network namespace;
- label removed: the pod goes, and as on a real node its links pinned in the node's bpffs keep
  socket-LB attached at the node's cgroup (where the node's other containers stay), translating the
  node's connects; what Cilium leaves in the node's namespace and bpffs is recorded, proxyshift's flush
  for leaving cilium-kpr removes it, and kube-proxy serves the node again (by DNAT).

The tests share one Cilium start (module fixture) and run in this file's order; the last one
removes the label. One installs proxyshift (the session's fixture) to prove that its agent's pod on the
node reaches the socket through its own read-only hostPath mount. Wall time: 47 s with `up` without
that install (2 cores): the pod Ready 5.5 s after the label, its datapath loaded at 13 s.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from localcluster import cilium, cilium_install, network, workloads
from localcluster.container import run_in_netns, setpriv_argv
from localcluster.kubeapi import Kube, KubeError
from localcluster.nodesim import volumes
from proxyshift.agent.behaviour import dial_tcp
from proxyshift.agent.flush import flush
from proxyshift.commands import run
from tests.support import bpf_attach
from tests.support.cilium_cluster import cilium_installed_in, node_link_pins
from tests.support.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.cilium]

NAMESPACE = "ps-cilium-e2e"
CLUSTER_IP_SERVICE, NODE_PORT_SERVICE = "kpr-clusterip", "kpr-nodeport"
SERVICE_PORT = 80
READY_SECONDS = 300.0  # the agent's first datapath compile on a loaded 2-core machine
SERVICE_SYNC_SECONDS = 60.0
GONE_SECONDS = 120.0
DETACH_SECONDS = 30.0
AGENT_NAMESPACE = "proxyshift-system"


@dataclass
class CiliumNode:
    name: str
    ip: str
    pod: dict[str, Any]
    socket: Path
    cgroup: Path
    before: dict[str, object]  # bpf_attach.host_snapshot before Cilium started
    endpoints: list[workloads.Endpoint]
    cluster_ip: str
    node_port: int
    state_dir: Path


def _label(kube: Kube, node: str, value: str | None) -> None:
    kube.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {cilium_install.NODE_LABEL: value}}})


def _cilium_pods(kube: Kube, node: str) -> list[dict[str, Any]]:
    return list(kube.get(f"/api/v1/namespaces/{cilium_install.NAMESPACE}/pods", labelSelector="k8s-app=cilium",
                         fieldSelector=f"spec.nodeName={node}")["items"])


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _service(kube: Kube, name: str, kind: str, endpoints: list[workloads.Endpoint]) -> dict[str, Any]:
    body = workloads.service_manifest(name, NAMESPACE, SERVICE_PORT, workloads.DEFAULT_TARGET_PORT)
    body["spec"]["type"] = kind
    try:
        svc = kube.post(f"/api/v1/namespaces/{NAMESPACE}/services", body)
    except KubeError as exc:
        if exc.status != 409:
            raise
        svc = kube.get(f"/api/v1/namespaces/{NAMESPACE}/services/{name}")
    slice_body = workloads.slice_manifest(name, NAMESPACE, endpoints, workloads.DEFAULT_TARGET_PORT)
    try:
        kube.post(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", slice_body)
    except KubeError as exc:
        if exc.status != 409:
            raise
    return dict(svc)


def _conntrack_to(node: str, address: str, port: int) -> list[str]:
    """The node's conntrack entries whose original destination is address:port (kube-proxy's DNAT)."""
    out = run(["conntrack", "-L", "-p", "tcp", "--orig-dst", address, "--dport", str(port)], netns=node,
              timeout=30, check=False).stdout
    return [line for line in out.splitlines() if line.strip()]


def node_cgroup_name(node: CiliumNode) -> str:
    return str(node.cgroup.relative_to(cilium.cgroup2_mount()))


@pytest.fixture(scope="module")
def cilium_installed(cluster: Any) -> Iterator[None]:
    with cilium_installed_in(cluster):
        yield


@pytest.fixture(scope="module")
def cilium_node(cluster: Any, kube: Kube, cilium_installed: None) -> Iterator[CiliumNode]:
    """The last node labelled for Cilium, its pod Ready, two Services with the test bed's listeners."""
    state_dir = cluster.require_local("Cilium's agent")
    node = cluster.nodes[-1]
    # Installed, but on no node until one is labelled: the DaemonSet is disabled by default.
    assert not any(_cilium_pods(kube, name) for name in cluster.nodes)
    endpoints = workloads.create_endpoints(state_dir, 2)
    workloads.ensure_namespace(kube, NAMESPACE)
    cluster_ip = _service(kube, CLUSTER_IP_SERVICE, "ClusterIP", endpoints)["spec"]["clusterIP"]
    node_port = int(_service(kube, NODE_PORT_SERVICE, "NodePort", endpoints)["spec"]["ports"][0]["nodePort"])
    before = bpf_attach.host_snapshot(cilium.cgroup2_mount())
    started = time.monotonic()
    _label(kube, node, cilium_install.NODE_LABEL_VALUE)
    try:
        pods = wait_until(lambda: [p for p in _cilium_pods(kube, node) if _ready(p)], READY_SECONDS,
                          f"the cilium pod Ready on {node}", interval=1.0)
        ready_after = time.monotonic() - started
        socket = cilium_install.node_socket(state_dir, node)
        # Ready (/healthz Ok) comes before the first datapath compile has finished; the host endpoint
        # is ready once bpf_host is on the node's devices.
        wait_until(lambda: cilium.host_endpoint_ready(socket), READY_SECONDS, f"Cilium's host endpoint on {node}")
        print(f"\ncilium pod Ready on {node} {ready_after:.1f}s after the label, its datapath loaded after "
              f"{time.monotonic() - started:.1f}s")
        yield CiliumNode(node, network.node_ip(network.node_index(node)), pods[0], socket, cilium.node_cgroup(node),
                         before, endpoints, cluster_ip, node_port, state_dir)
    finally:
        for log in (network.node_dir(state_dir, node) / "logs").glob("cilium-*.log"):
            # What the agent complained about (RBAC refusals among it), for the run's record.
            complaints = [line[:300] for line in log.read_text(errors="replace").splitlines()
                          if "level=error" in line.lower() or "forbidden" in line.lower()]
            print(f"{log.name}: {len(complaints)} error/forbidden lines", *complaints[:15], sep="\n  ")
        _label(kube, node, None)
        wait_until(lambda: not _cilium_pods(kube, node), GONE_SECONDS, f"the cilium pod gone from {node}")
        kube.delete(f"/api/v1/namespaces/{NAMESPACE}")
        # The session's next tests meet the node as `up` made it: no cilium_host, no CILIUM_* chains.
        cilium_install.remove_node_leftovers(node)
        assert "cilium_" not in run(["ip", "-o", "link", "show"], netns=node).stdout
        assert "CILIUM" not in run(["iptables-save"], netns=node, timeout=120).stdout


def test_labelled_node_runs_cilium_kpr_from_the_api_server(cilium_node: CiliumNode, kube: Kube) -> None:
    node = cilium_node
    health = cilium.api_get(node.socket, "/v1/healthz")
    assert health.get("cilium", {}).get("state") == "Ok", health.get("cilium")
    assert cilium.kpr_enabled(health), health.get("kube-proxy-replacement")
    # Against the API server: its CiliumNode took the Node's spec.podCIDR (--ipam=kubernetes).
    pod_cidr = kube.get(f"/api/v1/nodes/{node.name}")["spec"]["podCIDR"]
    cilium_node_obj = kube.get(f"/apis/cilium.io/v2/ciliumnodes/{node.name}")
    assert cilium_node_obj["spec"]["ipam"].get("podCIDRs") == [pod_cidr], cilium_node_obj["spec"]["ipam"]
    backends = {e.ip for e in node.endpoints}

    def frontends() -> dict[str, set[str]]:
        table: dict[str, set[str]] = {}
        for entry in cilium.api_get(node.socket, "/v1/service"):
            front = entry["spec"]["frontend-address"]
            table[f"{front['ip']}:{front['port']}"] = {b["ip"] for b in entry["spec"].get("backend-addresses") or []}
        return table

    # Cilium lists a NodePort once, on 0.0.0.0 (its maps expand it to the node's addresses).
    wanted = {f"{node.cluster_ip}:{SERVICE_PORT}", f"0.0.0.0:{node.node_port}"}

    def synced() -> dict[str, set[str]] | None:
        table = frontends()
        return table if all(table.get(front) == backends for front in wanted) else None

    table = wait_until(synced, SERVICE_SYNC_SECONDS, f"Cilium's Service table to list {wanted} with {backends}")
    print(f"Cilium's Services on {node.name}: {sorted(table)}")

    names = {e.name for e in node.endpoints}
    for address, port in ((node.cluster_ip, SERVICE_PORT), (node.ip, node.node_port)):
        answer = cilium.dial(node.cgroup, node.name, address, port)
        assert (answer.outcome, answer.payload in names) == ("answered", True), (address, port, answer)
        # Translated at connect() by the node's socket-LB: the packet left for the backend itself, so
        # no conntrack entry to the Service's address, which kube-proxy's DNAT would have made.
        assert _conntrack_to(node.name, address, port) == [], (address, port)
    # The same check sees a connection that kube-proxy (still on the node) did DNAT: a client of the
    # node's netns outside its cgroup is not Cilium's.
    bare = run_in_netns(node.name, dial_tcp, node.cluster_ip, SERVICE_PORT, 5.0)
    assert bare.outcome == "answered", bare
    assert _conntrack_to(node.name, node.cluster_ip, SERVICE_PORT), "kube-proxy's connection left no entry"


def test_nothing_of_cilium_is_attached_to_the_host(cilium_node: CiliumNode) -> None:
    node = cilium_node
    cgroup_root = cilium.cgroup2_mount()
    during = bpf_attach.host_snapshot(cgroup_root)
    # Socket-LB is at the node's cgroup: the agent's cgroup root is the node's subtree.
    assert bpf_attach.socket_lb_at(during, node.cgroup), f"no socket-LB at the node's cgroup {node.cgroup}: {during}"
    # Nothing at the host's root cgroup, at a cgroup outside the node's subtree, in the host's netns.
    reached = bpf_attach.reached_the_host(node.before, during, cgroup_root, [node.cgroup])
    assert reached == [], "\n".join(reached)
    # Its tc programs, devices and chains are the node's.
    node_tcx = run_in_netns(node.name, bpf_attach.host_tcx)
    node_tc = run(["bpftool", "-j", "net", "show"], netns=node.name, timeout=60).stdout
    assert any(key.startswith("eth0/") for key in node_tcx) or "cil_from_netdev" in node_tc, (node_tcx, node_tc)
    assert "cilium_" not in run(["ip", "-o", "link", "show"]).stdout
    assert "cilium_host" in run(["ip", "-o", "link", "show"], netns=node.name).stdout
    assert "CILIUM" not in run(["iptables-save"], timeout=120).stdout


# Run in the proxyshift agent's mount namespace with its credentials: what its own code would see.
HEALTHZ_OVER_SOCKET = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect({cilium_install.SOCKET_PATH!r})
s.sendall(b"GET /v1/healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n")
print(b"".join(iter(lambda: s.recv(65536), b"")).decode())
"""


# In the agent's container: whether /sys/fs/bpf is a bpffs mount there (what the flush checks) and what
# Cilium's folder in it holds.
BPFFS_IN_CONTAINER = """
import os
mounts = [line.split() for line in open("/proc/self/mountinfo")]
bpf = any(f[4] == "/sys/fs/bpf" and f[f.index("-") + 1] == "bpf" for f in mounts)
print("bpffs", bpf, sorted(os.listdir("/sys/fs/bpf/cilium")))
"""


def test_proxyshift_agent_reaches_the_cilium_socket(cilium_node: CiliumNode, cluster: Any, kube: Kube,
                                                   proxyshift_installed: Path) -> None:
    # The proxyshift agent's DaemonSet mounts hostPath /var/run/cilium read-only: on this node that is
    # the node's folder, where Cilium's socket is, and the agent (uid 0 with NET_ADMIN and NET_RAW
    # only) may connect to it. Its hostPath /sys/fs/bpf is the node's bpffs.
    state_dir = cluster.require_local("the proxyshift agent's mounts")
    (pod,) = kube.get(f"/api/v1/namespaces/{AGENT_NAMESPACE}/pods", fieldSelector=f"spec.nodeName={cilium_node.name}",
                      labelSelector="app.kubernetes.io/name=proxyshift-agent")["items"]
    name = pod["metadata"]["name"]
    pid = network.container_pid(state_dir, cilium_node.name, AGENT_NAMESPACE, name, "agent")
    assert pid is not None, name
    # Every container of the node is in the node's cgroup: Cilium's socket-LB translates its connects.
    unified = [line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if line.startswith("0::")]
    assert unified == [f"0::/{node_cgroup_name(cilium_node)}"], unified
    argv = ["nsenter", f"--target={pid}", "--mount", "--",
            *setpriv_argv(0, 0, "NET_ADMIN,NET_RAW", True), sys.executable, "-c", HEALTHZ_OVER_SOCKET]
    # Text mode: the HTTP answer's CRLFs arrive as newlines.
    answer = run(argv, timeout=60).stdout.replace("\r\n", "\n")
    status, _, body = answer.partition("\n\n")
    assert status.startswith("HTTP/1.0 200") or status.startswith("HTTP/1.1 200"), answer[:300]
    assert cilium.kpr_enabled(json.loads(body)), body[:300]
    # Its hostPath /sys/fs/bpf is the node's bpffs, where Cilium pins its links: what its flush unpins.
    listing = run(["nsenter", f"--target={pid}", "--mount", "--", *setpriv_argv(0, 0, "NET_ADMIN,NET_RAW", True),
                   sys.executable, "-c", BPFFS_IN_CONTAINER], timeout=60).stdout
    assert listing.startswith("bpffs True") and "socketlb" in listing, listing


def test_unlabelled_node_loses_cilium_and_keeps_kube_proxy(cilium_node: CiliumNode, kube: Kube) -> None:
    node = cilium_node
    pid = cilium.agent_pid(node.cgroup)
    assert pid is not None, f"no cilium-agent in {node.cgroup}"
    _label(kube, node.name, None)
    wait_until(lambda: not _cilium_pods(kube, node.name), GONE_SECONDS, f"the cilium pod gone from {node.name}")
    assert not Path(f"/proc/{pid}").exists(), "the agent outlived its pod"
    # The node's cgroup stays (the node's other containers are in it), and so does socket-LB: its links
    # are pinned in the node's bpffs, which outlives the agent as a real node's /sys/fs/bpf does.
    bpffs = volumes.node_host_path(network.node_dir(node.state_dir, node.name), volumes.NODE_BPFFS)
    assert bpffs is not None
    pins = node_link_pins(node.state_dir, node.name)
    attached = bpf_attach.cgroup_direct(node.cgroup)
    print(f"\npinned links of the stopped agent: {pins}; still attached at the node's cgroup: {attached}")
    assert "cilium/socketlb/links/cgroup/cil_sock4_connect" in pins, pins
    assert attached, f"socket-LB not attached at {node.cgroup} after the stop"
    # What Cilium leaves in the node's namespace, recorded for the cleanup that flushes it.
    links = [line.split(":")[1].strip().split("@")[0]
             for line in run(["ip", "-o", "link", "show"], netns=node.name).stdout.splitlines()]
    routes = [line for line in run(["ip", "route", "show", "table", "all"], netns=node.name).stdout.splitlines()
              if "cilium" in line]
    chains = sorted({line.split()[0].lstrip(":") for line in run(["iptables-save"], netns=node.name,
                                                                 timeout=120).stdout.splitlines()
                     if line.startswith(":CILIUM")})
    print(f"\nleft on {node.name} after Cilium: links {[x for x in links if x.startswith('cilium')]}, "
          f"routes {routes}, iptables chains {chains}")
    assert {"cilium_host", "cilium_net"} <= set(links), links
    assert chains, "no CILIUM_* chains left: Cilium cleans up after itself now; update the cleanup's list"
    # proxyshift's flush for the node leaving cilium-kpr (what its agent's Cleanup runs) removes all of it.
    report = flush(["cilium-kpr"], "iptables", runner=functools.partial(run, netns=node.name), bpffs=bpffs)
    print(report.message())
    assert report.ok, report.message()
    assert {k: n for s in report.steps for k, n in s.removed.items()}.get("link pins") == len(pins), report.message()
    wait_until(lambda: not bpf_attach.cgroup_direct(node.cgroup), DETACH_SECONDS,
               f"socket-LB detached from {node.cgroup}")
    # kube-proxy never left this node: it serves the ClusterIP as before, to a client of the node's
    # cgroup too, now by DNAT.
    answer = cilium.dial(node.cgroup, node.name, node.cluster_ip, SERVICE_PORT)
    assert answer.outcome == "answered", answer
    assert _conntrack_to(node.name, node.cluster_ip, SERVICE_PORT), "no DNAT entry: who served it?"
