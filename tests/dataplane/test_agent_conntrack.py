"""The post-switch conntrack step against a real conntrack table (no cluster).

A client whose first packet went out while the node had no rule for a Service address gets an
un-NATed conntrack entry; its retransmissions keep matching it after the rule exists. The step
deletes exactly those entries, and the next retransmission is NATed.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections.abc import Iterator

import behaviour_topology as bt
import pytest

from proxyshift.agent.conntrack import Flow, clean_unnated, list_flows
from proxyshift.api.behaviour import ConntrackParams
from tests.support.ps_netns import need_root

pytestmark = pytest.mark.dataplane

PARAMS = ConntrackParams(service_cidrs=[bt.SERVICE_CIDR], node_ports=[bt.NODE_PORT])
LOCAL = [bt.NODE_IP, *bt.NODE_OTHER]
UNRELATED = "198.19.202.5"  # routed like a Service address, but outside the Service CIDR


@pytest.fixture
def topo() -> Iterator[bt.Topology]:
    need_root()
    topology = bt.build()
    try:
        yield topology
    finally:
        topology.close()


class SlowClient:
    """A blocking TCP connect in a namespace, on its own thread; records when it connected."""

    def __init__(self, topo: bt.Topology, where: str, address: str, port: int, timeout: float) -> None:
        self.connected_at: float | None = None
        self.answer: bytes = b""
        self.error: OSError | None = None
        self.started = time.monotonic()
        enter = topo.in_pod if where == "pod" else topo.in_node
        self.thread = threading.Thread(target=enter, args=(self._connect, address, port, timeout), daemon=True)
        self.thread.start()

    def _connect(self, address: str, port: int, timeout: float) -> None:
        with socket.socket() as sock:
            sock.settimeout(timeout)
            try:
                sock.connect((address, port))
                self.connected_at = time.monotonic()
                self.answer = sock.recv(64)
            except OSError as exc:
                self.error = exc


def open_syn(address: str, port: int) -> socket.socket:
    """A connect left in SYN_SENT (non-blocking, never answered), to keep an entry alive."""
    sock = socket.socket()
    sock.setblocking(False)
    assert sock.connect_ex((address, port)) == errno.EINPROGRESS
    return sock


def syn_sent(topo: bt.Topology) -> list[Flow]:
    flows, _ = list_flows("TCP", state="SYN_SENT", runner=topo.node.run)
    return flows


def add_late_rule(topo: bt.Topology, protocol: str = "tcp", port: int = 80, to_port: int = 8080) -> None:
    topo.node.run(["iptables", "-t", "nat", "-I", "PS-SERVICES", "-d", f"{bt.SVC_LATE}/32", "-p", protocol,
                   "--dport", str(port), "-j", "DNAT", "--to-destination", f"{bt.EP_A}:{to_port}"])


@pytest.mark.parametrize("where", ["node", "pod"])
def test_step_unsticks_a_syn_sent_during_the_gap(topo: bt.Topology, where: str) -> None:
    client = SlowClient(topo, where, bt.SVC_LATE, 80, timeout=8)
    # Bystanders: a NATed SYN_SENT to a Service (its endpoint never answers) and an un-NATed one to an
    # address outside the Service CIDR. The step must leave both.
    keep = [topo.in_node(open_syn, bt.SVC_DEAD, 80), topo.in_node(open_syn, UNRELATED, 80)]
    try:
        time.sleep(0.3)
        add_late_rule(topo)  # the new kube-proxy's first sync
        time.sleep(1.3)  # the first SYN retransmission (1 s) went out and matched the old entry
        assert client.connected_at is None and client.error is None
        late = [f for f in syn_sent(topo) if f.dst == bt.SVC_LATE]
        assert late and not late[0].nated, late  # still the un-NATed entry: the rule cannot apply
        report = clean_unnated(PARAMS, LOCAL, runner=topo.node.run)
        stepped = time.monotonic()
        client.thread.join(3)
        assert client.connected_at is not None, client.error
        took = client.connected_at - stepped
        print(f"\n{where} client: connected {took:.3f} s after the conntrack step "
              f"({client.connected_at - client.started:.3f} s after its first SYN); report {report.to_k8s()}")
        assert took < 1.0 and client.answer == b"ep-a\n"
        assert report.deleted_tcp == 1 and report.error is None
        assert report.entries[0].endswith(f"-> {bt.SVC_LATE}:80")
        left = {(f.dst, f.nated) for f in syn_sent(topo)}
        assert (bt.SVC_DEAD, True) in left and (UNRELATED, False) in left, left
    finally:
        for sock in keep:
            sock.close()


def test_without_the_step_the_client_hangs(topo: bt.Topology) -> None:
    """The control: the same client, no step, three retransmissions later still not connected."""
    client = SlowClient(topo, "node", bt.SVC_LATE, 80, timeout=3.6)
    time.sleep(0.3)
    add_late_rule(topo)
    client.thread.join(5)
    assert client.connected_at is None and isinstance(client.error, TimeoutError), client.error


def test_step_unsticks_a_fixed_source_port_udp_flow(topo: bt.Topology) -> None:
    def client_socket() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((bt.NODE_IP, 40053))
        sock.connect((bt.SVC_LATE, 53))
        sock.settimeout(0.1)
        return sock

    sock = topo.in_node(client_socket)

    def ask(seconds: float) -> tuple[bytes | None, float]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                sock.send(b"q\n")
                return sock.recv(64), time.monotonic()
        return None, time.monotonic()

    try:
        assert ask(0.3)[0] is None  # no rule yet: the entry is made un-NATed
        add_late_rule(topo, "udp", 53, 5353)
        assert ask(0.5)[0] is None  # the rule exists, the flow still matches the old entry
        report = clean_unnated(PARAMS, LOCAL, runner=topo.node.run)
        stepped = time.monotonic()
        answer, at = ask(1.0)
        print(f"\nUDP client on a fixed port answered {at - stepped:.3f} s after the step; {report.to_k8s()}")
        assert answer == b"ep-a\n" and at - stepped < 1.0
        assert report.deleted_udp == 1
    finally:
        sock.close()


def test_step_leaves_a_nated_udp_flow(topo: bt.Topology) -> None:
    def answered_flow() -> bytes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1)
            s.sendto(b"q\n", (bt.SVC_UDP, 53))
            return s.recv(64)

    assert topo.in_node(answered_flow) == b"ep-a\n"
    report = clean_unnated(PARAMS, LOCAL, runner=topo.node.run)
    flows, _ = list_flows("UDP", runner=topo.node.run)
    assert report.deleted_udp == 0 and any(f.dst == bt.SVC_UDP and f.nated for f in flows), flows


def test_the_agents_own_checks_read_the_node_addresses_for_nodeports(topo: bt.Topology) -> None:
    """KernelNodeEffects (what the agent loop runs) finds an un-NATed NodePort entry on a node address."""
    from proxyshift.agent.effects import KernelNodeEffects

    def send_from_pod() -> None:
        # A UDP NodePort nobody serves yet, on the node's second address, from a fixed port: the node
        # answers ICMP port unreachable and keeps an unreplied, un-NATed entry.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((bt.POD_IP, 40081))
            for _ in range(3):
                sock.sendto(b"q\n", (bt.NODE_OTHER[0], 30081))
                time.sleep(0.05)

    topo.in_pod(send_from_pod)
    report = topo.in_node(KernelNodeEffects().conntrack, ConntrackParams(node_ports=[30081]))
    assert report.error is None and report.deleted_udp == 1 and report.deleted_tcp == 0, report
    assert report.entries == [f"udp {bt.POD_IP}:40081 -> {bt.NODE_OTHER[0]}:30081"]
    flows, _ = list_flows("UDP", runner=topo.node.run)
    assert not [f for f in flows if f.dport == 30081]
