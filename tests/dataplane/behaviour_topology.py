"""A node, two endpoints and a pod in network namespaces, with hand-written Service rules.

    pod (198.18.203.2) --veth-- node (.201.1 .202.1 .203.1) --veth-- ep-a (198.18.201.2)
                                                            --veth-- ep-b (198.18.202.2)

The node forwards (as a CNI node does) and routes 198.19.0.0/16 (Service addresses and more) to
ep-a's link, where a packet that no rule rewrote dies: ep-a does not forward and owns no such
address. Nothing has a default route. The endpoints answer their name on TCP 8080 and UDP 5353.

Service rules are iptables nat rules in the node, shaped like kube-proxy's (a services chain jumped
to from PREROUTING and OUTPUT, per-Service chains, `recent` for ClientIP affinity, addrtype LOCAL
NodePorts that leave 127.0.0.1 out, as nftables mode does).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from localcluster.container import run_in_netns
from proxyshift.commands import stop_child
from tests.support.ps_netns import Netns

T = TypeVar("T")

NODE_IP = "198.18.201.1"  # the Node object's InternalIP
NODE_OTHER = ["198.18.202.1", "198.18.203.1"]
EP_A, EP_B = "198.18.201.2", "198.18.202.2"
POD_IP, POD_GW = "198.18.203.2", "198.18.203.1"
SERVICE_CIDR = "198.19.201.0/24"
SVC_TCP = "198.19.201.10"  # two endpoints, random
SVC_UDP = "198.19.201.11"  # port 53 -> ep-a:5353
SVC_AFFINITY = "198.19.201.12"  # two endpoints, ClientIP affinity
SVC_NO_ENDPOINTS = "198.19.201.13"  # REJECT, as kube-proxy does
SVC_DEAD = "198.19.201.14"  # DNAT to an address nobody has: timeout
SVC_LATE = "198.19.201.20"  # no rule until a test adds one
NODE_PORT = 30080  # -> ep-a only (a Local policy with the endpoint on this node)
PROBE_PORT = 9810
ROOT = Path(__file__).resolve().parents[2]

SERVICE_RULES = f"""*nat
:PS-SERVICES - [0:0]
:PS-SVC-TCP - [0:0]
:PS-SVC-AFF - [0:0]
:PS-SEP-A - [0:0]
:PS-SEP-B - [0:0]
:PS-SEP-AFF-A - [0:0]
:PS-SEP-AFF-B - [0:0]
:PS-NODEPORTS - [0:0]
-A PREROUTING -i veth-pod -j PS-SERVICES
-A PREROUTING ! -i veth-pod -j PS-SERVICES
-A OUTPUT -j PS-SERVICES
-A PS-SERVICES -d {SVC_TCP}/32 -p tcp --dport 80 -j PS-SVC-TCP
-A PS-SERVICES -d {SVC_UDP}/32 -p udp --dport 53 -j DNAT --to-destination {EP_A}:5353
-A PS-SERVICES -d {SVC_AFFINITY}/32 -p tcp --dport 80 -j PS-SVC-AFF
-A PS-SERVICES -d {SVC_DEAD}/32 -p tcp --dport 80 -j DNAT --to-destination 198.18.201.99:8080
-A PS-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j PS-NODEPORTS
-A PS-NODEPORTS -p tcp --dport {NODE_PORT} -j DNAT --to-destination {EP_A}:8080
-A PS-SVC-TCP -m statistic --mode random --probability 0.5 -j PS-SEP-A
-A PS-SVC-TCP -j PS-SEP-B
-A PS-SEP-A -p tcp -j DNAT --to-destination {EP_A}:8080
-A PS-SEP-B -p tcp -j DNAT --to-destination {EP_B}:8080
-A PS-SVC-AFF -m recent --name PSAFFA --rcheck --seconds 600 --reap -j PS-SEP-AFF-A
-A PS-SVC-AFF -m recent --name PSAFFB --rcheck --seconds 600 --reap -j PS-SEP-AFF-B
-A PS-SVC-AFF -m statistic --mode random --probability 0.5 -j PS-SEP-AFF-A
-A PS-SVC-AFF -j PS-SEP-AFF-B
-A PS-SEP-AFF-A -m recent --name PSAFFA --set -p tcp -j DNAT --to-destination {EP_A}:8080
-A PS-SEP-AFF-B -m recent --name PSAFFB --set -p tcp -j DNAT --to-destination {EP_B}:8080
COMMIT
*filter
:PS-REJECT - [0:0]
-A OUTPUT -j PS-REJECT
-A FORWARD -j PS-REJECT
-A PS-REJECT -d {SVC_NO_ENDPOINTS}/32 -p tcp --dport 80 -j REJECT --reject-with tcp-reset
COMMIT
"""


class Listeners:
    """TCP 8080 and UDP 5353 in each endpoint namespace, answering the endpoint's name."""

    def __init__(self, endpoints: dict[str, str], *, udp_addresses: list[str] | None = None) -> None:
        """udp_addresses: bind UDP on each of these instead of the wildcard, so that a reply leaves
        from the address the request came to (a wildcard socket answers from the primary address,
        which conntrack does not match to a NATed flow's reply tuple)."""
        self.stop = threading.Event()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        for netns, name in endpoints.items():
            tcp = run_in_netns(netns, _bound, socket.SOCK_STREAM, 8080)
            udps = [run_in_netns(netns, _bound, socket.SOCK_DGRAM, 5353, a) for a in udp_addresses or ["0.0.0.0"]]
            self.sockets += [tcp, *udps]
            for target, sock in ((self._tcp, tcp), *((self._udp, u) for u in udps)):
                t = threading.Thread(target=target, args=(sock, name.encode() + b"\n"), daemon=True)
                t.start()
                self.threads.append(t)

    def _tcp(self, sock: socket.socket, answer: bytes) -> None:
        sock.listen(128)
        sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn, contextlib.suppress(OSError):
                conn.sendall(answer)

    def _udp(self, sock: socket.socket, answer: bytes) -> None:
        sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                _, peer = sock.recvfrom(512)
            except (TimeoutError, OSError):
                continue
            with contextlib.suppress(OSError):
                sock.sendto(answer, peer)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        for s in self.sockets:
            s.close()


def _bound(kind: int, port: int, address: str = "0.0.0.0") -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    return sock


@dataclass
class Topology:
    node: Netns
    ep_a: Netns
    ep_b: Netns
    pod: Netns
    listeners: Listeners | None = None
    probe_server: subprocess.Popen[bytes] | None = None
    made: list[Netns] = field(default_factory=list)

    def in_node(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return run_in_netns(self.node.name, fn, *args, **kwargs)

    def in_pod(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return run_in_netns(self.pod.name, fn, *args, **kwargs)

    def counter(self, table: str, chain: str, match: str) -> int:
        """Packets counted by the first rule of `chain` whose text contains `match`."""
        for line in self.node.run(["iptables-save", "-c", "-t", table]).stdout.splitlines():
            if f"-A {chain} " in line and match in line:
                return int(line.split("]", 1)[0].lstrip("[").split(":")[0])
        raise AssertionError(f"no rule in {table}/{chain} matching {match!r}")

    def start_probe_server(self) -> str:
        """`proxyshift probe-server` as its own process in the pod namespace; returns its ip:port."""
        self.probe_server = start_probe_server(self.pod, POD_IP, self.node)
        return f"{POD_IP}:{PROBE_PORT}"

    def close(self) -> None:
        if self.probe_server is not None:
            stop_child(self.probe_server, grace=5)
        if self.listeners is not None:
            self.listeners.close()
        for ns in self.made:
            ns.delete()


def start_probe_server(pod: Netns, address: str, reach_from: Netns) -> subprocess.Popen[bytes]:
    """`proxyshift probe-server --listen ADDRESS:9810` in `pod`, waited for from `reach_from`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator")}
    proc = subprocess.Popen(
        ["ip", "netns", "exec", pod.name, sys.executable, "-m", "proxyshift.cli", "probe-server",
         "--listen", f"{address}:{PROBE_PORT}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"probe server exited: {proc.stderr.read()!r}")  # type: ignore[union-attr]  # PIPE
        if run_in_netns(reach_from.name, _connects, address, PROBE_PORT):
            return proc
        time.sleep(0.1)
    stop_child(proc, grace=5)
    raise AssertionError("probe server did not start listening")


def _connects(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
        return True
    return False


def _link(node: Netns, other: Netns, node_if: str, node_addr: str, other_addr: str) -> None:
    node.run(["ip", "link", "add", node_if, "type", "veth", "peer", "name", "eth0", "netns", other.name])
    node.run(["ip", "addr", "add", f"{node_addr}/24", "dev", node_if])
    node.run(["ip", "link", "set", node_if, "up"])
    other.run(["ip", "addr", "add", f"{other_addr}/24", "dev", "eth0"])
    other.run(["ip", "link", "set", "eth0", "up"])
    other.run(["ip", "link", "set", "lo", "up"])
    other.run(["ip", "route", "add", "198.18.0.0/15", "via", node_addr])


def build(*, rules: bool = True) -> Topology:
    made: list[Netns] = []
    try:
        node, ep_a, ep_b, pod = (Netns() for _ in range(4))
        made += [node, ep_a, ep_b, pod]
        topo = Topology(node, ep_a, ep_b, pod, made=made)
        node.run(["ip", "link", "set", "lo", "up"])
        node.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _link(node, ep_a, "veth-a", NODE_IP, EP_A)
        _link(node, ep_b, "veth-b", NODE_OTHER[0], EP_B)
        _link(node, pod, "veth-pod", NODE_OTHER[1], POD_IP)
        # Where a node's default route would take an un-NATed Service packet; ep-a drops it.
        node.run(["ip", "route", "add", "198.19.0.0/16", "via", EP_A])
        if rules:
            node.run(["iptables-restore", "--noflush"], input=SERVICE_RULES)
        topo.listeners = Listeners({ep_a.name: "ep-a", ep_b.name: "ep-b"})
        return topo
    except BaseException:
        for ns in made:
            ns.delete()
        raise

