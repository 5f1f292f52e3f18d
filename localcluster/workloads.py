"""Test workloads: Services whose EndpointSlices point at real listeners, and TCP probes from nodes.

- `create_endpoints(state_dir, count)` makes endpoint namespaces ps-ep-<n>
  (198.18.1.<n>/16 on the bridge) and one listener process serving all of them;
- `create_services(kube, endpoints, count)` makes selector-less Services (the
  apiserver picks ClusterIPs from 198.19.0.0/16) and one EndpointSlice each,
  listing the endpoints; requests go out in parallel and without the client's
  model layer, so thousands of Services take seconds;
- `tcp_probe(node, ip, port, count)` and `ContinuousProber` open TCP
  connections from inside a node's namespace and count who answered
  (`ContinuousProber(..., cgroup=...)` from inside the node's cgroup too, where
  a node's Cilium socket-LB translates them).

    python -m localcluster.workloads probe [--cgroup DIR --netns NS] ADDRESS PORT   (the prober's child)
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from localcluster import network, paths
from localcluster.container import run_in_netns, setns
from localcluster.kubeapi import Kube, KubeError

DEFAULT_NAMESPACE = "ps-workloads"
DEFAULT_PORT = 80
DEFAULT_TARGET_PORT = 8080
PORT_NAME = "tcp"
MANAGED_BY = "proxyshift-localcluster"
LISTENER_START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Endpoint:
    name: str  # also its network namespace, and what its listener answers
    ip: str
    ports: tuple[int, ...]
    udp_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Service:
    name: str
    namespace: str
    cluster_ip: str
    port: int
    target_port: int
    endpoints: tuple[str, ...]  # endpoint names


def _kube(kube: Kube | Path | str) -> Kube:
    return kube if isinstance(kube, Kube) else Kube(kube, pool_size=32)


def create_endpoints(state_dir: Path, count: int, *, ports: tuple[int, ...] = (DEFAULT_TARGET_PORT,),
                     udp_ports: tuple[int, ...] = (), start: int | None = None) -> list[Endpoint]:
    """Endpoint namespaces start..start+count-1 and one listener process for them (recorded in state.json).

    TCP `ports` answer each connection with the endpoint's name, `udp_ports` each datagram.

    Without `start`, numbering continues after the highest existing ps-ep-<n>, so
    each call adds fresh endpoints.
    """
    from localcluster import state

    state_dir = Path(state_dir)
    if start is None:
        taken = [int(n[len(network.ENDPOINT_PREFIX):]) for n in network.list_namespaces((network.ENDPOINT_PREFIX,))
                 if n[len(network.ENDPOINT_PREFIX):].isdigit()]
        start = max(taken, default=0) + 1
    if start + count - 1 > network.MAX_ENDPOINTS:
        raise ValueError(f"endpoints {start}..{start + count - 1} exceed {network.MAX_ENDPOINTS}")
    network.ensure_bridge()
    endpoints = []
    for n in range(start, start + count):
        network.create_endpoint_netns(n)
        endpoints.append(Endpoint(network.endpoint_name(n), network.endpoint_ip(n), tuple(ports), tuple(udp_ports)))
    if not endpoints:
        return endpoints
    name = f"listener-{start}-{start + count - 1}"
    layout = paths.StateLayout(state_dir)
    layout.nodes.mkdir(parents=True, exist_ok=True)
    state.record_path(state_dir, layout.nodes)
    ready = layout.nodes / f"{name}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "localcluster.listener", "--ready-file", str(ready)]
    for endpoint in endpoints:
        if ports:
            argv += ["--endpoint", f"{endpoint.name}:{','.join(map(str, ports))}"]
        if udp_ports:
            argv += ["--udp-endpoint", f"{endpoint.name}:{','.join(map(str, udp_ports))}"]
    proc = state.spawn(state_dir, name, argv)
    deadline = time.monotonic() + LISTENER_START_TIMEOUT
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"listener {name} did not start; see {layout.log(name)}")
        time.sleep(0.05)
    return endpoints


def ensure_namespace(kube: Kube, namespace: str) -> None:
    try:
        kube.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                         "metadata": {"name": namespace}})
    except KubeError as exc:
        if exc.status != 409:
            raise


def service_manifest(name: str, namespace: str, port: int, target_port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
            "spec": {"type": "ClusterIP", "ports": [{"name": PORT_NAME, "port": port, "targetPort": target_port,
                                                     "protocol": "TCP"}]}}


def slice_manifest(name: str, namespace: str, endpoints: list[Endpoint], target_port: int) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-1", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by": MANAGED_BY}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [e.ip], "conditions": {"ready": True, "serving": True, "terminating": False}}
                          for e in endpoints],
            "ports": [{"name": PORT_NAME, "port": target_port, "protocol": "TCP"}]}


def create_services(kube: Kube | Path | str, endpoints: list[Endpoint], count: int = 1, *,
                    namespace: str = DEFAULT_NAMESPACE, prefix: str = "ps-svc", port: int = DEFAULT_PORT,
                    target_port: int = DEFAULT_TARGET_PORT, workers: int = 16) -> list[Service]:
    """`count` Services named <prefix>-<i>, each with an EndpointSlice listing every endpoint."""
    client = _kube(kube)
    ensure_namespace(client, namespace)
    names = [f"{prefix}-{i}" for i in range(1, count + 1)]

    def make(name: str) -> Service:
        try:
            svc = client.post(f"/api/v1/namespaces/{namespace}/services",
                              service_manifest(name, namespace, port, target_port))
        except KubeError as exc:
            if exc.status != 409:
                raise
            svc = client.get(f"/api/v1/namespaces/{namespace}/services/{name}")
        body = slice_manifest(name, namespace, endpoints, target_port)
        try:
            client.post(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", body)
        except KubeError as exc:
            if exc.status != 409:
                raise
            client.merge_patch(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}-1", body)
        return Service(name, namespace, svc["spec"]["clusterIP"], port, target_port,
                       tuple(e.name for e in endpoints))

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, count))) as pool:
        return list(pool.map(make, names))


def delete_services(kube: Kube | Path | str, services: list[Service], *, workers: int = 16) -> None:
    """Delete the Services (their EndpointSlices go with them: same-named, deleted explicitly)."""
    client = _kube(kube)

    def drop(svc: Service) -> None:
        for path in (f"/api/v1/namespaces/{svc.namespace}/services/{svc.name}",
                     f"/apis/discovery.k8s.io/v1/namespaces/{svc.namespace}/endpointslices/{svc.name}-1"):
            try:
                client.delete(path)
            except KubeError as exc:
                if exc.status != 404:
                    raise

    if services:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(services)))) as pool:
            list(pool.map(drop, services))


# --- probing from a node ---------------------------------------------------------

@dataclass
class ProbeResult:
    ok: int = 0
    failed: int = 0
    served_by: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return self.ok + self.failed


def connect_once(ip: str, port: int, timeout: float) -> tuple[bool, str]:
    """One TCP connection: (True, endpoint name) or (False, error). Call from inside a namespace."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock:
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
        name = data.decode(errors="replace").strip()
        return (True, name) if name else (False, "empty answer")
    except OSError as exc:
        return False, type(exc).__name__ + (f": {exc.strerror}" if exc.strerror else "")


def udp_once(ip: str, port: int, timeout: float, *, payload: bytes = b"ping", source_port: int = 0) -> tuple[bool, str]:
    """One UDP request/response: (True, endpoint name) or (False, error). Call from inside a namespace.

    A fixed `source_port` keeps the flow (and its conntrack entry) the same across calls.
    A refused port shows up as ConnectionRefusedError only because the socket is connected.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.settimeout(timeout)
        try:
            sock.bind(("0.0.0.0", source_port))
            sock.connect((ip, port))
            sock.send(payload)
            data = sock.recv(2048)
        except OSError as exc:
            return False, type(exc).__name__ + (f": {exc.strerror}" if exc.strerror else "")
    name = data.split(b"\n", 1)[0].decode(errors="replace").strip()
    return (True, name) if name else (False, "empty answer")


def udp_probe(netns: str, ip: str, port: int, count: int = 1, *, timeout: float = 2.0,
              source_port: int = 0) -> ProbeResult:
    """`count` UDP requests to ip:port from inside `netns` (a node's or its pod namespace), one after another."""

    def loop() -> ProbeResult:
        result = ProbeResult()
        for _ in range(count):
            ok, detail = udp_once(ip, port, timeout, source_port=source_port)
            result.ok += ok
            result.failed += not ok
            (result.served_by if ok else result.errors)[detail] += 1
        return result

    return run_in_netns(netns, loop)


def _probe_loop(ip: str, port: int, count: int, timeout: float) -> ProbeResult:
    result = ProbeResult()
    for _ in range(count):
        ok, detail = connect_once(ip, port, timeout)
        if ok:
            result.ok += 1
            result.served_by[detail] += 1
        else:
            result.failed += 1
            result.errors[detail] += 1
    return result


def tcp_probe(node: str, ip: str, port: int, count: int = 10, *, timeout: float = 2.0) -> ProbeResult:
    """Open `count` TCP connections to ip:port from inside `node`'s namespace (or any namespace,
    e.g. its pod namespace `ps-node-<i>-pod`), one after another."""
    return run_in_netns(node, _probe_loop, ip, port, count, timeout)


def tcp_probe_services(node: str, services: list[Service], count: int = 1, *,
                       timeout: float = 2.0) -> dict[str, ProbeResult]:
    """`count` connections to each Service's ClusterIP from `node`: {service name: result}.

    One thread in the node does them all, so a sweep over thousands of Services costs
    no process and no namespace switch per Service.
    """

    def sweep() -> dict[str, ProbeResult]:
        return {svc.name: _probe_loop(svc.cluster_ip, svc.port, count, timeout) for svc in services}

    return run_in_netns(node, sweep)


class ContinuousProber:
    """Connects from a node every `interval` seconds until stopped; survives a migration.

        with ContinuousProber("ps-node-1", svc.cluster_ip, 80) as prober:
            ...  # migrate
        assert prober.result.failed == 0, prober.failures

    By default a thread of this process enters the node's network namespace: kube-proxy's rules
    (netfilter, per namespace) serve it. Cilium's socket-LB does not follow the network namespace but
    the cgroup (localcluster.cilium): with `cgroup` (the node's, `cilium.node_cgroup(node)`) the loop
    runs in a child process that joins that cgroup and the node's namespace first
    (`cilium.join_node`, as the agent's launcher and `cilium.dial` do), so its connects are
    translated by the node's Cilium like those of any process of the node. The child reports each
    attempt as a JSON line and stops when its stdin closes (with this process, too).
    """

    def __init__(self, node: str, ip: str, port: int, *, interval: float = 0.05, timeout: float = 1.0,
                 cgroup: Path | None = None) -> None:
        self.node, self.ip, self.port = node, ip, port
        self.interval, self.timeout = interval, timeout
        self.cgroup = cgroup
        self.result = ProbeResult()
        self.failures: list[tuple[float, str]] = []  # (time.time(), error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run_child if cgroup is not None else self._run,
                                        name=f"prober-{node}", daemon=True)
        self._error: BaseException | None = None
        self._child: subprocess.Popen[str] | None = None

    def _record(self, ok: bool, detail: str, at: float) -> None:
        if ok:
            self.result.ok += 1
            self.result.served_by[detail] += 1
        else:
            self.result.failed += 1
            self.result.errors[detail] += 1
            self.failures.append((at, detail))

    def _run(self) -> None:
        try:
            setns(self.node)
        except BaseException as exc:
            self._error = exc
            return
        while not self._stop.is_set():
            ok, detail = connect_once(self.ip, self.port, self.timeout)
            self._record(ok, detail, time.time())
            self._stop.wait(self.interval)

    def child_argv(self) -> list[str]:
        """The child's command line: `python -m localcluster.workloads probe ...` in the node's cgroup."""
        return [sys.executable, "-m", "localcluster.workloads", "probe", "--cgroup", str(self.cgroup),
                "--netns", self.node, "--interval", str(self.interval), "--timeout", str(self.timeout),
                self.ip, str(self.port)]

    def _run_child(self) -> None:
        proc = self._child
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            try:
                attempt = json.loads(line)
                self._record(bool(attempt["ok"]), str(attempt["detail"]), float(attempt["at"]))
            except (ValueError, KeyError, TypeError) as exc:
                self._error = RuntimeError(f"prober in {self.node}: unreadable line {line!r}: {exc}")
        if proc.wait() != 0 and self._error is None:
            stderr = proc.stderr.read() if proc.stderr is not None else ""
            self._error = RuntimeError(f"prober in {self.node} ({self.cgroup}) exited {proc.returncode}: "
                                       f"{stderr.strip()[-2000:]}")

    def start(self) -> ContinuousProber:
        if self.cgroup is not None:
            self._child = subprocess.Popen(self.child_argv(), stdin=subprocess.PIPE,  # noqa: S603
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._thread.start()
        return self

    def stop(self) -> ProbeResult:
        self._stop.set()
        child = self._child
        if child is not None and child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()  # the child's signal to stop after its attempt in flight
            try:
                child.wait(timeout=self.timeout + CHILD_STOP_GRACE)
            except subprocess.TimeoutExpired:
                child.kill()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.result

    def __enter__(self) -> ContinuousProber:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


CHILD_STOP_GRACE = 10.0


def probe_stream(ip: str, port: int, *, interval: float, timeout: float, stop_fd: int, out: IO[str]) -> int:
    """The child's loop: connect, write {"ok", "detail", "at"} as a line, wait `interval`; until `stop_fd`
    reads end-of-file (or anything). Returns the number of attempts."""
    attempts = 0
    while True:
        ok, detail = connect_once(ip, port, timeout)
        out.write(json.dumps({"ok": ok, "detail": detail, "at": time.time()}) + "\n")
        out.flush()
        attempts += 1
        readable, _, _ = select.select([stop_fd], [], [], interval)
        if readable:
            return attempts


def http_get(node: str, url: str, *, timeout: float = 3.0) -> tuple[int, str]:
    """GET an http:// URL from inside a node's namespace (no curl needed): (status, body)."""
    import http.client
    import urllib.parse

    parsed = urllib.parse.urlsplit(url)

    def get() -> tuple[int, str]:
        conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout)
        try:
            conn.request("GET", parsed.path or "/")
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    return run_in_netns(node, get)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localcluster.workloads")
    sub = parser.add_subparsers(dest="what", required=True)
    probe = sub.add_parser("probe", help="connect to ADDRESS PORT every --interval seconds until stdin closes; "
                                         "one JSON line per attempt (ContinuousProber's child)")
    probe.add_argument("--cgroup", type=Path, help="the node's cgroup v2 directory, joined first")
    probe.add_argument("--netns", help="the node's network namespace (under /run/netns)")
    probe.add_argument("--interval", type=float, default=0.05)
    probe.add_argument("--timeout", type=float, default=1.0)
    probe.add_argument("address")
    probe.add_argument("port", type=int)
    args = parser.parse_args(argv)
    if args.cgroup is not None:
        from localcluster import cilium

        if args.netns is None:
            parser.error("--cgroup needs --netns")
        cilium.join_node(args.cgroup, args.netns)
    elif args.netns is not None:
        setns(args.netns)
    probe_stream(args.address, args.port, interval=args.interval, timeout=args.timeout,
                 stop_fd=sys.stdin.fileno(), out=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
