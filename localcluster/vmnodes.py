"""Local-cluster nodes inside the QEMU guest: the control plane stays on the host, the nodes that need
a kernel with IPVS run in one guest joined to the cluster bridge by a tap device.

Host side (`VmNodes`, a context manager):

- a tap device `pstap<n>` on the bridge `psbr0`; QEMU attaches the guest's one virtio-net NIC to it
  (`vm.run_in_vm(tap=...)`). No QEMU helper scripts: the tap is made and removed here, and
  `localcluster down` removes a `pstap<n>` a killed test left;
- host-gw routes to the guest nodes' pod ranges (localcluster.podnet) in the root namespace, every
  endpoint namespace and every host node, as `create_node_netns` makes them for a host node (endpoint
  namespaces made after `start()` miss them: make them first);
- the guest runs `python -m localcluster.vmnodes guest ...` (below) and reports through the per-run
  9p share: `ready.json` once its nodes are up, then it answers requests (`requests/<id>.json` ->
  `responses/<id>.json`): a command or an HTTP GET inside a guest node, a TCP probe, a continuous
  prober started and stopped (the host cannot enter the guest's namespaces);
- `stop()` asks the guest to stop its nodes and power off (QEMU is stopped by its pid if it does
  not), keeps the guest's logs under the cluster's logs/vmnodes/, removes the tap and the routes, and
  deletes the guest nodes' Node objects and pods.

Guest side (`guest_main`): a bridge named `psbr0` as on the host, with the NIC enslaved and
198.18.4.1/16 (no other machine of the cluster has it; `create_node_netns` needs an address in the
root namespace for its host-gw routes), NOT the host bridge's 198.18.0.1, which is the API server's;
then the unchanged node code (`network.create_node_netns`, `network.start_nodes`: the node namespace,
the node simulator, which runs kube-proxy and the agent as processes), with a state folder in the
guest's own /tmp and the admin kubeconfig the host put into the share. No default route anywhere:
the guest's root namespace has only the connected 198.18.0.0/16, each node what a host node has.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from localcluster import kubeapi, network, paths, podnet, vm, workloads
from localcluster.controlplane import ClusterInfo
from localcluster.paths import node_ip, node_name
from proxyshift.commands import Result, run

TAP = f"{network.VM_TAP_PREFIX}0"
GUEST_ENV = "PROXYSHIFT_VMNODES_GUEST"
GUEST_BRIDGE_ADDRESS = "198.18.4.1"
SHARE_KUBECONFIG = "admin.kubeconfig"
READY_FILE = "ready.json"
REQUESTS, RESPONSES, LOGS = "requests", "responses", "logs"
POLL_SECONDS = 0.1
API_WAIT_SECONDS = 60.0
# The guest's first Python imports and each node's first pods are 15-30x slower than on the host.
GUEST_SIMULATOR_START_TIMEOUT = 300.0
# The guest's nodes stretch probes' initial delays and timeouts by this (nodesim probes.scaled_probes):
# the agent's liveness probe (5 s delay, 3 x 20 s) restarted it before its first start there had
# served /healthz (31 s warm, over 45 s cold).
GUEST_PROBE_TIME_SCALE = 20.0
DEFAULT_BOOT_TIMEOUT = 600.0  # boot, bridge, node namespaces, simulators reporting
DEFAULT_RUN_TIMEOUT = 3600.0  # QEMU is stopped after this whatever happens
STOP_TIMEOUT = 120.0


class VmNodesError(RuntimeError):
    """The guest's nodes did not come up, or the guest did not answer a request."""


# ------------------------------------------------------------------ plan (pure)

def parse_plan(text: str) -> list[tuple[int, str]]:
    """`4:vm,5:vm` -> [(4, "vm"), (5, "vm")]: node index and pool of each guest node."""
    plan = []
    for item in text.split(","):
        index, sep, pool = item.partition(":")
        if not sep or not index.isdigit() or not pool:
            raise ValueError(f"bad guest node {item!r}: expected INDEX:POOL")
        node_ip(int(index))  # raises for an index outside the node range
        plan.append((int(index), pool))
    if len({i for i, _ in plan}) != len(plan):
        raise ValueError(f"a node index appears twice in {text!r}")
    return plan


def guest_argv(python: str, plan: Sequence[tuple[int, str]], host_nodes: Sequence[int], *, bin_dir: Path,
               api_url: str, max_seconds: float) -> list[str]:
    """The guest's command: start the plan's nodes, serve the host's requests until told to stop (or
    `max_seconds` have passed: a host test killed with -9 cannot stop QEMU, so the guest ends itself)."""
    return [python, "-m", "localcluster.vmnodes", "guest", "--share", vm.GUEST_RUN_DIR,
            "--nodes", ",".join(f"{i}:{pool}" for i, pool in plan),
            "--host-nodes", ",".join(str(i) for i in host_nodes),
            "--bin-dir", str(bin_dir), "--api-url", api_url, "--max-seconds", f"{max_seconds:g}"]


def tap_commands(tap: str) -> list[list[str]]:
    """The argv that make `tap` and put it on the cluster bridge (up: QEMU gives it its carrier)."""
    return [["ip", "tuntap", "add", "dev", tap, "mode", "tap"],
            ["ip", "link", "set", tap, "master", paths.BRIDGE_NAME],
            ["ip", "link", "set", tap, "up"]]


# ------------------------------------------------------------------ host side

@dataclass
class ProbeCounts:
    ok: int
    failed: int
    errors: dict[str, int]
    served_by: dict[str, int]
    failures: list[tuple[float, str]]


class VmNodes:
    """Nodes `plan` ([(index, pool)]) of the local cluster in one QEMU guest (see the module's doc)."""

    def __init__(self, info: ClusterInfo, plan: Sequence[tuple[int, str]], *, tap: str = TAP,
                 memory_mib: int | None = None, cpus: int | None = None,
                 boot_timeout: float = DEFAULT_BOOT_TIMEOUT, run_timeout: float = DEFAULT_RUN_TIMEOUT) -> None:
        self.info, self.plan, self.tap = info, list(plan), tap
        self.nodes = [node_name(i) for i, _ in self.plan]
        self.memory_mib, self.cpus = memory_mib, cpus
        self.boot_timeout, self.run_timeout = boot_timeout, run_timeout
        self.share = Path(tempfile.mkdtemp(prefix="ps-vmnodes-"))
        self.log_dir = paths.StateLayout(info.state_dir).logs / "vmnodes"
        self.guest_log = self.log_dir / "guest.log"
        self.result: vm.VmResult | None = None
        self.error: BaseException | None = None
        self.boot_seconds = 0.0
        self.ready: dict[str, Any] = {}
        self.clock_offset = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._host_nodes: list[int] = []
        self._tap_made = False

    # -- lifecycle

    def __enter__(self) -> VmNodes:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> VmNodes:
        started = time.monotonic()
        taken = set(network.node_indices())
        clash = [i for i, _ in self.plan if i in taken]
        if clash:
            raise VmNodesError(f"node indices {clash} are host nodes already")
        self._host_nodes = sorted(taken)
        for sub in (REQUESTS, RESPONSES, LOGS):
            (self.share / sub).mkdir()
        kubeconfig = self.share / SHARE_KUBECONFIG
        shutil.copyfile(self.info.kubeconfig, kubeconfig)
        kubeconfig.chmod(0o600)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.tap in _links():
            raise VmNodesError(f"{self.tap} exists already (another guest? `localcluster down` removes a stale one)")
        self._tap_made = True
        for argv in tap_commands(self.tap):
            run(argv, timeout=10)
        self._route(add=True)
        argv = guest_argv(sys.executable, self.plan, self._host_nodes, bin_dir=self.info.bin_dir,
                          api_url=self.info.node_api_url, max_seconds=max(60.0, self.run_timeout - 60))
        env = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", GUEST_ENV: "1"}
        self._thread = threading.Thread(target=self._run, args=(argv, env), name="vmnodes-qemu", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.boot_timeout
        ready = self.share / READY_FILE
        while not ready.exists():
            if not self._thread.is_alive():
                raise VmNodesError(f"the guest ended before its nodes were up: {self._failure_text()}")
            if time.monotonic() > deadline:
                raise VmNodesError(f"the guest's nodes were not up within {self.boot_timeout:g}s: "
                                   f"{self._failure_text()}")
            time.sleep(0.2)
        self.boot_seconds = time.monotonic() - started
        self.ready = json.loads(ready.read_text())
        # Read within one poll of its writing: a rough bound on the guest clock's offset.
        self.clock_offset = float(self.ready["time"]) - time.time()
        return self

    def _run(self, argv: list[str], env: dict[str, str]) -> None:
        try:
            with self.guest_log.open("a") as log:
                self.result = vm.run_in_vm(argv, cwd=paths.repo_root(), env=env, timeout=self.run_timeout,
                                           memory_mib=self.memory_mib, cpus=self.cpus, run_dir=self.share,
                                           stream=_Tee(log, sys.stderr), tap=self.tap, stop=self._stop)
        except BaseException as exc:  # reported by start()/stop(), not lost in the thread
            self.error = exc

    def stop(self) -> None:
        """Stop the guest's nodes and the guest; remove the tap, the routes, the Node objects (idempotent)."""
        try:
            if self._thread is not None and self._thread.is_alive():
                with contextlib.suppress(OSError):
                    self._request({"op": "stop"})
                self._thread.join(STOP_TIMEOUT)
                if self._thread.is_alive():
                    self._stop.set()  # run_in_vm stops QEMU by its pid
                    self._thread.join(30)
            with contextlib.suppress(OSError):
                if (self.share / LOGS).is_dir():
                    shutil.copytree(self.share / LOGS, self.log_dir / "guest-logs", dirs_exist_ok=True)
        finally:
            if self._tap_made:
                run(["ip", "link", "del", self.tap], check=False, timeout=10)
                self._tap_made = False
            with contextlib.suppress(Exception):
                self._route(add=False)
            kube = kubeapi.api_client(self.info.kubeconfig)
            for node in self.nodes:
                with contextlib.suppress(kubeapi.KubeError, OSError):
                    network.forget_node(kube, node)
            shutil.rmtree(self.share, ignore_errors=True)

    def _route(self, *, add: bool) -> None:
        """Host-gw routes to the guest nodes' pod ranges wherever a host node's would be."""
        ips = {i: node_ip(i) for i, _ in self.plan}
        for neighbour in [None, *network.endpoint_namespaces(), *(node_name(i) for i in network.node_indices())]:
            if add:
                podnet.route_pod_ranges(neighbour, list(ips), ips)
            else:
                for index in ips:
                    podnet.unroute_pod_range(neighbour, index)

    def _failure_text(self) -> str:
        parts = []
        if self.error is not None:
            parts.append(f"{type(self.error).__name__}: {self.error}")
        if self.result is not None:
            parts.append(f"guest exit {self.result.returncode} (timed out: {self.result.timed_out}) "
                         f"after {self.result.seconds:.0f}s; output: {self.result.output[-4000:]}")
        return " | ".join(parts) or f"see {self.guest_log}"

    # -- requests

    def _request(self, body: dict[str, Any]) -> str:
        rid = f"{next(self._ids):06d}"
        tmp = self.share / REQUESTS / f"{rid}.tmp"
        tmp.write_text(json.dumps({"id": rid, **body}))
        tmp.rename(self.share / REQUESTS / f"{rid}.json")
        return rid

    def call(self, op: str, *, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        """One request to the guest and its answer; VmNodesError when the guest is gone or silent."""
        rid = self._request({"op": op, **params})
        answer = self.share / RESPONSES / f"{rid}.json"
        deadline = time.monotonic() + timeout
        while not answer.exists():
            if self._thread is None or not self._thread.is_alive():
                raise VmNodesError(f"the guest is gone ({op}): {self._failure_text()}")
            if time.monotonic() > deadline:
                raise VmNodesError(f"the guest did not answer {op} {params} within {timeout:g}s")
            time.sleep(POLL_SECONDS)
        reply: dict[str, Any] = json.loads(answer.read_text())
        answer.unlink()
        if "exception" in reply:
            raise VmNodesError(f"{op} {params} failed in the guest: {reply['exception']}")
        return reply

    def exec(self, node: str, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
             input: str | None = None) -> Result:
        """Run argv inside a guest node's namespace (like the tests' node_exec)."""
        reply = self.call("exec", netns=node, argv=list(argv), cmd_timeout=timeout, input=input, timeout=timeout + 30)
        result = Result(list(argv), reply["returncode"], reply["stdout"], reply["stderr"])
        if check and result.returncode != 0:
            raise VmNodesError(f"{argv} in {node} exited {result.returncode}: {result.stderr[-2000:]}")
        return result

    def http_get(self, node: str, url: str, *, timeout: float = 3.0) -> tuple[int, str]:
        reply = self.call("http_get", netns=node, url=url, http_timeout=timeout, timeout=timeout + 30)
        if "error" in reply:
            raise OSError(reply["error"])
        return int(reply["status"]), str(reply["body"])

    def tcp_probe(self, node: str, ip: str, port: int, count: int = 5, *, timeout: float = 2.0) -> ProbeCounts:
        reply = self.call("tcp_probe", netns=node, ip=ip, port=port, count=count, probe_timeout=timeout,
                          timeout=count * timeout + 30)
        return _counts(reply)

    def start_prober(self, node: str, ip: str, port: int, *, interval: float = 0.05) -> None:
        self.call("prober_start", netns=node, ip=ip, port=port, interval=interval)

    def stop_prober(self, node: str) -> ProbeCounts:
        return _counts(self.call("prober_stop", netns=node))


def _counts(reply: dict[str, Any]) -> ProbeCounts:
    return ProbeCounts(ok=reply["ok"], failed=reply["failed"], errors=reply["errors"], served_by=reply["served_by"],
                       failures=[(float(t), str(e)) for t, e in reply.get("failures", [])])


class _Tee:
    """The guest's output to its log file and to the terminal."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _links() -> set[str]:
    out = run(["ip", "-o", "link", "show"], timeout=10).stdout
    return {line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line}


# ------------------------------------------------------------------ guest side

def _say(message: str) -> None:
    print(f"[vmnodes guest] {message}", flush=True)


def _uplink() -> str:
    """The guest's NIC (virtio-net, no udev to rename it): its one link besides lo."""
    links = sorted(name for name in os.listdir("/sys/class/net") if name != "lo" and
                   Path(f"/sys/class/net/{name}/device").exists())
    if len(links) != 1:
        raise VmNodesError(f"expected one NIC in the guest, found {links}")
    return links[0]


def _guest_bridge() -> None:
    uplink = _uplink()
    bridge = paths.BRIDGE_NAME
    run(["ip", "link", "add", bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{GUEST_BRIDGE_ADDRESS}/{paths.BRIDGE_PREFIX}", "dev", bridge])
    run(["ip", "link", "set", uplink, "master", bridge])
    run(["ip", "link", "set", uplink, "up"])
    run(["ip", "link", "set", bridge, "up"])
    routes = run(["ip", "route", "show", "default"]).stdout.strip()
    if routes:
        raise VmNodesError(f"the guest has a default route: {routes}")


def _wait_api(host: str, port: int) -> None:
    deadline = time.monotonic() + API_WAIT_SECONDS
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise VmNodesError(f"the API server {host}:{port} is not reachable from the guest: {exc}") from exc
            time.sleep(0.5)


class _Server:
    """Answers the host's requests from the share until a stop request."""

    def __init__(self, share: Path) -> None:
        self.share = share
        self.probers: dict[str, workloads.ContinuousProber] = {}

    def serve(self, deadline: float) -> None:
        requests = self.share / REQUESTS
        while time.monotonic() < deadline:
            for path in sorted(requests.glob("*.json")):
                body = json.loads(path.read_text())
                path.unlink()
                if body["op"] == "stop":
                    _say("stop requested")
                    return
                try:
                    reply = self.handle(body)
                except Exception as exc:  # the host gets the text; the server keeps serving
                    reply = {"exception": f"{type(exc).__name__}: {exc}"}
                tmp = self.share / RESPONSES / f"{body['id']}.tmp"
                tmp.write_text(json.dumps(reply))
                tmp.rename(self.share / RESPONSES / f"{body['id']}.json")
            time.sleep(POLL_SECONDS)
        _say("no stop request before the guest's lifetime ran out: stopping")

    def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        op, netns = body["op"], body.get("netns")
        if op == "exec":
            result = run(body["argv"], netns=netns, timeout=float(body["cmd_timeout"]), check=False,
                         input=body.get("input"))
            return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
        if op == "http_get":
            try:
                status, text = workloads.http_get(str(netns), body["url"], timeout=float(body["http_timeout"]))
            except OSError as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"status": status, "body": text}
        if op == "tcp_probe":
            probe = workloads.tcp_probe(str(netns), body["ip"], int(body["port"]), int(body["count"]),
                                        timeout=float(body["probe_timeout"]))
            return _probe_reply(probe, [])
        if op == "prober_start":
            if netns in self.probers:
                raise VmNodesError(f"a prober runs in {netns} already")
            self.probers[str(netns)] = workloads.ContinuousProber(
                str(netns), body["ip"], int(body["port"]), interval=float(body["interval"])).start()
            return {}
        if op == "prober_stop":
            prober = self.probers.pop(str(netns))
            return _probe_reply(prober.stop(), prober.failures)
        raise VmNodesError(f"unknown request {op!r}")

    def stop_probers(self) -> None:
        for prober in self.probers.values():
            with contextlib.suppress(Exception):
                prober.stop()


def _probe_reply(probe: workloads.ProbeResult, failures: list[tuple[float, str]]) -> dict[str, Any]:
    return {"ok": probe.ok, "failed": probe.failed, "errors": dict(probe.errors),
            "served_by": dict(probe.served_by), "failures": failures}


def _save_logs(state_dir: Path, share: Path) -> None:
    """The guest's cluster logs (simulators, kube-proxy, agent) into the share: the guest's /tmp dies with it."""
    target = share / LOGS
    layout = paths.StateLayout(state_dir)
    with contextlib.suppress(OSError):
        shutil.copytree(layout.logs, target, dirs_exist_ok=True)
    for log in layout.nodes.glob("*/**/*.log") if layout.nodes.is_dir() else []:
        with contextlib.suppress(OSError):
            dest = target / "nodes" / log.relative_to(layout.nodes)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, dest)


def guest_main(args: argparse.Namespace) -> int:
    share = Path(args.share)
    plan = parse_plan(args.nodes)
    host_nodes = [int(i) for i in args.host_nodes.split(",") if i]
    state_dir = paths.default_state_dir()  # the guest's own /tmp: never the host's cluster folder
    access = network.ClusterAccess(share / SHARE_KUBECONFIG, Path(args.bin_dir), args.api_url)
    server = _Server(share)
    started = time.monotonic()
    deadline = started + float(args.max_seconds)
    try:
        _guest_bridge()
        ips = {i: node_ip(i) for i in host_nodes}
        for index, _ in plan:
            network.create_node_netns(index)
            podnet.route_pod_ranges(node_name(index), host_nodes, ips)
        _wait_api(*access.api_host_port)
        _say(f"bridge and node namespaces in {time.monotonic() - started:.1f}s; starting the node simulators")
        names = network.start_nodes(state_dir, access, plan, start_timeout=GUEST_SIMULATOR_START_TIMEOUT,
                                    probe_time_scale=GUEST_PROBE_TIME_SCALE)
        _say(f"nodes {', '.join(names)} reported after {time.monotonic() - started:.1f}s")
        # The guest's clock (from the emulated RTC at boot) beside the host's: the host reports the skew.
        (share / f"{READY_FILE}.tmp").write_text(json.dumps({"nodes": names, "seconds": time.monotonic() - started,
                                                             "time": time.time()}))
        (share / f"{READY_FILE}.tmp").rename(share / READY_FILE)
        server.serve(deadline)
        return 0
    finally:
        server.stop_probers()
        _save_logs(state_dir, share)
        network.remove_all(state_dir)
        _say(f"nodes stopped after {time.monotonic() - started:.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localcluster.vmnodes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    guest = sub.add_parser("guest", help="inside the QEMU guest only: start the nodes, serve the host")
    guest.add_argument("--share", required=True)
    guest.add_argument("--nodes", required=True, help="INDEX:POOL,...")
    guest.add_argument("--host-nodes", default="", help="indices of the host's nodes (for host-gw routes)")
    guest.add_argument("--bin-dir", required=True)
    guest.add_argument("--api-url", required=True)
    guest.add_argument("--max-seconds", type=float, default=DEFAULT_RUN_TIMEOUT,
                       help="stop the nodes and power off after this long even without a stop request")
    args = parser.parse_args(argv)
    if os.environ.get(GUEST_ENV) != "1":
        parser.error("`guest` runs inside the QEMU guest only (it makes a bridge named psbr0)")
    return guest_main(args)


if __name__ == "__main__":
    sys.exit(main())
