"""The behaviour probe: how this node serves a sample of Services, as one BehaviourMatrix.

The operator picks the sample (api/behaviour.py BehaviourParams); the agent dials every target from
the node's own network namespace (the OUTPUT path) and asks the pod-network probe server on the node
(agent/probe_server.py) to dial the same ones from a pod (the PREROUTING path). A NodePort target is
dialled on each of the node's IPv4 addresses and, from the node only, on 127.0.0.1.

Which endpoint answered is the address the kernel NATed the flow to: the reply source of the
probe's own conntrack entry, found by the flow's whole tuple after the dials (one `conntrack -L`
dump per protocol and IP family). Where no entry is found (no conntrack tool, the
entry is gone), the first line the endpoint sent stands in (the local cluster's listeners answer
their name). Locality is judged only on addresses, never on such names.

Bounded: all dials of one probe end by a deadline inside params.budget_seconds (targets run
concurrently on a small thread pool, attempts of one target in a row so ClientIP stickiness is
what is measured), the matrix keeps to MAX_CELLS cells, the pod answer and `ip -j addr` to a size.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from proxyshift.agent import conntrack as conntrack_mod
from proxyshift.agent.ip_addr import parse_ip_addr_json
from proxyshift.api.behaviour import (
    IDENTITY_MAX_LENGTH,
    MAX_CELLS,
    MAX_IDENTITIES,
    AddressRole,
    BehaviourCell,
    BehaviourMatrix,
    BehaviourParams,
    BehaviourTarget,
    Outcome,
    ProbePath,
    Protocol,
)
from proxyshift.api.proxynode import MODES
from proxyshift.commands import CommandError, Result, run

Runner = Callable[..., Result]

log = logging.getLogger("proxyshift.agent.behaviour")

LOCALHOST = "127.0.0.1"
UDP_REQUEST = b"proxyshift-probe\n"
READ_BYTES = 256
# How long a TCP dial waits, after its connect, for the endpoint's first line. An endpoint that speaks first
# (the test bed's listeners, SSH, SMTP) sends it within a round trip; one that waits for the client (TLS,
# HTTP: the API server behind default/kubernetes) would hold every dial for the whole attempt timeout, which
# was 0.26 s of every 0.30 s matrix (agent log, rollout bench). The line only stands in for the endpoint's
# name when conntrack gives none.
FIRST_LINE_WAIT_SECONDS = 0.05
# Under kube-proxy (iptables, nftables, ipvs) conntrack names the endpoint of every NATed flow, so the line is
# needed only where that look-up gives nothing: a dial takes it if it came within this, and a TLS endpoint
# costs each of its dials this much instead of FIRST_LINE_WAIT_SECONDS (0.04 s of every gate's matrix).
# Without kube-proxy (Cilium's socket-LB translates before any conntrack entry) the line is the name.
FIRST_LINE_WAIT_UNDER_KUBE_PROXY_SECONDS = 0.01
MAX_NODE_ADDRESSES = 8
MAX_IP_JSON_BYTES = 1024 * 1024
MAX_POD_ANSWER_BYTES = 512 * 1024
MAX_WORKERS = 16
# Share of the budget the dials may use; the rest is for the conntrack look-up and the pod's answer.
DIAL_SHARE = 0.75
# The look-ups end by this share: a process start on a loaded node can overrun its timeout a little.
LOOKUP_SHARE = 0.9
# Interfaces whose addresses are Service addresses, not the node's: ipvs binds every ClusterIP on it.
SERVICE_INTERFACES = frozenset({"kube-ipvs0"})
# Whether a lone attempt that timed out is tried once more (while the budget allows). Measured on the
# dataplane topology (tests/dataplane/behaviour_topology.py, 150 probes of the default-shaped sample,
# 2,250 cells, load ~9 on 2 cores): no live cell ever timed out, while the retry doubles what every
# dead cell costs (0.25 -> 0.5 s) and pushes a sample with dead targets toward the budget. So no
# retry here; a gate that doubts a failure asks for another Probe, which has a whole budget.
RETRY_TIMEOUTS = False


@dataclass(frozen=True)
class Attempt:
    """One connection attempt (TCP connect and first line, or one UDP request and its reply)."""

    outcome: Outcome
    detail: str = ""
    payload: str | None = None  # the endpoint's first line, printable, bounded
    source: tuple[str, int] | None = None  # the probe socket's own address and port

    def to_json(self) -> dict[str, object]:
        return {"outcome": self.outcome, "detail": self.detail, "payload": self.payload,
                "source": f"{self.source[0]}:{self.source[1]}" if self.source else None}

    @classmethod
    def from_json(cls, data: object) -> Attempt:
        if not isinstance(data, dict):
            raise ValueError("an attempt must be an object")
        outcome = data.get("outcome")
        if outcome not in ("answered", "refused", "timeout", "unreachable", "error"):
            raise ValueError(f"bad outcome {outcome!r}")
        source = None
        raw = data.get("source")
        if isinstance(raw, str) and ":" in raw and len(raw) <= 64:
            host, _, port = raw.rpartition(":")
            with contextlib.suppress(ValueError):
                if port.isdigit() and 0 < int(port) < 65536:
                    source = (str(ipaddress.ip_address(host.strip("[]"))), int(port))
        payload = data.get("payload")
        return cls(outcome, str(data.get("detail") or "")[:200],
                   printable_line(payload.encode()) if isinstance(payload, str) else None, source)


@dataclass(frozen=True)
class DialJob:
    """Dial address:port `attempts` times in a row."""

    address: str
    port: int
    protocol: Protocol
    attempts: int

    def to_json(self) -> dict[str, object]:
        return {"address": self.address, "port": self.port, "protocol": self.protocol, "attempts": self.attempts}


Dialer = Callable[[str, int, Protocol, float], Attempt]


def printable_line(data: bytes) -> str | None:
    """The first line of an answer, printable ASCII only, at most IDENTITY_MAX_LENGTH characters."""
    line = data.split(b"\n", 1)[0].decode("ascii", "replace")
    text = "".join(c for c in line if c.isprintable() and c.isascii() and c != "\ufffd")[:IDENTITY_MAX_LENGTH]
    return text.strip() or None


def _classify(code: int) -> tuple[Outcome, str]:
    if code == errno.ECONNREFUSED:
        return "refused", "connection refused"
    if code == errno.ETIMEDOUT:
        return "timeout", "timed out"
    if code in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return "unreachable", errno.errorcode.get(code, str(code))
    return "error", f"{errno.errorcode.get(code, str(code))}: {os.strerror(code)}"


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET


def _wait(sock: socket.socket, *, write: bool, timeout: float) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _source(sock: socket.socket) -> tuple[str, int] | None:
    try:
        host, port = sock.getsockname()[:2]
    except OSError:
        return None
    return (str(host), int(port)) if port else None


def dial_tcp(address: str, port: int, timeout: float, line_wait: float = FIRST_LINE_WAIT_SECONDS) -> Attempt:
    """Non-blocking connect within `timeout`, then the endpoint's first line within `line_wait` of what is
    left."""
    end = time.monotonic() + timeout
    try:
        sock = socket.socket(_family(address), socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        return Attempt("error", str(exc)[:200])
    with sock:
        sock.setblocking(False)
        code = sock.connect_ex((address, port))
        if code not in (0, errno.EINPROGRESS):
            return Attempt(*_classify(code))
        if not _wait(sock, write=True, timeout=end - time.monotonic()):
            return Attempt("timeout", f"no answer to the connect within {timeout:g}s", source=_source(sock))
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        source = _source(sock)
        if code:
            outcome, detail = _classify(code)
            return Attempt(outcome, detail, source=source)
        payload = None
        if _wait(sock, write=False, timeout=min(end - time.monotonic(), line_wait)):
            try:
                payload = printable_line(sock.recv(READ_BYTES))
            except OSError:
                payload = None
        return Attempt("answered", "", payload, source)


def dial_udp(address: str, port: int, timeout: float) -> Attempt:
    """One request from one connected socket; an ICMP port unreachable shows as ECONNREFUSED."""
    end = time.monotonic() + timeout
    try:
        sock = socket.socket(_family(address), socket.SOCK_DGRAM)
    except (OSError, ValueError) as exc:
        return Attempt("error", str(exc)[:200])
    with sock:
        sock.setblocking(False)
        try:
            sock.connect((address, port))
            sock.send(UDP_REQUEST)
        except OSError as exc:
            return Attempt(*_classify(exc.errno or 0), source=_source(sock))
        source = _source(sock)
        if not _wait(sock, write=False, timeout=end - time.monotonic()):
            return Attempt("timeout", f"no reply within {timeout:g}s", source=source)
        try:
            data = sock.recv(READ_BYTES)
        except OSError as exc:
            outcome, detail = _classify(exc.errno or 0)
            return Attempt(outcome, detail, source=source)
        return Attempt("answered", "", printable_line(data), source)


def dial(address: str, port: int, protocol: Protocol, timeout: float) -> Attempt:
    return dial_udp(address, port, timeout) if protocol == "UDP" else dial_tcp(address, port, timeout)


def dial_under_kube_proxy(address: str, port: int, protocol: Protocol, timeout: float) -> Attempt:
    """dial, for a node whose kube-proxy NATs the flows: conntrack names the endpoints, the line rarely."""
    if protocol == "UDP":
        return dial_udp(address, port, timeout)
    return dial_tcp(address, port, timeout, FIRST_LINE_WAIT_UNDER_KUBE_PROXY_SECONDS)


def run_jobs(jobs: Sequence[DialJob], *, attempt_timeout: float, deadline: float, dialer: Dialer = dial,
             clock: Callable[[], float] = time.monotonic,
             workers: int = MAX_WORKERS) -> tuple[list[list[Attempt]], bool]:
    """Every job's attempts, in job order, all ended by `deadline` (clock time); truncated when cut.

    Jobs run concurrently; one job's attempts run in a row (stickiness is about a sequence).
    """
    cut = threading.Event()

    def one(job: DialJob) -> list[Attempt]:
        out: list[Attempt] = []
        retried = False
        while len(out) < job.attempts:
            left = deadline - clock()
            if left <= 0.01:
                cut.set()
                break
            attempt = dialer(job.address, job.port, job.protocol, min(attempt_timeout, left))
            if (RETRY_TIMEOUTS and attempt.outcome == "timeout" and job.attempts == 1 and not retried
                    and deadline - clock() >= attempt_timeout):
                retried = True  # one more try; the second answer is what counts
                continue
            out.append(attempt)
        return out

    if not jobs:
        return [], False
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs))), thread_name_prefix="behaviour") as pool:
        results = list(pool.map(one, jobs))
    return results, cut.is_set()


# ---- the node's own addresses ----

def parse_ip_addr(text: str, *, max_bytes: int = MAX_IP_JSON_BYTES) -> list[tuple[str, str]]:
    """`ip -j -4 addr show` -> [(address, interface)], IPv4 only, no loopback, no link-local."""
    return [(str(a.address), a.interface) for a in parse_ip_addr_json(text, max_bytes=max_bytes)
            if isinstance(a.address, ipaddress.IPv4Address) and not (
                a.address.is_loopback or a.address.is_link_local or a.address.is_unspecified
                or a.address.is_multicast)]


def node_addresses(node_ips: Sequence[str], *, runner: Runner = run) -> list[str]:
    """The node's own IPv4 addresses to dial NodePorts on: the Node object's first, then the others."""
    found = parse_ip_addr(runner(["ip", "-j", "-4", "addr", "show"], timeout=2.0).stdout)
    local = [a for a, ifname in found if ifname not in SERVICE_INTERFACES]
    ordered = [a for a in node_ips if a in local] + sorted(set(local) - set(node_ips),
                                                           key=lambda a: ipaddress.IPv4Address(a))
    return list(dict.fromkeys(ordered))[:MAX_NODE_ADDRESSES]


# ---- the plan: which (target, address, path) cells to take ----

@dataclass(frozen=True)
class PlannedCell:
    target: BehaviourTarget
    address: str
    role: AddressRole
    path: ProbePath

    @property
    def job(self) -> DialJob:
        return DialJob(self.address, self.target.port, self.target.protocol, self.target.attempts)


def plan_cells(params: BehaviourParams, local_addresses: Sequence[str], *,
               pod_path: bool) -> tuple[list[PlannedCell], bool]:
    """The cells to take, in a fixed order, at most MAX_CELLS; truncated when there were more."""
    out: list[PlannedCell] = []
    for target in params.targets:
        for path in ("node", "pod"):
            if path not in target.paths or (path == "pod" and not pod_path):
                continue
            if target.address:
                addresses: list[tuple[str, AddressRole]] = [(target.address, "clusterIP")]
            else:
                addresses = [(a, "nodeIP" if a in params.node_ips else "otherAddress") for a in local_addresses]
                if path == "node":  # a pod's 127.0.0.1 is its own
                    addresses.append((LOCALHOST, "localhost"))
            for address, role in addresses:
                if len(out) >= MAX_CELLS:
                    return out, True
                out.append(PlannedCell(target, address, role, path))
    return out, False


# ---- identities ----

FlowKey = tuple[Protocol, str, int, str, int]  # protocol, source address, source port, destination, port


def conntrack_identities(keys: set[FlowKey], *, runner: Runner = run, deadline: float,
                         clock: Callable[[], float] = time.monotonic,
                         table_size: Callable[[], int | None] = conntrack_mod.table_entries) -> dict[FlowKey, str]:
    """The reply source (the endpoint the flow was NATed to) of each of these flows found in conntrack.

    One `conntrack -L -p P` dump per protocol and IP family, run side by side, each flow looked up
    by its whole tuple: the process starts are what a look-up costs (10-100 ms each on a loaded
    node), and one per source address (node IP, second address, 127.0.0.1, the pod) was three to
    four times as many. On a table larger than conntrack_mod.DUMP_MAX_ENTRIES, or where the dump
    is cut at its bound, the look-up is one source at a time, the kernel filtering. A look-up not
    done by `deadline` names nothing (the payload stands in).
    """
    def family_of(address: str) -> int | None:
        try:
            return ipaddress.ip_address(address).version
        except ValueError:
            return None

    def flows_of(protocol: Protocol, family: int, source: str | None) -> tuple[list[conntrack_mod.Flow], bool]:
        left = deadline - clock()
        if left < 0.05:
            return [], False
        try:
            return conntrack_mod.list_flows(protocol, source=source, family=family, runner=runner, timeout=left)
        except (CommandError, conntrack_mod.ConntrackOutputError, ValueError):
            return [], False

    dump = conntrack_mod.dump_pays(table_size()) if keys else False

    def one(group: tuple[Protocol, int]) -> list[conntrack_mod.Flow]:
        protocol, family = group
        if dump:
            flows, cut = flows_of(protocol, family, None)
            if not cut:
                return flows
        sources = sorted({k[1] for k in keys if k[0] == protocol and family_of(k[1]) == family})
        return [f for source in sources for f in flows_of(protocol, family, source)[0]]

    groups = sorted({(k[0], f) for k in keys if (f := family_of(k[1])) is not None})
    found: dict[FlowKey, str] = {}
    if not groups:
        return found
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="behaviour-ct") as pool:
        for (protocol, _), flows in zip(groups, pool.map(one, groups), strict=True):
            for flow in flows:
                if flow.sport is None or flow.dport is None:
                    continue
                key = (protocol, flow.src, flow.sport, flow.dst, flow.dport)
                if key in keys:
                    found[key] = flow.reply_src
    return found


@dataclass
class _Identified:
    identities: list[str | None] = field(default_factory=list)
    by_address: bool = True


def _identify(cell: PlannedCell, attempts: Sequence[Attempt], known: dict[FlowKey, str]) -> _Identified:
    out = _Identified()
    for attempt in attempts:
        if attempt.outcome != "answered":
            continue
        key = (cell.target.protocol, *attempt.source, cell.address, cell.target.port) if attempt.source else None
        if key is not None and key in known:
            out.identities.append(known[key])
        else:
            out.identities.append(attempt.payload)
            out.by_address = False
    return out


def build_cell(cell: PlannedCell, attempts: Sequence[Attempt], known: dict[FlowKey, str]) -> BehaviourCell:
    """One cell from its attempts. Pure."""
    target = cell.target
    answered = [a for a in attempts if a.outcome == "answered"]
    failed = [a for a in attempts if a.outcome != "answered"]
    ident = _identify(cell, attempts, known)
    # A conntrack reply address is at most 45 characters and a payload is clipped where it is read; clipped
    # here as well, so nothing the kernel's tools print can make the status write refused.
    names = [i[:IDENTITY_MAX_LENGTH] for i in ident.identities if i]
    sticky = local = None
    if not attempts:
        outcome: Outcome = "timeout"
        detail = "not probed: the budget ran out"
    elif failed:
        outcome, detail = failed[0].outcome, failed[0].detail
        if answered:
            detail = f"{len(answered)}/{len(attempts)} attempts answered; {detail}"
    else:
        outcome, detail = "answered", ""
        if target.attempts > 1 and len(names) < len(answered):
            # An answer that named no endpoint (no conntrack entry, no first line) says nothing about
            # stickiness: not judged, rather than "several endpoints".
            detail = f"stickiness not judged: {len(answered) - len(names)} of {len(answered)} answers named no endpoint"
        elif target.attempts > 1:
            sticky = len(set(names)) == 1
        if target.local_endpoints is not None:
            if ident.by_address and names:
                local = all(n in target.local_endpoints for n in names)
            else:
                detail = "locality not judged: no conntrack entry named the endpoint's address"
    return BehaviourCell(service=target.service, kind=target.kind, protocol=target.protocol, port=target.port,
                         address=cell.address, address_role=cell.role, path=cell.path, outcome=outcome,
                         endpoints=sorted(set(names))[:MAX_IDENTITIES], sticky=sticky, local=local,
                         detail=detail[:200])


# ---- the pod path ----

@dataclass(frozen=True)
class PodAnswer:
    results: list[list[Attempt]]
    truncated: bool


def ask_pod(pod_probe: str, jobs: Sequence[DialJob], *, attempt_timeout: float, budget: float) -> PodAnswer:
    """POST the jobs to the probe server in a pod on this node; raises OSError/ValueError when it cannot."""
    body = json.dumps({"jobs": [j.to_json() for j in jobs], "attemptTimeoutSeconds": attempt_timeout,
                       "budgetSeconds": budget}).encode()
    request = urllib.request.Request(f"http://{pod_probe}/probe", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    # No proxy from the environment: the pod is on this node, never behind an HTTP proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=budget + 0.5) as response:
        data = response.read(MAX_POD_ANSWER_BYTES + 1)
    return parse_pod_answer(data, jobs)


def parse_pod_answer(data: bytes, jobs: Sequence[DialJob]) -> PodAnswer:
    """The probe server's answer, checked: a pod is not trusted to be well-formed. Raises ValueError."""
    if len(data) > MAX_POD_ANSWER_BYTES:
        raise ValueError(f"the probe server's answer is over {MAX_POD_ANSWER_BYTES} bytes")
    try:
        answer = json.loads(data)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    except RecursionError:
        raise ValueError("the probe server's answer is nested too deep") from None
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != len(jobs):
        raise ValueError("the probe server answered another number of jobs than it was asked")
    parsed = [[Attempt.from_json(a) for a in (r if isinstance(r, list) else [])[:j.attempts]]
              for r, j in zip(results, jobs, strict=True)]
    return PodAnswer(parsed, answer.get("truncated") is True)


# ---- the probe ----

def run_behaviour(params: BehaviourParams, *, mode: str | None, operation_id: str = "", runner: Runner = run,
                  dialer: Dialer | None = None, clock: Callable[[], float] = time.monotonic,
                  wallclock: Callable[[], float] = time.time,
                  pod_client: Callable[..., PodAnswer] = ask_pod) -> BehaviourMatrix:
    """Probe params.targets from the node (and from the pod probe server when params.pod_probe is set).

    `dialer` None: by the node's `mode`, dial_under_kube_proxy under kube-proxy, else dial."""
    if dialer is None:
        dialer = dial_under_kube_proxy if mode in MODES else dial
    start = clock()
    taken_at = datetime.fromtimestamp(wallclock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    deadline = start + params.budget_seconds * DIAL_SHARE
    needs_addresses = any(t.address is None for t in params.targets)
    local: list[str] = []
    if needs_addresses:
        try:
            local = node_addresses(params.node_ips, runner=runner)
        except (CommandError, ValueError) as exc:
            # Only 127.0.0.1 is dialled then: the missing cells fail the comparison, as they should.
            log.warning("the node's addresses could not be read, NodePorts only on %s: %s", LOCALHOST, exc)
    addressed = clock()
    planned, truncated = plan_cells(params, local, pod_path=bool(params.pod_probe))
    node_cells = [c for c in planned if c.path == "node"]
    pod_cells = [c for c in planned if c.path == "pod"]

    pod_box: dict[str, object] = {}

    def pod_side() -> None:
        try:
            budget = max(0.05, deadline - clock() - 0.05)
            pod_box["answer"] = pod_client(str(params.pod_probe), [c.job for c in pod_cells],
                                           attempt_timeout=params.attempt_timeout_seconds, budget=budget)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            pod_box["error"] = f"probe server {params.pod_probe}: {exc}"[:200]

    pod_thread = None
    if pod_cells:
        pod_thread = threading.Thread(target=pod_side, name="behaviour-pod", daemon=True)
        pod_thread.start()
    node_results, cut = run_jobs([c.job for c in node_cells], attempt_timeout=params.attempt_timeout_seconds,
                                 deadline=deadline, dialer=dialer, clock=clock)
    dialled = clock()
    pod_error: str | None = None
    pod_results: list[list[Attempt]] = []
    if pod_thread is not None:
        pod_thread.join(max(0.0, start + params.budget_seconds - clock()))
        answer = pod_box.get("answer")
        if isinstance(answer, PodAnswer):
            pod_results, cut = answer.results, cut or answer.truncated
        else:
            pod_error = str(pod_box.get("error") or "the probe server did not answer within the budget")

    keys: set[FlowKey] = set()
    # Pod cells are left out when the pod path failed: pod_path_error says why, node cells still count.
    taken = list(zip(node_cells, node_results, strict=True)) + list(zip(pod_cells, pod_results, strict=False))
    for cell, attempts in taken:
        for a in attempts:
            if a.outcome == "answered" and a.source:
                keys.add((cell.target.protocol, a.source[0], a.source[1], cell.address, cell.target.port))
    joined = clock()
    known = conntrack_identities(keys, runner=runner, deadline=start + params.budget_seconds * LOOKUP_SHARE,
                                 clock=clock)
    named = clock()
    # Where a matrix's time goes, for the rollout's own time per node (docs/benchmarks.md).
    log.info("behaviour %s: %d cells in %.3f s (addresses %.3f, node dials %.3f, pod path +%.3f, "
             "endpoint names %.3f)", operation_id, len(planned), named - start, addressed - start,
             dialled - addressed, joined - dialled, named - joined)
    by_cell = {id(cell): attempts for cell, attempts in taken}
    cells = [build_cell(c, by_cell[id(c)], known) for c in planned if id(c) in by_cell]
    return BehaviourMatrix(operation_id=operation_id[:253], mode=mode, taken_at=taken_at,
                           duration_seconds=round(clock() - start, 4), cells=cells,
                           truncated=truncated or cut, pod_path_error=pod_error)
