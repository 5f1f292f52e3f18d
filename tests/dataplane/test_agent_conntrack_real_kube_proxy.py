"""Clients that started while a node had no Service rules, then the real kube-proxy v1.37 syncs.

What kube-proxy's own conntrack cleanup does at its first sync, measured with the binary (fed by
fake_apiserver.py), and what the agent's conntrack step adds. In both modes the fixed-port UDP
client's un-NATed entry is deleted by kube-proxy itself (CleanStaleEntries) and it is answered
within ~0.1 s of the first sync; the step finds no UDP entry left. The TCP client's un-NATed
SYN_SENT entry outlives the sync in both modes: in iptables mode its retransmissions hang on it
until the step deletes it (then it connects at the next retransmission); in nftables mode the
first retransmission after the sync is refused by kube-proxy's cluster-ips check unless the step
ran before it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import behaviour_topology as bt
import pytest

from localcluster.container import run_in_netns
from proxyshift.agent.conntrack import clean_unnated, list_flows
from proxyshift.api.behaviour import ConntrackParams
from tests.support.kube_proxy_runner import KubeProxy, find_kube_proxy
from tests.support.ps_netns import Netns, need_root

pytestmark = pytest.mark.dataplane

NODE_IP, CLIENT_IP = "198.18.0.11", "198.18.0.12"
TCP_SVC = ("198.19.0.11", 80)  # svc1, endpoints 198.18.16.3 and .4 on 8080
UDP_SVC = ("198.19.0.14", 53)  # udp0 (after svc0..svc3), endpoints 198.18.16.9 and .10 on 5353
ENDPOINTS = [f"198.18.16.{i}" for i in range(1, 11)]


class Clients:
    """A TCP connect and a fixed-port UDP client, both from CLIENT_IP in the node, on threads."""

    def __init__(self, node: Netns) -> None:
        self.tcp_at: float | None = None
        self.tcp_error: OSError | None = None
        self.tcp_error_at: float | None = None
        self.udp_at: float | None = None
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=run_in_netns, args=(node.name, fn), daemon=True)
                        for fn in (self._tcp, self._udp)]
        for t in self.threads:
            t.start()

    def _tcp(self) -> None:
        with socket.socket() as sock:
            sock.bind((CLIENT_IP, 0))
            sock.settimeout(30)
            try:
                sock.connect(TCP_SVC)
                self.tcp_at = time.time()
            except OSError as exc:
                self.tcp_error = exc
                self.tcp_error_at = time.time()

    def _udp(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((CLIENT_IP, 40053))
            sock.connect(UDP_SVC)
            sock.settimeout(0.1)
            while not self.stop.is_set() and self.udp_at is None:
                with contextlib.suppress(OSError):
                    sock.send(b"q\n")
                    if sock.recv(64):
                        self.udp_at = time.time()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(35)


def rules_seen(node: Netns, mode: str, address: str, kp: KubeProxy, timeout: float = 60.0) -> float:
    """Wall time at which kube-proxy's rule for `address` is first seen in the node's kernel."""
    argv = ["nft", "list", "table", "ip", "kube-proxy"] if mode == "nftables" else ["iptables-save", "-t", "nat"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kp.proc.poll() is not None:
            raise RuntimeError(f"kube-proxy exited {kp.proc.returncode}")
        if address in node.run(argv, check=False).stdout:
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"no kube-proxy rule for {address} within {timeout:g} s")


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_kube_proxy_cleans_udp_at_its_first_sync_and_the_step_cleans_tcp(mode: str, tmp_path: Path) -> None:
    need_root()
    if find_kube_proxy() is None:
        pytest.skip("no kube-proxy binary (build the local cluster or set PROXYSHIFT_KUBE_PROXY)")
    node, ep = Netns(), Netns()
    listeners = clients = kp = None
    try:
        node.run(["ip", "link", "set", "lo", "up"])
        node.run(["ip", "addr", "add", f"{CLIENT_IP}/32", "dev", "lo"])
        # As on any node (a CNI's masquerade rule), conntrack tracks flows before kube-proxy starts:
        # a namespace without a nat rule would track nothing.
        node.run(["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "198.18.16.0/24", "!", "-d",
                  "198.18.16.0/24", "-j", "MASQUERADE"])
        node.run(["ip", "link", "add", "veth-ep", "type", "veth", "peer", "name", "eth0", "netns", ep.name])
        node.run(["ip", "link", "set", "veth-ep", "up"])
        node.run(["ip", "route", "add", "198.18.16.0/24", "dev", "veth-ep", "src", CLIENT_IP])
        # Where a default route would send Service traffic; the endpoint namespace drops what is not NATed.
        node.run(["ip", "route", "add", "198.19.0.0/16", "via", ENDPOINTS[0], "dev", "veth-ep", "src", CLIENT_IP])
        ep.run(["ip", "link", "set", "lo", "up"])
        ep.run(["ip", "link", "set", "eth0", "up"])
        for address in ENDPOINTS:
            ep.run(["ip", "addr", "add", f"{address}/32", "dev", "eth0"])
        ep.run(["ip", "route", "add", "198.18.0.0/24", "dev", "eth0"])
        listeners = bt.Listeners({ep.name: "ep"}, udp_addresses=ENDPOINTS)

        clients = Clients(node)  # the gap: no Service rules on the node yet
        time.sleep(0.6)
        early = [f for p in ("TCP", "UDP") for f in list_flows(p, runner=node.run)[0] if f.dst in (TCP_SVC[0],
                                                                                                UDP_SVC[0])]
        assert {(f.protocol, f.nated) for f in early} == {("tcp", False), ("udp", False)}, early

        kp = KubeProxy(node, tmp_path / "kp", mode, services=4, udp_services=1, node_ip=NODE_IP)
        # The first sync, seen in the kernel within ~50 ms (the agent's Probe notices it within 0.1 s).
        synced = rules_seen(node, mode, TCP_SVC[0], kp)
        tcp_stuck = [f for f in list_flows("TCP", runner=node.run)[0] if f.dst == TCP_SVC[0] and not f.nated]
        all_udp = list_flows("UDP", runner=node.run)[0]
        udp_left = [f for f in all_udp if f.dst == UDP_SVC[0] and not f.nated]
        report = clean_unnated(ConntrackParams(service_cidrs=["198.19.0.0/16"]), [NODE_IP, CLIENT_IP],
                               runner=node.run)
        stepped = time.time()
        deadline = time.monotonic() + 10
        while clients.tcp_at is None and clients.tcp_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        udp_after = None if clients.udp_at is None else clients.udp_at - synced
        tcp_after_step = None if clients.tcp_at is None else clients.tcp_at - stepped
        tcp_after_sync = None if clients.tcp_at is None else clients.tcp_at - synced

        def secs(value: float | None) -> str:
            return "never" if value is None else f"{value:+.3f} s"

        print(f"\n{mode} (times from kube-proxy's first sync): UDP client answered {secs(udp_after)}; un-NATed "
              f"entries after the sync: {len(udp_left)} UDP, {len(tcp_stuck)} TCP; step {report.to_k8s()}; "
              f"TCP client connected {secs(tcp_after_sync)} ({secs(tcp_after_step)} after the step; "
              f"error {clients.tcp_error} at {secs(clients.tcp_error_at and clients.tcp_error_at - synced)})")
        # kube-proxy deleted the UDP entry itself (CleanStaleEntries at its first sync), not the TCP one.
        assert udp_left == [] and report.deleted_udp == 0
        assert udp_after is not None and udp_after < 1.0
        assert len(tcp_stuck) == 1 and report.deleted_tcp == 1
        if mode == "iptables":
            # The first SYN retransmission after the step is NATed: within a second of the step while SYNs
            # are retransmitted every second (the first four here, tcp_syn_linear_timeouts). From the
            # sync that adds the step's own lag (the Probe's 0.1 s poll, then the step: ~0.1-0.5 s here).
            # The bounds allow one more retransmission interval for a loaded machine (a CI run saw 1.009 s):
            # they tell "the step freed the flow" from its absence, where the un-NATed entry keeps every
            # retransmission off the rules until it times out (SYN_SENT: 120 s), not one second from two.
            assert tcp_after_step is not None and tcp_after_step < 2.0
            assert tcp_after_sync is not None and tcp_after_sync < 3.0
        else:
            # nftables mode rejects a new-state packet to a ClusterIP that was not DNATed
            # (`ct state new jump cluster-ips-check`, `ip daddr @cluster-ips reject`), and a flow that
            # was never answered is still `new`: the first retransmission after the sync is refused.
            # So the client never hangs: it connects when the step ran before that retransmission, and is
            # refused when the retransmission came first (both seen here, run to run).
            if clients.tcp_error is None:
                assert tcp_after_step is not None and tcp_after_step < 1.0
            else:
                assert isinstance(clients.tcp_error, ConnectionRefusedError), clients.tcp_error
                assert clients.tcp_error_at is not None and clients.tcp_error_at - synced < 1.1
    finally:
        if clients is not None:
            clients.close()
        if kp is not None:
            kp.stop()
        if listeners is not None:
            listeners.close()
        node.delete()
        ep.delete()
