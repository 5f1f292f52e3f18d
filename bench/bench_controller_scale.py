"""Controller scale: the operator against a real kube-apiserver with 1,000-5,000 nodes.

    sudo nice -n 19 python -m bench.bench_controller_scale [--nodes 1000,5000] [--keep]

Per size, a PRIVATE control plane (never the local cluster's): etcd and
kube-apiserver from the local cluster's build, on loopback ports 22379/22380
and 16443, state under /tmp/ps-bench-scale-<pid>/, an audit log of every
request made by the operator's own identity (client cert CN
proxyshift-operator, group system:masters). No scheduler or
controller-manager: bench/harness/scale_harness.py plays the DaemonSet
controller, the kubelets and the agents, answering instantly.

Then: CRDs and the baseline kube-proxy ConfigMap/DaemonSet are installed, N
Nodes, ProxyNodes and baseline kube-proxy pods created, the operator started
(`python -m proxyshift.cli operator --standalone`), and a ProxyPolicy to
nftables over all N nodes with maxUnavailable 10% applied. Measured:

  converge     from the apply to the policy's Ready condition (True, for the
               current generation, every node updated)
  writes/node  create/update/patch/delete requests by the operator during the
               rollout (audit log), split by verb and resource, / N
  RSS          operator VmHWM (kernel's peak resident set) and VmRSS at the end
  status       the largest JSON size of the policy's .status seen during the
               rollout (polled every 2 s) and at the end
  write floor  after Ready, the operator and the harness stop and a minimal
               client (bench/harness/write_floor.py, its own identity
               proxyshift-floor) replays the operator's writes from the audit
               log (level Request for writes): same resources, subresources,
               verbs, query, bodies (plus an annotation that makes each patch
               a real write), same count, each object's writes in their order,
               8 objects at a time (the operator's PROXYSHIFT_NODE_CONCURRENCY,
               set for it here; --floor-concurrency). The floor is the time the
               API server takes for them; converge/floor how far the rollout is
               from it. The floor's own audited writes are checked against the
               operator's by verb and resource.
  CPU          CPU seconds of etcd, kube-apiserver, the operator, this process
               (harness, then floor client) and the whole machine in the
               rollout and in the floor: where the time went

  RSS at apply the operator's VmRSS when the policy is applied (caches filled)

Options for finding out why: --profile samples the operator with py-spy (dev
extra) through the rollout and prints the share of CPU samples per function;
--tracemalloc runs it under tracemalloc (bench/harness/traced_operator.py)
and prints its allocations at Ready and what grew since the apply (slow: its
RSS and times are then not the bench's); --no-floor skips the write floor.

Targets (issue 7): <= 8 writes per node, RSS < 250 MB at 5,000 nodes, status
< 16 KiB. Issue 18: converge within 2x of the write floor at 1,000 and 5,000;
10,000 nodes with RSS < 300 MB.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import kubernetes
import yaml

from bench.harness import traced_operator, write_floor
from bench.harness.scale_harness import GROUP, POOL_LABEL, VERSION, Fleet
from localcluster import baseline, controlplane, pki
from localcluster.build import build
from localcluster.kubeapi import pooled_api_client
from proxyshift.commands import CommandError, run, stop_child

ROOT = Path(__file__).resolve().parents[1]

ETCD_PORT, ETCD_PEER_PORT, API_PORT = 22379, 22380, 16443
METRICS_PORT, LIVENESS_PORT = 28090, 28091
OPERATOR_USER = "proxyshift-operator"
FLOOR_USER = "proxyshift-floor"  # the write-floor client: its own identity, so its writes count apart
WRITE_VERBS = write_floor.WRITE_VERBS
# The operator's PROXYSHIFT_NODE_CONCURRENCY default, set explicitly for the operator here and used as
# the floor's concurrency, so that both send at most this many node writes at once.
NODE_CONCURRENCY = 8

# Writes at level Request: the write floor replays them from their request bodies. Both identities
# are audited alike, so the audit backend costs the rollout and the floor the same per write.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Request", "users": [OPERATOR_USER, FLOOR_USER], "verbs": sorted(WRITE_VERBS)},
              {"level": "Metadata", "users": [OPERATOR_USER, FLOOR_USER]}, {"level": "None"}],
}


@dataclass
class Result:
    nodes: int
    converge_s: float = float("nan")
    writes: collections.Counter[str] = field(default_factory=collections.Counter)
    reads: collections.Counter[str] = field(default_factory=collections.Counter)
    rss_start_mb: float = 0.0  # VmRSS at the apply: caches filled, nothing planned yet
    rss_peak_mb: float = 0.0
    rss_end_mb: float = 0.0
    status_max: int = 0
    status_end: int = 0
    setup_s: float = 0.0
    first_status_s: float = float("nan")  # apply -> first status: kopf's indexes warm, first plan done
    harness_writes: int = 0  # the fleet's own writes (pods, agent answers) during the rollout
    # CPU seconds per process in the rollout and in the floor window ("bench" is this process: the
    # harness's threads in the rollout, the floor client's in the floor; "machine" all cores, everyone).
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    harness_errors: list[str] = field(default_factory=list)
    actions: dict[str, float] = field(default_factory=dict)
    floor: write_floor.Floor | None = None
    floor_plan: write_floor.Plan | None = None
    floor_writes: collections.Counter[str] = field(default_factory=collections.Counter)  # audited, floor's identity
    tracemalloc: str = ""  # with --tracemalloc: the operator's allocations at Ready, and what grew since the apply
    profile: str = ""  # with --profile: where the operator's CPU went in the rollout (py-spy samples)

    @property
    def floor_s(self) -> float:
        return self.floor.seconds if self.floor is not None else float("nan")


class Procs:
    """Daemons started by this bench, stopped by their own Popen handles (never by name)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def stop(self, only: str | None = None) -> None:
        for name, proc in reversed(self.procs):
            if only is None or name == only:
                stop_child(proc)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, CommandError):  # the thing is still coming up
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout:g}s")


def etcd_argv(bin_dir: Path, name: str, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    """A one-member etcd on loopback, fsync off: the benches' control planes (and the local cluster's flags)."""
    url, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [str(bin_dir / "etcd"), f"--name={name}", f"--data-dir={data_dir}", f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}", f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={name}={peer}", "--unsafe-no-fsync", "--log-level=warn"]


def apiserver_argv(bin_dir: Path, files: pki.Pki, etcd_port: int, api_port: int) -> list[str]:
    """kube-apiserver on loopback with the local cluster's flags and the API server's own default limits."""
    return [
        str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
        f"--secure-port={api_port}", "--advertise-address=127.0.0.1",
        # Loopback only, and no endpoint reconciler: it refuses a loopback address, and nothing
        # here reaches the API through the kubernetes Service.
        "--endpoint-reconciler-type=none", "--service-cluster-ip-range=198.19.0.0/16",
        f"--tls-cert-file={files.apiserver_cert}", f"--tls-private-key-file={files.apiserver_key}",
        f"--client-ca-file={files.ca_cert}", "--authorization-mode=Node,RBAC", "--allow-privileged=true",
        "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={files.sa_pub}",
        f"--service-account-signing-key-file={files.sa_key}", "--api-audiences=https://kubernetes.default.svc",
        "--profiling=false", "--v=1"]


def control_plane(state: Path, bin_dir: Path, procs: Procs) -> tuple[Path, Path]:
    """etcd + kube-apiserver on private loopback ports; returns (admin, operator) kubeconfigs."""
    ports = (ETCD_PORT, ETCD_PEER_PORT, API_PORT, METRICS_PORT, LIVENESS_PORT)
    deadline = time.monotonic() + 60
    # A previous size's apiserver lingers a few seconds after SIGTERM: give it time to go.
    while (busy := [p for p in ports if not port_free(p)]) and time.monotonic() < deadline:
        time.sleep(1)
    if busy:
        raise RuntimeError(f"ports in use: {busy}")
    files = pki.ensure_pki(state / "pki")
    pki.issue_client_cert(state / "pki", "operator", OPERATOR_USER, ("system:masters",))
    url = f"https://127.0.0.1:{API_PORT}"
    admin = pki.write_kubeconfig(state / "admin.kubeconfig", url, state / "pki", "admin")
    operator = pki.write_kubeconfig(state / "operator.kubeconfig", url, state / "pki", "operator")
    (state / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    # The same flags as localcluster.controlplane, other ports and folders.
    env = controlplane.daemon_env()
    procs.start("etcd", [*etcd_argv(bin_dir, "ps-bench", state / "etcd", ETCD_PORT, ETCD_PEER_PORT),
                         "--quota-backend-bytes=8589934592"], env=env)
    procs.start("kube-apiserver", [
        *apiserver_argv(bin_dir, files, ETCD_PORT, API_PORT), f"--audit-policy-file={state / 'audit-policy.yaml'}",
        f"--audit-log-path={state / 'audit.log'}", "--audit-log-maxsize=4096", "--audit-log-format=json"], env=env)
    kubectl = str(bin_dir / "kubectl")
    api = procs.procs[-1][1]

    def api_ready() -> bool:
        if api.poll() is not None:
            raise RuntimeError(f"kube-apiserver exited; see {procs.logs / 'kube-apiserver.log'}")
        return run([kubectl, "--kubeconfig", str(admin), "get", "--raw", "/readyz"], timeout=10, check=False,
                   env=env).returncode == 0
    wait_for("kube-apiserver", api_ready, 120)
    return admin, operator


def kubectl_apply(kubectl: str, kubeconfig: Path, docs: list[dict[str, Any]] | None = None,
                  files: list[Path] | None = None) -> None:
    argv = [kubectl, "--kubeconfig", str(kubeconfig), "apply", "--server-side", "--force-conflicts"]
    if files:
        for f in files:
            argv += ["-f", str(f)]
        run(argv, timeout=120, env=controlplane.daemon_env())
    if docs:
        run([*argv, "-f", "-"], input=yaml.safe_dump_all(docs), timeout=120, env=controlplane.daemon_env())


def policy(nodes: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyPolicy", "metadata": {"name": "scale"},
            "spec": {"nodeSelector": {"matchLabels": {POOL_LABEL: "all"}}, "mode": "nftables",
                     "rollout": {"maxUnavailable": "10%"}, "gate": {"timeout": "5m", "minSyncs": 1}}}


def ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    gen = obj["metadata"].get("generation")
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []) and \
        st.get("observedGeneration") in (None, gen)


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat), whoever spent them."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


class CpuWindow:
    """CPU seconds of the named processes between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.begin: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {**{name: cpu_s(pid) for name, pid in self.pids.items()}, "machine": machine_busy_s()}

    def start(self) -> None:
        self.begin = self._now()

    def stop(self) -> dict[str, float]:
        return {k: v - self.begin[k] for k, v in self._now().items()}


def vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def count_requests(events: list[dict[str, Any]], user: str = OPERATOR_USER
                   ) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(writes, reads) of `user` by "verb resource[/subresource]"."""
    writes: collections.Counter[str] = collections.Counter()
    reads: collections.Counter[str] = collections.Counter()
    for ev in events:
        if ev.get("stage") != "ResponseComplete" or ev["user"]["username"] != user:
            continue
        key = write_floor.kind_of(ev["verb"], ev.get("objectRef") or {})
        (writes if ev["verb"] in WRITE_VERBS else reads)[key] += 1
    return writes, reads


def audit_counts(path: Path, offset: int, user: str = OPERATOR_USER
                 ) -> tuple[collections.Counter[str], collections.Counter[str]]:
    return count_requests(write_floor.read_audit(path, offset), user)


def operator_metrics() -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "proxyshift_actions_total":
                out[s.labels.get("action", "?")] = out.get(s.labels.get("action", "?"), 0) + s.value
    return out


def pyspy_argv(pid: int, out: Path) -> list[str]:
    """py-spy sampling the operator (all threads, CPU only, not idle waits) until SIGINT, as collapsed stacks.
    --nonblocking: the operator is not paused to read its stacks, so it runs at its own speed."""
    return [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--rate", "20",
            "--nonblocking", "--format", "raw", "--output", str(out)]


# Innermost frames of a thread that waits (on a socket, the selector, the loop's self-pipe): py-spy without
# pausing the process (--nonblocking) cannot tell such a thread from a busy one, so these are counted apart.
WAITING_FRAMES = frozenset({"SSLSocket.read (ssl.py)", "EpollSelector.select (selectors.py)",
                            "poll_wait_for_socket.<locals>.do_poll (wait.py)",
                            "BaseSelectorEventLoop._write_to_self (selector_events.py)",
                            "SocketIO.readinto (socket.py)", "Condition.wait (threading.py)"})


def profile_summary(path: Path, top: int = 25) -> str:
    """py-spy's collapsed stacks ("frame;frame;... count") as the share of samples per function: samples
    whose innermost frame waits (WAITING_FRAMES) apart, then of the others (the CPU's) inclusive (the
    function anywhere on the stack) and self (the innermost frame)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = waiting = 0
    try:
        text = path.read_text()
    except OSError as exc:
        return f"  no profile: {exc}"
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        if frames[-1] in WAITING_FRAMES:
            waiting += int(count)
            continue
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)
    if not total:
        return "  no samples"
    rows = [f"  {total + waiting} samples at 20 Hz, {waiting} of them waiting on a socket or selector; "
            f"of the other {total} (~{total / 20:.0f} s of the operator's CPU): inclusive"]
    rows += [f"    {100 * c / total:5.1f}%  {f}" for f, c in inclusive.most_common(top)]
    rows.append("  self (innermost frame)")
    rows += [f"    {100 * c / total:5.1f}%  {f}" for f, c in own.most_common(top)]
    return "\n".join(rows)


def write_floor_run(plan: write_floor.Plan, state: Path, audit: Path, concurrency: int
                    ) -> tuple[write_floor.Floor, collections.Counter[str]]:
    """Replay the operator's writes as the floor's identity; returns the time and the floor's audited writes."""
    cert, key = pki.issue_client_cert(state / "pki", "floor", FLOOR_USER, ("system:masters",))
    offset = audit.stat().st_size
    print(f"  write floor: {len(plan.writes)} writes, {concurrency} at a time", file=sys.stderr, flush=True)
    floor = write_floor.replay(plan, f"https://127.0.0.1:{API_PORT}", ca=pki.Pki(state / "pki").ca_cert,
                               cert=cert, key=key, concurrency=concurrency)
    # The caller's CPU window ends after this wait: a few seconds of idle API server, not the floor's.
    time.sleep(3)  # let the audit backend flush the last events
    return floor, audit_counts(audit, offset, FLOOR_USER)[0]


def bench(n: int, state: Path, bin_dir: Path, timeout: float, node_events: str = "steps",
          floor_concurrency: int = NODE_CONCURRENCY, traced: bool = False, floor: bool = True,
          profile: bool = False) -> Result:
    res = Result(n)
    procs = Procs(state / "logs")
    fleet: Fleet | None = None
    try:
        admin, op_kubeconfig = control_plane(state, bin_dir, procs)
        kubectl = str(bin_dir / "kubectl")
        kubectl_apply(kubectl, admin, files=[ROOT / "crds" / "proxypolicy.yaml", ROOT / "crds" / "proxynode.yaml"])
        kubectl_apply(kubectl, admin, docs=baseline.manifests())
        wait_for("CRDs", lambda: run([kubectl, "--kubeconfig", str(admin), "get", "proxynodes"], timeout=10,
                                     check=False, env=controlplane.daemon_env()).returncode == 0, 60)
        api = pooled_api_client(admin, 32)
        fleet = Fleet(api, n)
        t0 = time.monotonic()
        fleet.create()
        res.setup_s = time.monotonic() - t0
        print(f"  {n} nodes: fleet created in {res.setup_s:.0f}s ({fleet.writes} pod writes)", file=sys.stderr,
              flush=True)
        fleet.start()
        env = controlplane.daemon_env()
        env["PYTHONPATH"] = str(ROOT / "operator")
        env["PROXYSHIFT_NODE_EVENTS"] = node_events
        env["PROXYSHIFT_NODE_CONCURRENCY"] = str(NODE_CONCURRENCY)
        # --tracemalloc: the same operator under bench/harness/traced_operator.py (snapshots at the apply
        # and at Ready, on SIGUSR1); its RSS and times then include tracemalloc's own cost.
        snaps = state / "tracemalloc"
        entry = ["-m", "bench.harness.traced_operator", str(snaps), "--"] if traced else ["-m", "proxyshift.cli"]
        op = procs.start("operator", [sys.executable, *entry, "operator", "--standalone",
                                      "--kubeconfig", str(op_kubeconfig), "--metrics-port", str(METRICS_PORT),
                                      "--liveness", f"http://127.0.0.1:{LIVENESS_PORT}/healthz"], env=env)
        wait_for("operator liveness", lambda: run([sys.executable, "-c", "import urllib.request,sys; urllib.request."
                                                   f"urlopen('http://127.0.0.1:{LIVENESS_PORT}/healthz', timeout=5)"],
                                                  timeout=10, check=False, env=controlplane.daemon_env()
                                                  ).returncode == 0, 300)
        # The operator has listed everything (its indexes are warm) once it is live; from here on,
        # every write it makes is the rollout's.
        time.sleep(5)
        audit = state / "audit.log"
        offset = audit.stat().st_size if audit.exists() else 0
        custom = kubernetes.client.CustomObjectsApi(api)
        pids = {name: proc.pid for name, proc in procs.procs if name in ("etcd", "kube-apiserver", "operator")}
        window = CpuWindow({**pids, "bench": os.getpid()})
        harness_writes = fleet.writes
        res.rss_start_mb = vm(op.pid, "VmRSS")
        if traced:
            op.send_signal(signal.SIGUSR1)
            wait_for("tracemalloc snapshot", lambda: (snaps / "usr1-1.snap").exists(), 300)
        spy = procs.start("py-spy", pyspy_argv(op.pid, state / "operator.pyspy")) if profile else None
        window.start()
        start = time.monotonic()
        custom.create_cluster_custom_object(GROUP, VERSION, "proxypolicies", policy(n))
        last_report = 0.0
        while True:
            if op.poll() is not None:
                raise RuntimeError(f"operator exited {op.returncode}; see {state / 'logs' / 'operator.log'}")
            # The custom-objects API types its answer `object`: it is the decoded JSON, a dict.
            obj = cast(dict[str, Any], custom.get_cluster_custom_object(GROUP, VERSION, "proxypolicies", "scale"))
            size = len(json.dumps(obj.get("status") or {}, separators=(",", ":")))
            res.status_max = max(res.status_max, size)
            if size > 2 and res.first_status_s != res.first_status_s:
                res.first_status_s = time.monotonic() - start
            res.rss_peak_mb = max(res.rss_peak_mb, vm(op.pid, "VmHWM"))
            elapsed = time.monotonic() - start
            if ready(obj) and (obj.get("status") or {}).get("phase") == "Ready":
                res.converge_s = elapsed
                res.status_end = size
                break
            if elapsed - last_report > 30:
                last_report = elapsed
                st = obj.get("status") or {}
                counts = {k: v for k, v in st.items() if isinstance(v, int)}
                print(f"  {n} nodes: {elapsed:.0f}s phase {st.get('phase')} {counts} rss "
                      f"{vm(op.pid, 'VmRSS'):.0f}MB status {size}B harness errors {len(fleet.errors)}",
                      file=sys.stderr, flush=True)
            if elapsed > timeout:
                res.status_end = size
                print(f"  {n} nodes: not Ready after {timeout:g}s", file=sys.stderr)
                break
            time.sleep(2)
        res.cpu["rollout"] = window.stop()
        if spy is not None:
            stop_child(spy, sig=signal.SIGINT, grace=60)  # py-spy writes its samples on SIGINT
            res.profile = profile_summary(state / "operator.pyspy")
        res.harness_writes = fleet.writes - harness_writes
        res.rss_peak_mb = max(res.rss_peak_mb, vm(op.pid, "VmHWM"))
        res.rss_end_mb = vm(op.pid, "VmRSS")
        if traced:
            op.send_signal(signal.SIGUSR1)
            wait_for("tracemalloc snapshot", lambda: (snaps / "usr1-2.snap").exists(), 300)
            res.tracemalloc = traced_operator.report(snaps / "usr1-2.snap", snaps / "usr1-1.snap")
        time.sleep(3)  # let the audit backend flush the last events
        events = write_floor.read_audit(audit, offset)
        res.writes, res.reads = count_requests(events)
        res.floor_plan = write_floor.plan(events, OPERATOR_USER)
        del events
        with contextlib.suppress(OSError):
            res.actions = operator_metrics()
        (state / "final-status.json").write_text(json.dumps(obj.get("status"), indent=1))
        res.harness_errors = fleet.errors[:20]
        # The floor runs alone: the operator and the harness would react to the replayed writes (old
        # operations on the ProxyNodes) and share the two cores with the API server.
        fleet.stop()
        procs.stop("operator")
        time.sleep(3)
        if floor:
            window.start()
            res.floor, res.floor_writes = write_floor_run(res.floor_plan, state, audit, floor_concurrency)
            res.cpu["floor"] = window.stop()
    finally:
        if fleet is not None:
            fleet.stop()
        procs.stop("operator")
        procs.stop()
    return res


def table(results: list[Result]) -> str:
    rows = ["| nodes | first status s | converge s | write floor s | converge/floor | operator writes/node | "
            "writes by verb | RSS at apply MB | RSS peak MB | RSS end MB | status max B | status end B |",
            "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        total = sum(r.writes.values())
        verbs: collections.Counter[str] = collections.Counter()
        for k, v in r.writes.items():
            verbs[k.split()[0]] += v
        rows.append(f"| {r.nodes} | {r.first_status_s:.0f} | {r.converge_s:.0f} | {r.floor_s:.1f} | "
                    f"{r.converge_s / r.floor_s:.2f} | {total / r.nodes:.2f} | "
                    f"{', '.join(f'{k} {v}' for k, v in verbs.most_common())} | {r.rss_start_mb:.0f} | "
                    f"{r.rss_peak_mb:.0f} | "
                    f"{r.rss_end_mb:.0f} | {r.status_max} | {r.status_end} |")
    detail = []
    for r in results:
        if r.floor is not None and r.floor_plan is not None:
            f, p = r.floor, r.floor_plan
            same = "same as the operator's" if r.floor_writes == r.writes else \
                f"differs from the operator's: {dict(r.floor_writes - r.writes)} more, " \
                f"{dict(r.writes - r.floor_writes)} fewer"
            detail.append(f"\n{r.nodes} nodes, write floor: {f.sent} writes in {f.seconds:.1f}s, {f.concurrency} at a "
                          f"time ({f.sent / f.seconds if f.seconds else 0:.0f}/s); answers "
                          f"{dict(sorted(f.codes.items()))}, retries {f.retries}, "
                          f"no-op writes {f.noops} (of which planned {f.repeats}); request "
                          f"bytes {p.body_bytes()} (operator's {p.original_body_bytes}); audited writes by "
                          f"resource {same}" + (f"; left out: {dict(p.skipped)}" if p.skipped else "")
                          + (f"; errors (first): {f.errors[:3]}" if f.errors else ""))
        detail.append(f"\n{r.nodes} nodes, operator writes by resource: "
                      + ", ".join(f"{k} {v}" for k, v in r.writes.most_common()))
        detail.append(f"{r.nodes} nodes, operator reads: " + ", ".join(f"{k} {v}" for k, v in r.reads.most_common()))
        detail.append(f"{r.nodes} nodes, proxyshift_actions_total: "
                      + ", ".join(f"{k} {v:g}" for k, v in sorted(r.actions.items(), key=lambda kv: -kv[1])))
        for phase, secs in r.cpu.items():
            wall = r.converge_s if phase == "rollout" else r.floor_s
            detail.append(f"{r.nodes} nodes, CPU s in the {phase} ({wall:.1f}s wall): "
                          + ", ".join(f"{k} {v:.1f}" for k, v in secs.items())
                          + (f"; harness writes {r.harness_writes}" if phase == "rollout" else ""))
        if r.harness_errors:
            detail.append(f"{r.nodes} nodes, harness errors (first): {r.harness_errors[:5]}")
        if r.profile:
            detail.append(f"{r.nodes} nodes, where the operator's CPU went in the rollout (py-spy):\n{r.profile}")
        if r.tracemalloc:
            detail.append(f"{r.nodes} nodes, the operator under tracemalloc at Ready:\n{r.tracemalloc}")
    return "\n".join(rows + detail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="1000", help="comma-separated fleet sizes, e.g. 1000,5000")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait for Ready per size")
    p.add_argument("--keep", action="store_true", help="keep the state folder (logs, audit log)")
    p.add_argument("--floor-concurrency", type=int, default=NODE_CONCURRENCY,
                   help="writes the write floor sends at once (default: the operator's node concurrency)")
    p.add_argument("--profile", action="store_true",
                   help="sample the operator with py-spy through the rollout and print where its CPU went")
    p.add_argument("--no-floor", action="store_true", help="skip the write floor (a run for the operator alone)")
    p.add_argument("--tracemalloc", action="store_true",
                   help="run the operator under tracemalloc and print where its memory is at Ready (slows it)")
    p.add_argument("--node-events", default="auto", choices=("auto", "steps", "outcomes"),
                   help="the operator's PROXYSHIFT_NODE_EVENTS (which Normal Events nodes get; auto: the default)")
    p.add_argument("--nice", type=int, default=19,
                   help="niceness of the bench and everything it starts (default 19: never outrank other work; "
                        "0 on a machine whose other work runs at 19, to measure this bench ahead of it)")
    args = p.parse_args(argv)
    os.nice(max(0, args.nice - os.nice(0)))  # children inherit it
    bin_dir = build()
    results = []
    for n in [int(x) for x in args.nodes.split(",")]:
        state = Path(f"/tmp/ps-bench-scale-{os.getpid()}-{n}")
        state.mkdir(parents=True, exist_ok=False)
        try:
            results.append(bench(n, state, bin_dir, args.timeout, args.node_events, args.floor_concurrency,
                                 args.tracemalloc, not args.no_floor, args.profile))
        finally:
            if not args.keep:
                shutil.rmtree(state, ignore_errors=True)
        print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
