"""Issue 13's conntrack item on the local cluster: clients whose first packet went out in the switch's gap.

NAT is decided on a flow's first packet. A TCP connect whose SYN leaves while a node has no Service
rules creates an un-NATed conntrack entry; its retransmissions keep matching that entry after the new
kube-proxy has written its rules, so the connect hangs through its SYN retries. The agent's conntrack
step (every probe after a switch) deletes such entries; the next retransmission is NATed.

The gap is made on purpose, with the rule hold off: one node moves nftables -> iptables, and the new
iptables kube-proxy deletes the nftables kube-proxy's table when it starts, then syncs its own rules
(v1.37 cmd/kube-proxy/app/server_linux.go platformCleanup). Clients in the node's namespace start a
TCP connect every 20 ms and send a fixed-source-port UDP request every 50 ms across the switch, while
a watcher in the node sees when the old table went and when the new rules came. The same switch with
`rollout.conntrackCleanup: false` is the control.

(The move to nftables is not the one measured: nftables mode rejects a not-DNATed `ct state new`
packet to a ClusterIP, so an in-gap client is refused at its first retransmission after the sync
unless the step ran first; a race, docs/agent.md.)
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import re
import selectors
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from localcluster.behaviour_workloads import BehaviourWorkloads
from localcluster.container import run_in_netns
from tests.support.operator_harness import Harness, policy

pytestmark = pytest.mark.e2e

NODE = "ps-node-1"
NAME = "conntrack-gap"
TCP_INTERVAL = 0.02
UDP_INTERVAL = 0.05
UDP_SOURCE_PORT = 40053
CONNECT_TIMEOUT = 10.0  # past the SYN retransmissions at +1, +3 and +7 s
WATCH_INTERVAL = 0.02
READY_TIMEOUT = 300
RESCUE_SECONDS = 1.0
# How late after the new rules the step may run (the agent notices the sync, lists, deletes) before a
# caught client's next retransmission must be NATed.
STEP_ALLOWANCE = 0.5
RETRANSMIT_SLACK = 0.15


@dataclass
class Attempt:
    started: float
    ended: float | None = None
    error: int | None = None  # errno; 0 connected; None still pending


@dataclass
class Traffic:
    attempts: list[Attempt] = field(default_factory=list)
    udp_sent: list[float] = field(default_factory=list)
    udp_answers: list[float] = field(default_factory=list)


def _clients(stop: threading.Event, tcp: tuple[str, int], udp: tuple[str, int], out: Traffic) -> None:
    """In the node's namespace: a new non-blocking TCP connect every TCP_INTERVAL, one UDP socket."""
    sel = selectors.DefaultSelector()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("0.0.0.0", UDP_SOURCE_PORT))
    u.connect(udp)
    u.setblocking(False)
    sel.register(u, selectors.EVENT_READ, None)
    pending: dict[socket.socket, Attempt] = {}
    next_tcp = next_udp = time.time()
    try:
        while not stop.is_set() or pending:
            now = time.time()
            if not stop.is_set() and now >= next_tcp:
                s = socket.socket()
                s.setblocking(False)
                a = Attempt(started=now)
                code = s.connect_ex(tcp)
                if code in (0, errno.EINPROGRESS):
                    pending[s] = a
                    sel.register(s, selectors.EVENT_WRITE, a)
                else:
                    a.ended, a.error = now, code
                    s.close()
                out.attempts.append(a)
                next_tcp += TCP_INTERVAL
            if not stop.is_set() and now >= next_udp:
                with contextlib.suppress(OSError):
                    u.send(b"q\n")
                    out.udp_sent.append(now)
                next_udp += UDP_INTERVAL
            for key, _ in sel.select(timeout=0.005):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        while u.recv(256):
                            out.udp_answers.append(time.time())
                    continue
                s = key.fileobj  # type: ignore[assignment]  # registered as sockets only
                a = key.data
                a.ended, a.error = time.time(), s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                sel.unregister(s)
                s.close()
                del pending[s]
            now = time.time()
            for s, a in list(pending.items()):
                if now - a.started > CONNECT_TIMEOUT:
                    a.ended, a.error = now, errno.ETIMEDOUT
                    sel.unregister(s)
                    s.close()
                    del pending[s]
    finally:
        for s in pending:
            s.close()
        u.close()


def syn_retransmissions(started: float) -> list[float]:
    """When this kernel resends a SYN sent at `started`: every second for the first
    tcp_syn_linear_timeouts (6.x kernels), then doubling, tcp_syn_retries in all."""
    def sysctl(name: str, default: int) -> int:
        try:
            return int(Path(f"/proc/sys/net/ipv4/{name}").read_text())
        except (OSError, ValueError):
            return default

    linear, retries = sysctl("tcp_syn_linear_timeouts", 0), sysctl("tcp_syn_retries", 6)
    at, rto, times = started, 1.0, []
    for n in range(retries):
        at += rto
        times.append(at)
        if n + 1 >= linear:
            rto *= 2
    return times


@dataclass
class RuleWatch:
    """When the node last had the nftables kube-proxy table, and first had the iptables Service rule."""

    nft_last_seen: float | None = None
    nft_first_gone: float | None = None
    ipt_last_absent: float | None = None
    ipt_first_seen: float | None = None


def _watch(stop: threading.Event, cluster_ip: str, out: RuleWatch) -> None:
    # A listing shows one moment between its start and its end. The old table only goes and the new
    # rule only comes, so "gone" is sure at a listing's end and "absent" at its start: the gap between
    # the two is never wider than the real one.
    rule = f"-d {cluster_ip}/32"
    while not stop.is_set() and out.ipt_first_seen is None:
        began = time.time()
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=5).stdout
        if "table ip kube-proxy" in tables:
            out.nft_last_seen = began
        elif out.nft_last_seen is not None and out.nft_first_gone is None:
            out.nft_first_gone = time.time()
        if out.nft_first_gone is not None:
            began = time.time()
            nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True, timeout=5).stdout
            if any(line.startswith("-A KUBE-SERVICES") and rule in line for line in nat.splitlines()):
                out.ipt_first_seen = time.time()
            else:
                out.ipt_last_absent = began
        time.sleep(WATCH_INTERVAL)


@dataclass
class SwitchRecord:
    traffic: Traffic
    rules: RuleWatch
    conntrack_messages: list[str]

    @property
    def gap(self) -> tuple[float, float]:
        assert self.rules.nft_first_gone is not None and self.rules.ipt_first_seen is not None, self.rules
        return self.rules.nft_first_gone, self.rules.ipt_first_seen

    def in_gap(self) -> list[Attempt]:
        """Connects started surely inside the gap: after the old table was seen gone, before the new rule
        was last seen missing."""
        start = self.rules.nft_first_gone
        end = self.rules.ipt_last_absent
        assert start is not None and end is not None, self.rules
        return [a for a in self.traffic.attempts if start < a.started < end]

    def udp_first_answer_after_rules(self) -> float | None:
        _, rules_at = self.gap
        return next((t for t in self.traffic.udp_answers if t >= rules_at), None)

    def udp_silence(self) -> float:
        """The longest time without a UDP answer while the client was sending."""
        answers = self.traffic.udp_answers
        return max((b - a for a, b in itertools.pairwise(answers)), default=float("inf"))

    def report(self, title: str) -> str:
        gone, rules_at = self.gap
        lines = [f"{title}: old table gone at +0.000 s, new rule seen at +{rules_at - gone:.3f} s "
                 f"({len(self.traffic.attempts)} connects, {len(self.traffic.udp_answers)} UDP answers)"]
        for a in self.in_gap():
            ended = "pending" if a.ended is None else f"+{a.ended - rules_at:.3f} s after the rule"
            lines.append(f"  in-gap connect started +{a.started - gone:.3f} s: "
                         f"{errno.errorcode.get(a.error or 0, a.error) if a.error else 'connected'} {ended}")
        first = self.udp_first_answer_after_rules()
        lines.append("  UDP: first answer after the rule " +
                     (f"+{first - rules_at:.3f} s" if first is not None else "never") +
                     f"; longest silence {self.udp_silence():.3f} s")
        lines += [f"  gate: {m}" for m in self.conntrack_messages] or ["  gate: told of no conntrack deletion"]
        return "\n".join(lines)


def _conntrack_told(h: Harness, since: float) -> list[str]:
    """What the gate said the conntrack step deleted on the node (its GatePassed Event), since `since`."""
    events = h.core.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE}").items
    def when(e: Any) -> float:
        stamp = e.last_timestamp or e.event_time or e.first_timestamp
        return stamp.timestamp() if stamp is not None else 0.0

    return [e.message or "" for e in events
            if e.reason == "GatePassed" and "conntrack" in (e.message or "") and when(e) >= since - 1]


def _ready_on(h: Harness, mode: str) -> None:
    # The status follows the spec's generation: wait for a Ready of this edit, not the last one.
    def ready() -> bool:
        body = h.get(NAME) or {}
        gen = (body.get("metadata") or {}).get("generation")
        cond: dict[str, Any] = next(
            (c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})
        return (cond.get("status") == "True" and (body.get("status") or {}).get("observedGeneration") == gen
                and h.proxy_mode(NODE) == mode)

    h.wait_for(ready, READY_TIMEOUT, f"{NAME} Ready with {NODE} on {mode}")


def _switch_measured(h: Harness, made: BehaviourWorkloads, spec: dict[str, Any]) -> SwitchRecord:
    """Patch the policy (a move to iptables) while the clients and the watcher run in the node."""
    tcp_svc, udp_svc = made.service("clusterip-tcp"), made.service("clusterip-udp")
    assert tcp_svc.cluster_ip and udp_svc.cluster_ip
    traffic, rules = Traffic(), RuleWatch()
    stop_clients, stop_watch = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=run_in_netns, args=(NODE, _clients, stop_clients, (tcp_svc.cluster_ip, tcp_svc.port),
                                                    (udp_svc.cluster_ip, udp_svc.port), traffic), daemon=True),
        threading.Thread(target=run_in_netns, args=(NODE, _watch, stop_watch, tcp_svc.cluster_ip, rules),
                         daemon=True),
    ]
    for t in threads:
        t.start()
    patched_at = time.time()
    try:
        time.sleep(1.0)  # answers before the switch, to compare with
        h.patch(NAME, {"spec": spec})
        _ready_on(h, "iptables")
        h.wait_for(lambda: rules.ipt_first_seen is not None, 30, "the watcher to see the new iptables rules")
        # The rescued connects answer at a retransmission after the step; give the rest time to end.
        time.sleep(CONNECT_TIMEOUT / 2)
    finally:
        stop_clients.set()
        stop_watch.set()
        for t in threads:
            t.join(CONNECT_TIMEOUT + 5)
    return SwitchRecord(traffic, rules, _conntrack_told(h, patched_at))


def _on_nftables(h: Harness, **rollout: Any) -> None:
    h.patch(NAME, {"spec": {"mode": "nftables", "rollout": rollout}})
    _ready_on(h, "nftables")


def test_clients_caught_in_the_switch_gap_are_rescued_by_the_conntrack_step(
        harness: Harness, made: BehaviourWorkloads) -> None:
    h = harness
    body = policy(NAME, "nftables", pool=None, nodeSelector={"matchLabels": {"kubernetes.io/hostname": NODE}},
                  rollout={"maxUnavailable": 1, "holdRules": False},
                  gate={"timeout": "120s", "minSyncs": 1, "behaviour": {"enabled": False}})
    h.apply(body)
    _ready_on(h, "nftables")

    # 1. Hold off, conntrack step on: every connect caught in the gap connects soon after the sync.
    rescued = _switch_measured(h, made, {"mode": "iptables"})
    print("\n" + rescued.report("hold off, conntrack step on"))
    caught = rescued.in_gap()
    assert caught, "no connect started inside the gap: the test did not exercise it\n" + rescued.report("")
    _, rules_at = rescued.gap
    for a in caught:
        assert a.error == 0 and a.ended is not None, rescued.report("a caught connect failed")
        # Rescued at its first retransmission once the step has run: a gap longer than a second (a busy
        # machine) leaves the earliest clients' first retransmission inside the gap, and they connect at
        # the next one, which no step can change.
        due = next(t for t in syn_retransmissions(a.started) if t >= rules_at + STEP_ALLOWANCE)
        assert a.ended <= due + RETRANSMIT_SLACK, rescued.report("a caught connect was not rescued at its "
                                                                 "first retransmission after the step")
    within = sum(1 for a in caught if a.ended is not None and a.ended - rules_at <= RESCUE_SECONDS)
    print(f"{within}/{len(caught)} caught connects connected within {RESCUE_SECONDS:.0f} s of the new rules; "
          f"the latest {max(a.ended - rules_at for a in caught if a.ended is not None):.3f} s after them")
    if rescued.gap[1] - rescued.gap[0] < RESCUE_SECONDS - STEP_ALLOWANCE:
        assert within == len(caught), rescued.report("a short gap, yet a connect was late")
    assert any(re.search(r"deleted [1-9][0-9]* TCP SYN_SENT", m) for m in rescued.conntrack_messages), \
        rescued.conntrack_messages
    first_udp = rescued.udp_first_answer_after_rules()
    assert first_udp is not None and first_udp - rules_at <= RESCUE_SECONDS, rescued.report("UDP late")

    # 2. The control: the same switch with the step off. The caught connects never connect: their
    # retransmissions keep matching the un-NATed entries (SYN_SENT lives 120 s).
    _on_nftables(h, holdRules=False, conntrackCleanup=False)
    control = _switch_measured(h, made, {"mode": "iptables"})
    print("\n" + control.report("the control: hold off, conntrack step off"))
    caught = control.in_gap()
    assert caught, "no connect started inside the gap in the control\n" + control.report("")
    assert all(a.error != 0 for a in caught), control.report("a caught connect connected without the step")
    assert not control.conntrack_messages, control.conntrack_messages
    # kube-proxy's own cleanup at its first sync deletes the stale UDP entries to Service addresses
    # (pkg/proxy/conntrack CleanStaleEntries): the fixed-port UDP client recovers without the step.
    first_udp = control.udp_first_answer_after_rules()
    assert first_udp is not None and first_udp - control.gap[1] <= RESCUE_SECONDS, control.report("UDP late")
    print("kube-proxy's own first-sync cleanup alone brought the fixed-port UDP client back "
          f"{first_udp - control.gap[1]:.3f} s after the new rules")

    # 3. Hold on: the held copy of the old rules serves through the gap; UDP never goes silent long.
    _on_nftables(h, holdRules=True, conntrackCleanup=True)
    held = _switch_measured(h, made, {"mode": "iptables"})
    print("\n" + held.report("hold on, conntrack step on"))
    first_udp = held.udp_first_answer_after_rules()
    assert first_udp is not None and first_udp - held.gap[1] <= RESCUE_SECONDS, held.report("UDP late")
    assert all(a.error == 0 for a in held.traffic.attempts), held.report("a connect failed with the hold on")

    h.delete(NAME)
    h.wait_for(lambda: h.get(NAME) is None, 300, f"the Revert of {NAME}")
    h.wait_for(lambda: h.proxy_mode(NODE) == "iptables", 120, f"{NODE} back on the baseline")
