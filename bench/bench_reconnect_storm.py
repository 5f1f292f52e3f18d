"""Agent reconnect storm: N agents' watches after an API server restart, with and without jitter.

    sudo python -m bench.bench_reconnect_storm [--agents 5000] [--backoff none,jitter]
    # quick: --agents 500

A PRIVATE control plane (never the local cluster's): etcd and kube-apiserver from the local
cluster's build (localcluster.build), on loopback ports 23379/23380/17443, state under
/tmp/ps-bench-storm-<pid>/. N ProxyNodes, and N simulated agents: the REAL agent's watch loop
(proxyshift.agent.loop.Agent._watch_loop: GET, watch from the resourceVersion, the back-off of
agent/backoff.py) against the real kubernetes client, one thread per agent as in the agent,
several hundred per process in several processes (bench/harness/storm_agents.py). The agents
authenticate as the agent's own service account (a client certificate for
system:serviceaccount:proxyshift-system:proxyshift-agent in system:serviceaccounts, bound to
config/rbac/agent.yaml's ClusterRole), so API Priority and Fairness treats them as it treats the
real fleet: one flow, in the workload-low priority level, with the API server's default limits.

Per back-off (`none`: the wait is the doubling ceiling itself, 1, 2, 4 ... 30 s, as before the
jitter; `jitter`: drawn in [0.5 s, ceiling]), on the same control plane: the agents start (ramped)
and every watch is live; then the API server is killed (SIGKILL; `--signal TERM` for a graceful
stop, which keeps the open watches for its 60 s drain and then ends them all at once, so the
agents see the same outage a minute later) and started again with the same flags (etcd keeps
running). Measured:

  answering    from the kill to the new API server's first 2xx answer to an agent; ready: to its
               /readyz (it serves requests well before that; 403 while its RBAC caches fill)
  all live     from the kill until every agent has a watch that the API server answered 200 and
               that did not then fail (the live moment is when the answer's headers came), and its
               median / 90th percentile over agents
  requests     the agents' GETs and watch requests that reached the API server (any HTTP answer)
               from the kill on, and the largest number in one second (by the second they were
               sent); 403s: before the RBAC caches filled; 429s: priority-and-fairness refusals.
               The API server's own apiserver_request_total for proxynodes is printed below
  CPU          the agent processes' CPU time from the kill until every watch was live, and the new API
               server's from its start: on this 2-core machine the simulated fleet's own TLS handshakes
               and client code compete with the API server, which a real fleet (one agent per node)
               does not. The fleet runs in an idle CPU group (harness/cpu_group.py): it gets only the
               CPU the control plane leaves
  verified     a status write to a sample of ProxyNodes, each seen back through its agent's watch

Target (issue 18): every watch live within 60 s, the request rate bounded by the back-off.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import queue
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import kubernetes

from bench.bench_controller_scale import Procs, apiserver_argv, cpu_s, etcd_argv, kubectl_apply, wait_for
from bench.harness import cpu_group
from bench.harness.storm_agents import node_name
from localcluster import controlplane, pki
from localcluster.build import build
from localcluster.kubeapi import pooled_api_client
from proxyshift.commands import run, stop_child

ROOT = Path(__file__).resolve().parents[1]

# Not the local cluster's (6443/2379) nor bench_controller_scale's (16443/22379): both may run beside this.
ETCD_PORT, ETCD_PEER_PORT, API_PORT = 23379, 23380, 17443
AGENT_NS, AGENT_SA = "proxyshift-system", "proxyshift-agent"
AGENT_USER = f"system:serviceaccount:{AGENT_NS}:{AGENT_SA}"
AGENT_GROUPS = ("system:serviceaccounts", f"system:serviceaccounts:{AGENT_NS}")
GROUP, VERSION = "proxyshift.io", "v1alpha1"


@dataclass
class Result:
    backoff: str
    agents: int
    away_s: float = math.nan          # stop -> /readyz of the new API server
    answering_s: float = math.nan     # stop -> the first 2xx answer of the new API server to an agent
    stop_s: float = math.nan          # stop -> the old process gone
    all_live_s: float = math.nan      # stop -> the last agent's watch live
    p50_s: float = math.nan
    p90_s: float = math.nan
    all_live_after_ready_s: float = math.nan
    crashes: int = 0                  # times the new API server exited by itself before /readyz
    agents_cpu_s: float = math.nan    # CPU time of the agent processes from the stop to every watch live
    apiserver_cpu_s: float = math.nan  # CPU time of the new API server from its start to every watch live
    noticed_p50_s: float = math.nan   # stop -> an agent's watch stream seen ended, median over agents
    noticed_max_s: float = math.nan
    load: str = ""
    not_live: int = 0
    reached: int = 0                  # requests with an HTTP answer, from the stop on
    peak_rps: int = 0
    peak_second: int = 0              # seconds after /readyz of that peak
    throttled: int = 0                # 429
    other_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0
    peak_refused_ps: int = 0
    server_count: float = math.nan    # the API server's apiserver_request_total for proxynodes GET/WATCH
    verified: int = 0
    verify_of: int = 0
    per_second: list[int] = field(default_factory=list)  # reached requests per second, from first_second on
    first_second: int = 0             # relative to /readyz: negative before it (the port answers early)


class ApiServerExited(RuntimeError):
    """The API server process ended by itself (e.g. a post-start hook timed out under the storm)."""


class Control:
    """etcd + kube-apiserver on private ports; the API server can be restarted with the same flags."""

    def __init__(self, state: Path, bin_dir: Path, procs: Procs) -> None:
        self.state, self.bin_dir, self.procs = state, bin_dir, procs
        self.env = controlplane.daemon_env()
        self.pki_dir = state / "pki"
        self.files = pki.ensure_pki(self.pki_dir)
        self.url = f"https://127.0.0.1:{API_PORT}"
        self.admin = pki.write_kubeconfig(state / "admin.kubeconfig", self.url, self.pki_dir, "admin")
        pki.issue_client_cert(self.pki_dir, "agent", AGENT_USER, AGENT_GROUPS)
        self.agent = pki.write_kubeconfig(state / "agent.kubeconfig", self.url, self.pki_dir, "agent")
        ctx = ssl.create_default_context(cafile=str(self.files.ca_cert))
        ctx.load_cert_chain(str(self.files.client_cert("admin")), str(self.files.client_key("admin")))
        self._ssl = ctx
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start_etcd(self) -> None:
        self.procs.start("etcd", etcd_argv(self.bin_dir, "ps-bench-storm", self.state / "etcd", ETCD_PORT,
                                           ETCD_PEER_PORT), env=self.env)

    def start_apiserver(self) -> None:
        """The flags of bench_controller_scale's control plane (and the local cluster's), minus the audit log:
        the API server's own limits (max-requests-inflight, priority and fairness) at their defaults."""
        self.starts += 1
        self.apiserver = self.procs.start(f"kube-apiserver-{self.starts}",
                                          apiserver_argv(self.bin_dir, self.files, ETCD_PORT, API_PORT), env=self.env)

    def get(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.url + path, context=self._ssl, timeout=timeout) as resp:
            return str(resp.read().decode())

    def ready(self) -> bool:
        if self.apiserver is not None and self.apiserver.poll() is not None:
            raise ApiServerExited(f"kube-apiserver exited {self.apiserver.returncode}; see {self.procs.logs}")
        try:
            return self.get("/readyz", timeout=2.0).strip() == "ok"
        except OSError:  # refused, reset, 500 while starting: not yet
            return False

    def wait_ready(self, timeout: float) -> float:
        """Poll /readyz every 0.1 s (as admin: exempt from priority and fairness); returns when it said ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return time.monotonic()
            time.sleep(0.1)
        raise TimeoutError(f"kube-apiserver not ready after {timeout:g}s")

    def stop_apiserver(self, sig: int) -> None:
        if self.apiserver is not None:
            stop_child(self.apiserver, grace=90, sig=sig)

    def proxynode_requests(self) -> float:
        """The API server's own count of proxynodes GETs and WATCHes (any code), since it started."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for fam in text_string_to_metric_families(self.get("/metrics", timeout=30)):
            for s in fam.samples:
                if s.name == "apiserver_request_total" and s.labels.get("resource") == "proxynodes" and \
                        s.labels.get("verb") in ("GET", "WATCH") and not s.labels.get("subresource"):
                    total += s.value
        return total


class Worker:
    """One storm_agents process: its status lines read on a thread of its own."""

    def __init__(self, procs: Procs, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.log = open(procs.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT,
            start_new_session=True)
        self.status: dict[str, Any] = {"t": 0.0, "started": 0, "live": 0}
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if "live" in msg:
                    self.status = msg
                else:
                    self.answers.put(msg)

    def send(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        if stdin is None or self.proc.poll() is not None:
            raise RuntimeError(f"agent process {self.proc.pid} is gone (exit {self.proc.returncode})")
        stdin.write(line + "\n")
        stdin.flush()

    def stop(self) -> None:
        stop_child(self.proc, grace=5)
        self.log.close()


def create_proxynodes(admin: Path, n: int) -> None:
    api = pooled_api_client(admin, 16)
    custom = kubernetes.client.CustomObjectsApi(api)

    def one(i: int) -> None:
        custom.create_cluster_custom_object(GROUP, VERSION, "proxynodes", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyNode", "metadata": {"name": node_name(i)}, "spec": {}})

    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(one, i) for i in range(n)]:
            f.result()


def listen_free(port: int) -> bool:
    """Whether nothing listens on the port. SO_REUSEADDR as etcd and the API server bind: a storm leaves
    thousands of its connections in TIME_WAIT, which a plain bind counts as busy for a minute."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fleet_live(workers: list[Worker], after: float) -> int:
    """Live watches by the workers' latest reports, counting only reports sent after `after`."""
    return sum(w.status["live"] for w in workers if w.status["t"] > after)


def analyse(res: Result, records: list[list[Any]], n: int, t_stop: float, t_ready: float) -> None:
    by_agent: dict[int, list[list[Any]]] = collections.defaultdict(list)
    for r in records:
        by_agent[r[0]].append(r)
    live_after: list[float] = []
    for idx in range(n):
        # Each 2xx watch is followed by at most one "end" record (its stream ending); the agent is live
        # from the first watch after the stop whose stream did not then fail.
        candidate: float | None = None
        live: float | None = None
        for _, _t0, t1, verb, outcome in sorted(by_agent.get(idx, []), key=lambda r: r[2]):
            if t1 < t_stop:
                continue
            if verb == "watch" and outcome.startswith("2"):
                candidate = t1
            elif verb == "end" and candidate is not None:
                if outcome != "error":
                    live = candidate
                    break
                candidate = None
        live = live if live is not None else candidate
        if live is None:
            res.not_live += 1
        else:
            live_after.append(live - t_stop)
    if live_after:
        res.all_live_s = max(live_after)
        res.all_live_after_ready_s = res.all_live_s - (t_ready - t_stop)
        res.p50_s = statistics.median(live_after)
        res.p90_s = statistics.quantiles(live_after, n=10)[-1] if len(live_after) > 1 else live_after[0]
    # The fleet's own reaction: when each agent's watch stream was seen ending after the stop (one agent per
    # thread; a starved simulator notices late, a real fleet at once).
    first_end: dict[int, float] = {}
    for idx, _t0, t1, verb, _o in records:
        if verb == "end" and t1 >= t_stop:
            first_end[idx] = min(t1 - t_stop, first_end.get(idx, math.inf))
    noticed = sorted(first_end.values())
    if noticed:
        res.noticed_p50_s, res.noticed_max_s = statistics.median(noticed), noticed[-1]
    reached: collections.Counter[int] = collections.Counter()
    refused: collections.Counter[int] = collections.Counter()
    for _, t0, _t1, verb, outcome in records:
        if verb == "end" or t0 < t_stop:
            continue
        second = math.floor(t0 - t_ready)
        if outcome == "conn":
            res.refused += 1
            refused[second] += 1
            continue
        res.reached += 1
        reached[second] += 1
        if outcome.startswith("2"):
            res.answering_s = min(res.answering_s, t0 - t_stop) if not math.isnan(res.answering_s) else t0 - t_stop
        if outcome == "429":
            res.throttled += 1
        elif not outcome.startswith("2"):
            res.other_errors[outcome] += 1
    if reached:
        res.peak_second, res.peak_rps = max(reached.items(), key=lambda kv: kv[1])
        res.first_second = min(reached)
        res.per_second = [reached.get(s, 0) for s in range(min(reached), max(reached) + 1)]
    res.peak_refused_ps = max(refused.values(), default=0)


def restart_alone(ctl: Control, sig: int) -> float:
    """Seconds from stopping the API server to the new one's /readyz with no agent knocking: the part of a
    storm's time that is the API server's own start on this machine."""
    t_stop = time.monotonic()
    ctl.stop_apiserver(sig)
    ctl.start_apiserver()
    return ctl.wait_ready(300) - t_stop


def storm(ctl: Control, procs: Procs, n: int, backoff: str, per_process: int, ramp: float, verify: int,
          timeout: float, sig: int, fleet_group: Path | None) -> Result:
    res = Result(backoff, n)
    env = {**ctl.env, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT)])}
    workers: list[Worker] = []
    try:
        count = math.ceil(n / per_process)
        for k in range(count):
            first = k * per_process
            workers.append(Worker(procs, f"agents-{backoff}-{k}", [
                sys.executable, "-m", "bench.harness.storm_agents", "--kubeconfig", str(ctl.agent),
                "--first", str(first), "--count", str(min(per_process, n - first)), "--backoff", backoff,
                "--ramp", str(ramp / count)]
                + (["--cpu-group", str(fleet_group)] if fleet_group is not None else ["--nice", "19"]), env))
        began = time.monotonic()
        wait_for(f"{n} agents' first watches", lambda: fleet_live(workers, began) == n, n / ramp + 600)
        print(f"  {backoff}: {n} watches live after {time.monotonic() - began:.0f}s; restarting the API server",
              file=sys.stderr, flush=True)
        time.sleep(5)  # past HEALTHY_WATCH_SECONDS: the agents see a new outage, as after a real restart
        cpu0 = sum(cpu_s(w.proc.pid) for w in workers)
        t_stop = time.monotonic()
        ctl.stop_apiserver(sig)
        res.stop_s = time.monotonic() - t_stop
        ctl.start_apiserver()
        while True:
            try:
                t_ready = ctl.wait_ready(300)
                break
            except ApiServerExited as exc:
                # Seen with 5,000 agents and no jitter: the herd's TLS handshakes starved the new API server's
                # own loopback client, its rbac/bootstrap-roles hook timed out and it exited. A kubelet
                # restarts a crashed static pod; so does this, and counts it.
                res.crashes += 1
                print(f"  {backoff}: {exc} (crash {res.crashes}); starting it again", file=sys.stderr, flush=True)
                if res.crashes > 5:
                    raise
                ctl.start_apiserver()
        res.away_s = t_ready - t_stop
        print(f"  {backoff}: API server stopped in {res.stop_s:.1f}s, ready again {res.away_s:.1f}s after the stop",
              file=sys.stderr, flush=True)
        deadline = t_ready + timeout
        while time.monotonic() < deadline and fleet_live(workers, t_ready) < n:
            time.sleep(1)
        live = fleet_live(workers, t_ready)
        res.agents_cpu_s = sum(cpu_s(w.proc.pid) for w in workers) - cpu0
        res.apiserver_cpu_s = cpu_s(ctl.apiserver.pid) if ctl.apiserver is not None else math.nan
        res.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        print(f"  {backoff}: {live}/{n} watches live {time.monotonic() - t_ready:.0f}s after ready",
              file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):
            res.server_count = ctl.proxynode_requests()
        if verify:
            per = max(1, verify // len(workers))
            for w in workers:
                w.send(f"verify {per}")
            for w in workers:
                answer = w.answers.get(timeout=120)
                res.verified += int(answer.get("verified", 0))
                res.verify_of += per
                if "verify_error" in answer:
                    print(f"  verify: {answer['verify_error']}", file=sys.stderr)
        records: list[list[Any]] = []
        for k, w in enumerate(workers):
            out = procs.logs / f"records-{backoff}-{k}.json"
            w.send(f"dump {out}")
            w.proc.wait(timeout=120)
            records += json.loads(out.read_text())
        analyse(res, records, n, t_stop, t_ready)
    finally:
        for w in workers:
            w.stop()
    return res


def fmt(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.1f}"


def table(results: list[Result]) -> str:
    rows = ["| agents | back-off | API server answering / ready s after the kill | all watches live s after the kill | "
            "p50 / p90 s | requests reaching the API server | peak requests/s | 403s / 429s | API server crashes | "
            "agents' / API server's CPU s | watches verified |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        all_live = fmt(r.all_live_s) if not r.not_live else f"not all ({r.not_live} never)"
        rows.append(f"| {r.agents} | {r.backoff} | {fmt(r.answering_s)} / {fmt(r.away_s)} | {all_live} | "
                    f"{fmt(r.p50_s)} / {fmt(r.p90_s)} | {r.reached} | {r.peak_rps} | "
                    f"{r.other_errors.get('403', 0)} / {r.throttled} | {r.crashes} | {fmt(r.agents_cpu_s)} / "
                    f"{fmt(r.apiserver_cpu_s)} | "
                    f"{r.verified}/{r.verify_of} |")
    for r in results:
        rows.append(f"\n{r.backoff}: requests reaching the API server per second, from second {r.first_second} "
                    f"after /readyz on: {r.per_second[:120]}")
        rows.append(f"{r.backoff}: every watch live {fmt(r.all_live_after_ready_s)} s after /readyz; refused "
                    f"connects {r.refused} (peak {r.peak_refused_ps}/s); API server's apiserver_request_total for "
                    f"proxynodes GET+WATCH {'—' if math.isnan(r.server_count) else int(r.server_count)} (open watches "
                    f"count when they end); load average at the end {r.load}")
        rows.append(f"{r.backoff}: the agents saw their watches end {fmt(r.noticed_p50_s)} s after the stop (median), "
                    f"the last {fmt(r.noticed_max_s)} s")
        others = {k: v for k, v in r.other_errors.items() if k != "403"}
        if others:
            rows.append(f"{r.backoff}: other answers: {others}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=5000)
    p.add_argument("--backoff", default="none,jitter", help="comma-separated: none (the old schedule), jitter")
    p.add_argument("--per-process", type=int, default=625, help="agents (threads) per agent process")
    p.add_argument("--ramp", type=float, default=250.0, help="agents started per second, in all (first connects)")
    p.add_argument("--verify", type=int, default=200, help="ProxyNodes written to check their agent's watch")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds after ready to wait for every watch")
    p.add_argument("--signal", choices=("KILL", "TERM"), default="KILL", help="how the API server is stopped")
    p.add_argument("--keep", action="store_true", help="keep the state folder (logs, request records)")
    p.add_argument("--fleet-cpu", choices=("idle", "nice"), default="idle",
                   help="the simulated fleet in an idle CPU group (default; nice 19 where none can be made) or at "
                        "nice 19")
    args = p.parse_args(argv)
    # The control plane runs at the caller's priority, the simulated fleet in an idle CPU group
    # (harness/cpu_group.py): on a real cluster the agents run on their own nodes and never take the API
    # server's CPU. Before 2026-12-05 everything ran at 19, and at 5,000 agents the fleet's TLS handshakes
    # starved the restarted API server's own post-start hooks until it exited; the fleet alone at nice 19 still
    # took most of the CPU (5,000 threads, each weighed on its own).
    # SIGTERM and SIGINT (ignored by default in a background job) unwind through the finally blocks below,
    # which stop the agents, the API server and etcd by their own handles.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    bin_dir = build()
    deadline = time.monotonic() + 90
    # A previous run's sockets (its storm's connections, its API server going) linger for a while.
    while (busy := [p for p in (ETCD_PORT, ETCD_PEER_PORT, API_PORT) if not listen_free(p)]) and \
            time.monotonic() < deadline:
        time.sleep(2)
    if busy:
        print(f"ports in use: {busy}", file=sys.stderr)
        return 2
    state = Path(f"/tmp/ps-bench-storm-{os.getpid()}")
    state.mkdir(parents=True)
    procs = Procs(state / "logs")
    results: list[Result] = []
    fleet_group, fleet_cpu = None, "nice 19"
    if args.fleet_cpu == "idle":
        fleet_group, how = cpu_group.make_idle_group(f"proxyshift-storm-fleet-{os.getpid()}")
        fleet_cpu = how if fleet_group is not None else f"nice 19 ({how})"
    print(f"  the simulated fleet's CPU: {fleet_cpu}", file=sys.stderr, flush=True)
    try:
        ctl = Control(state, bin_dir, procs)
        ctl.start_etcd()
        ctl.start_apiserver()
        ctl.wait_ready(120)
        kubectl = str(bin_dir / "kubectl")
        kubectl_apply(kubectl, ctl.admin, files=[ROOT / "crds" / "proxynode.yaml"])
        kubectl_apply(kubectl, ctl.admin, docs=[{"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": AGENT_NS}}])
        kubectl_apply(kubectl, ctl.admin, files=[ROOT / "config" / "rbac" / "agent.yaml"])
        wait_for("the ProxyNode CRD", lambda: run([kubectl, "--kubeconfig", str(ctl.admin), "get", "proxynodes"],
                                                  timeout=10, check=False, env=ctl.env).returncode == 0, 60)
        t0 = time.monotonic()
        create_proxynodes(ctl.admin, args.agents)
        print(f"  {args.agents} ProxyNodes created in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        sig = getattr(signal, f"SIG{args.signal}")
        alone = restart_alone(ctl, sig)
        print(f"  the API server restarted with no agents: /readyz {alone:.1f}s after the stop", file=sys.stderr,
              flush=True)
        for backoff in args.backoff.split(","):
            results.append(storm(ctl, procs, args.agents, backoff, args.per_process, args.ramp, args.verify,
                                 args.timeout, sig, fleet_group))
            print(table(results), flush=True)
        print(f"\nThe API server's own restart with no agents knocking (same {args.agents} ProxyNodes, "
              f"SIG{args.signal}): /readyz {alone:.1f}s after the stop. The simulated fleet's CPU: {fleet_cpu}.",
              flush=True)
    finally:
        procs.stop()
        if fleet_group is not None:
            cpu_group.remove(fleet_group)
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"state kept in {state}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
