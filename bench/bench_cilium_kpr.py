"""Cilium's kube-proxy replacement against kube-proxy: agent memory per node and switch time, side by side.

    sudo flock /var/lock/proxyshift-localcluster.lock python -m bench.bench_cilium_kpr --runs 3

On the local cluster with Cilium installed (`localcluster up --with-cilium`: the pinned agent, built
with localcluster.gotools when the cache lacks it, runs confined per node as kube-system/cilium on the
nodes the operator labels for it) and one pool of N nodes (default `blue=2`; the cluster is machine-wide,
hence the lock). proxyshift is installed and its operator runs as a host process. Each run moves the
pool from the baseline (iptables) two ways, alternating which goes first, and back:

  cilium-kpr  a ProxyPolicy `mode: cilium-kpr` over the pool (maxUnavailable 1, no cordon/drain, the
              behaviour matrix on, allowing SocketLoadBalancing): kube-proxy leaves each node, Cilium's
              agent starts there with its kube-proxy replacement, the gate asks Cilium's own API.
  nftables    the same policy with `mode: nftables` (allowing LocalhostNodePorts and NodePortAddresses,
              gate.minSyncs 1): kube-proxy's own switch, to a new kube-proxy in another mode.
  revert      deleting the policy (deletionPolicy Revert): every node back to the baseline kube-proxy
              (from cilium-kpr: Cilium's pod leaves, its leftovers are flushed).

A warm-up cilium-kpr move and revert runs first and is not counted: the first policy adds the
`proxyshift.io/revision DoesNotExist` affinity to the baseline DaemonSet (a rollout of every baseline
pod), and each node's first Cilium agent compiles its datapath from scratch; its times are printed
apart, as the cold start.

Measured, every time on the benchmark's own clock when its watches (Nodes, kube-system pods,
ProxyNodes, ProxyPolicies) saw the change:

  pool move   from the policy's create (delete) to its Ready (its being gone).
  per node    switch -> gate passed: from the node's `proxyshift.io/revision` label changing to the
              first ProxyNode phase after Gate (the gate's verdict); beside it the new data-plane pod
              (cilium or kube-proxy) Running and Ready, from the switch.
  memory      after each move has settled (--settle seconds after Ready, then --samples samples 1 s
              apart, median per node): the resident memory (VmRSS, and its anonymous and file-backed
              parts, /proc/PID/status) of the process whose name (/proc/PID/comm) is `cilium-agent`,
              resp. `kube-proxy`, in the node's cgroup (localcluster.cilium.node_cgroup: every process of
              the node runs there), plus any process below it (counted and shown; none once settled). Not
              counted: the node's proxyshift agent, pods, the simulator. kube-proxy is sampled on the
              baseline (iptables) before each run and after the move to nftables. Beside it, the BPF
              maps those processes hold descriptors of, each once, with their `memlock`
              (/proc/PID/fdinfo): kernel memory VmRSS leaves out (kube-proxy's rules are kernel memory
              too, and not measured).

Nothing is asserted about the numbers: the tables are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
# The node simulators and the operator are child processes (`python -m proxyshift...`): they must find
# this checkout's package even where it is not pip-installed.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "operator"), os.environ.get("PYTHONPATH")]))

import kubernetes  # noqa: E402

from bench.harness.cluster_watch import (  # noqa: E402
    Changes,
    median,
    record_pod,
    say,
    stream,
    watch_policies,
)
from localcluster import cilium, controlplane, install, paths  # noqa: E402
from localcluster import cli as cluster_cli  # noqa: E402

GROUP, VERSION = "proxyshift.io", "v1alpha1"
POLICY = "bench-kpr"
POOL = "blue"
NAMESPACE = "kube-system"
REVISION_LABEL = "proxyshift.io/revision"
METRICS_PORT, HEALTH_PORT = 18182, 18183
KPR, NFT = "cilium-kpr", "nftables"
TARGETS = (KPR, NFT)
# the data-plane pod and process of each target (the baseline and nftables run kube-proxy)
APP = {KPR: "cilium", NFT: "kube-proxy", "iptables": "kube-proxy"}
PROCESS = {KPR: "cilium-agent", NFT: "kube-proxy", "iptables": "kube-proxy"}
AFTER_GATE = ("Cleanup", "Verify", "Uncordon", "Done")
MIB = 1024 * 1024


# ---- what the watches saw ----


@dataclass
class Seen(Changes):
    """Every change the benchmark's watches delivered, stamped with its own monotonic clock."""

    # node -> [(at, revision label value or None)], one entry per change seen
    labels: dict[str, list[tuple[float, str | None]]] = field(default_factory=dict)
    # pod name -> {app, node, first, running, ready, deleting, gone}
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (at, node, phase), one entry per phase change seen
    phases: list[tuple[float, str, str]] = field(default_factory=list)


def watch_nodes(core: kubernetes.client.CoreV1Api, seen: Seen) -> None:
    for _, node in stream(core.list_node, label_selector=f"pool={POOL}"):
        now = time.monotonic()
        meta = node.get("metadata") or {}
        value = (meta.get("labels") or {}).get(REVISION_LABEL)
        with seen.lock:
            history = seen.labels.setdefault(meta.get("name", ""), [])
            if not history or history[-1][1] != value:
                history.append((now, value))
        seen.note()


def watch_pods(core: kubernetes.client.CoreV1Api, seen: Seen) -> None:
    for kind, pod in stream(core.list_namespaced_pod, NAMESPACE, label_selector="k8s-app in (kube-proxy,cilium)"):
        with seen.lock:
            rec = record_pod(seen.pods, kind, pod, time.monotonic())
            rec.setdefault("app", ((pod.get("metadata") or {}).get("labels") or {}).get("k8s-app"))
        seen.note()


def watch_proxynodes(custom: kubernetes.client.CustomObjectsApi, seen: Seen) -> None:
    last: dict[str, str] = {}
    for _, pn in stream(custom.list_cluster_custom_object, GROUP, VERSION, "proxynodes"):
        phase = ((pn.get("spec") or {}).get("migration") or {}).get("phase")
        name = (pn.get("metadata") or {}).get("name", "")
        if not phase or last.get(name) == phase:
            continue
        last[name] = phase
        with seen.lock:
            seen.phases.append((time.monotonic(), name, phase))
        seen.note()


# ---- resident memory of a node's data-plane process ----


@dataclass
class Memory:
    rss: int  # bytes, VmRSS of the process and everything below it
    anon: int  # RssAnon
    file: int  # RssFile (+ RssShmem)
    processes: int  # how many processes were counted (the named one and its descendants)
    bpf_maps: int = 0  # BPF maps those processes hold open, each once
    bpf_memlock: int = 0  # bytes: their `memlock` (kernel memory, not in VmRSS)


def _status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status that make up VmRSS, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _bpf_maps(pid: int) -> dict[int, int]:
    """map id -> memlock bytes of every BPF map the process holds a descriptor of (/proc/PID/fdinfo)."""
    maps: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(fd) != "anon_inode:bpf-map":
                    continue
                info = dict(line.split(":", 1) for line in (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text()
                            .splitlines() if ":" in line)
                maps[int(info["map_id"])] = int(info["memlock"])
    return maps


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # the fields after the command's closing parenthesis: state, ppid, ...
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_memory(node: str, comm: str) -> Memory | None:
    """The resident memory of the node's process named `comm` (in the node's cgroup) and its descendants."""
    try:
        pids = [int(p) for p in (cilium.node_cgroup(node) / "cgroup.procs").read_text().split()]
    except (OSError, cilium.CiliumError):
        return None
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() != comm:
                continue
            tree, todo, counted = _children(), [pid], []
            while todo:
                current = todo.pop()
                counted.append(current)
                todo.extend(tree.get(current, []))
            total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0}
            maps: dict[int, int] = {}
            for one in counted:
                with contextlib.suppress(OSError):
                    for key, value in _status(one).items():
                        total[key] += value
                maps.update(_bpf_maps(one))
            return Memory(total["VmRSS"], total["RssAnon"], total["RssFile"] + total["RssShmem"], len(counted),
                          len(maps), sum(maps.values()))
    return None


# ---- one measured move ----


def _after(pods: list[dict[str, Any]], node: str, switch: float | None, key: str) -> float:
    """Seconds from the switch to the first pod of the node that reached `key` (running, ready) after it."""
    if switch is None:
        return float("nan")
    return min((r[key] - switch for r in pods if r.get("node") == node and key in r and r[key] >= switch),
               default=float("nan"))


@dataclass
class NodeMove:
    node: str
    switch_to_gate: float  # revision label changed -> first phase after Gate seen
    pod_running: float  # switch -> the new data-plane pod Running (nan for none)
    pod_ready: float  # switch -> the new data-plane pod Ready
    total: float  # first phase seen -> Done seen


@dataclass
class Move:
    kind: str  # cilium-kpr | nftables | revert-from-cilium-kpr | revert-from-nftables
    run: int  # 0: the warm-up
    seconds: float
    nodes: list[NodeMove]


@dataclass
class Sample:
    what: str  # cilium-agent (cilium-kpr) | kube-proxy (nftables) | kube-proxy (iptables)
    run: int
    node: str
    memory: Memory


NAN = float("nan")


class Bench:
    def __init__(self, kubeconfig: Path, bin_dir: Path, nodes: list[str], timeout: float, settle: float,
                 samples: int) -> None:
        self.kubeconfig, self.bin_dir, self.nodes, self.timeout = kubeconfig, bin_dir, nodes, timeout
        self.settle, self.samples = settle, samples
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.seen = Seen()
        self.memory: list[Sample] = []
        watch_api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        for target, client in ((watch_nodes, kubernetes.client.CoreV1Api(watch_api)),
                               (watch_pods, kubernetes.client.CoreV1Api(watch_api)),
                               (watch_proxynodes, kubernetes.client.CustomObjectsApi(watch_api)),
                               (watch_policies, kubernetes.client.CustomObjectsApi(watch_api))):
            threading.Thread(target=target, args=(client, self.seen), daemon=True, name=target.__name__).start()

    def policy_body(self, mode: str) -> dict[str, Any]:
        allow = ["SocketLoadBalancing"] if mode == KPR else ["LocalhostNodePorts", "NodePortAddresses"]
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyPolicy", "metadata": {"name": POLICY},
                "spec": {"nodeSelector": {"matchLabels": {"pool": POOL}}, "mode": mode,
                         "rollout": {"maxUnavailable": 1, "cordon": False, "drain": False},
                         "gate": {"timeout": "3m", "minSyncs": 1,
                                  "behaviour": {"enabled": True, "allowChanges": allow}}}}

    def _pods(self, app: str) -> dict[str, list[kubernetes.client.V1Pod]]:
        """node -> the pods of `app` there (terminating ones too), as the API lists them now."""
        by_node: dict[str, list[kubernetes.client.V1Pod]] = {}
        for pod in self.core.list_namespaced_pod(NAMESPACE, label_selector=f"k8s-app={app}").items:
            by_node.setdefault((pod.spec.node_name if pod.spec else None) or "", []).append(pod)
        return by_node

    @staticmethod
    def _ready(pod: kubernetes.client.V1Pod) -> bool:
        return (pod.metadata is not None and not pod.metadata.deletion_timestamp and pod.status is not None
                and pod.status.phase == "Running"
                and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []))

    def wait_settled(self, mode: str) -> None:
        """Every node of the pool runs exactly one Ready pod of the mode's data plane and no pod of the other
        (none terminating either). Polled through the API, not the watches: a watch renewed between a delete
        and its event would leave a gone pod in the watch's record."""
        other = "cilium" if APP[mode] == "kube-proxy" else "kube-proxy"
        deadline = time.monotonic() + self.timeout
        while True:
            mine, theirs = self._pods(APP[mode]), self._pods(other)
            if all(not theirs.get(n) and len(mine.get(n, [])) == 1 and self._ready(mine[n][0]) for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pool did not settle on {mode} within {self.timeout:g}s")
            time.sleep(0.5)

    def sample_memory(self, mode: str, run: int) -> None:
        """--samples samples 1 s apart after --settle seconds; one Sample per node, its median."""
        time.sleep(self.settle)
        taken: dict[str, list[Memory]] = {n: [] for n in self.nodes}
        for i in range(self.samples):
            if i:
                time.sleep(1.0)
            for node in self.nodes:
                memory = process_memory(node, PROCESS[mode])
                if memory is not None:
                    taken[node].append(memory)
        for node, memories in taken.items():
            if not memories:
                say(f"run {run}: no {PROCESS[mode]} process found in {node}'s cgroup")
                continue
            mid = sorted(memories, key=lambda m: m.rss)[len(memories) // 2]
            self.memory.append(Sample(f"{PROCESS[mode]} ({mode})", run, node, mid))

    def _node_moves(self, t0: float, end: float, app: str) -> list[NodeMove]:
        with self.seen.lock:
            phases = [(at, node, phase) for at, node, phase in self.seen.phases if at >= t0]
            labels = {n: list(h) for n, h in self.seen.labels.items()}
            pods = [dict(r) for r in self.seen.pods.values() if r.get("app") == app]
        rows = []
        for node in self.nodes:
            history = labels.get(node, [])
            before = [v for at, v in history if at < t0]
            was = before[-1] if before else None
            switch = next((at for at, value in history if at >= t0 and value != was), None)
            mine = [(at, phase) for at, node_, phase in phases if node_ == node]
            gate = next((at for at, phase in mine if phase == "Gate"), None)
            passed = next((at for at, phase in mine if gate is not None and at > gate and phase in AFTER_GATE), None)
            done = next((at for at, phase in mine if phase == "Done"), end)
            start = mine[0][0] if mine else t0

            to_gate = passed - switch if passed is not None and switch is not None else NAN
            rows.append(NodeMove(node, to_gate, _after(pods, node, switch, "running"),
                                 _after(pods, node, switch, "ready"), done - start))
        return rows

    def move(self, mode: str, run: int) -> Move:
        """The pool from the baseline to `mode`: the policy's create -> its Ready."""
        self.wait_settled("iptables")
        t0 = time.monotonic()
        created = cast(dict[str, Any], self.custom.create_cluster_custom_object(
            GROUP, VERSION, "proxypolicies", self.policy_body(mode)))
        key = f"{POLICY}/{created['metadata']['uid']}"
        end = self.seen.wait(lambda: self.seen.policy_ready.get(key), self.timeout, f"the {mode} policy's Ready")
        return Move(mode, run, end - t0, self._node_moves(t0, end, APP[mode]))

    def revert(self, mode: str, run: int) -> Move:
        """Delete the policy: the pool back to the baseline kube-proxy, until the policy is gone."""
        t0 = time.monotonic()
        with self.seen.lock:
            self.seen.policy_gone.pop(POLICY, None)
        self.custom.delete_cluster_custom_object(GROUP, VERSION, "proxypolicies", POLICY)
        end = self.seen.wait(lambda: self.seen.policy_gone.get(POLICY), self.timeout, "the policy gone")
        left = [n for n in self.nodes if REVISION_LABEL in self._labels(n)]
        if left:
            raise RuntimeError(f"policy gone but {left} still carry a revision label")
        return Move(f"revert-from-{mode}", run, end - t0, self._node_moves(t0, end, "kube-proxy"))

    def _labels(self, node: str) -> dict[str, str]:
        metadata = self.core.read_node(node).metadata
        return dict((metadata.labels if metadata else None) or {})

    def one(self, mode: str, run: int, moves: list[Move]) -> None:
        """Move the pool to `mode`, sample its memory there, move it back."""
        result = self.move(mode, run)
        say(f"run {run}: to {mode} {result.seconds:.1f}s")
        moves.append(result)
        self.wait_settled(mode)
        if run:
            self.sample_memory(mode, run)
        result = self.revert(mode, run)
        say(f"run {run}: revert from {mode} {result.seconds:.1f}s")
        moves.append(result)


# ---- cluster and report ----


def ensure_cluster(state_dir: Path, nodes: int) -> controlplane.ClusterInfo:
    if controlplane.load_info(state_dir) is not None:
        # Run under the machine-wide lock, so nobody uses it: a cluster left by a killed session. This
        # benchmark needs its own shape (one pool of N nodes) and Cilium.
        say(f"removing the cluster left in {state_dir}")
        controlplane.down(state_dir)
    say(f"starting the local cluster with Cilium: pool {POOL}={nodes} (builds {cilium.AGENT_TOOL} if missing)")
    report = cluster_cli.up(state_dir, {POOL: nodes}, with_cilium=True)
    say(f"cluster up in {report['seconds']}s")
    info = controlplane.load_info(state_dir)
    assert info is not None
    return info


def _mib(values: list[float]) -> str:
    return f"{median(values) / MIB:.1f}" if values else "-"


def _span(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    values = [v for v in values if v == v]  # not NaN
    return f"{min(values) / scale:.{digits}f}-{max(values) / scale:.{digits}f}" if values else "-"


def _sec(values: list[float]) -> str:
    values = [v for v in values if v == v]
    return f"{median(values):.2f}" if values else "-"


def print_report(moves: list[Move], memory: list[Sample], nodes: int, services: int) -> None:
    print(f"\n## Cilium's kube-proxy replacement vs kube-proxy, pool of {nodes} nodes, {services} Services\n")
    print("resident memory per node (MiB; median over nodes and runs of each node's median sample;\n"
          "VmRSS of the named process in the node's cgroup and anything below it; BPF maps: those it holds\n"
          "open, /proc/PID/fdinfo memlock, kernel memory that VmRSS does not include):\n")
    print("| process (mode) | samples | VmRSS MiB | range | anonymous MiB | file-backed MiB | processes counted "
          "| BPF maps held | their memlock MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = [f"{PROCESS[m]} ({m})" for m in (KPR, NFT, "iptables")]
    rss_of: dict[str, float] = {}
    for what in order:
        rows = [s for s in memory if s.what == what]
        if not rows:
            continue
        rss_of[what] = median([float(s.memory.rss) for s in rows])
        processes = sorted({s.memory.processes for s in rows})
        print(f"| {what} | {len(rows)} | {_mib([float(s.memory.rss) for s in rows])} | "
              f"{_span([float(s.memory.rss) for s in rows], MIB)} | {_mib([float(s.memory.anon) for s in rows])} | "
              f"{_mib([float(s.memory.file) for s in rows])} | {','.join(map(str, processes))} | "
              f"{median([float(s.memory.bpf_maps) for s in rows]):.0f} | "
              f"{_mib([float(s.memory.bpf_memlock) for s in rows])} |")
    kpr, nft = rss_of.get(order[0]), rss_of.get(order[1])
    if kpr and nft:
        print(f"\ncilium-agent / kube-proxy (nftables): {kpr / nft:.2f}x, +{(kpr - nft) / MIB:.0f} MiB per node")

    counted = [m for m in moves if m.run > 0]
    print("\npool move (seconds, policy create -> Ready; revert: delete -> gone):\n")
    kinds = [KPR, NFT, f"revert-from-{KPR}", f"revert-from-{NFT}"]
    print("| run | " + " | ".join(kinds) + f" | {KPR}/{NFT} |")
    print("|---:|" + "---:|" * (len(kinds) + 1))
    by = {(m.kind, m.run): m for m in counted}
    for run in sorted({m.run for m in counted}):
        secs = [by[(k, run)].seconds if (k, run) in by else NAN for k in kinds]
        cells = ["-" if s != s else f"{s:.1f}" for s in secs]
        ratio = f"{secs[0] / secs[1]:.2f}x" if secs[0] == secs[0] and secs[1] == secs[1] and secs[1] > 0 else "-"
        print(f"| {run} | {' | '.join(cells)} | {ratio} |")
    med = [median([m.seconds for m in counted if m.kind == k]) for k in kinds]
    ratio = f"{med[0] / med[1]:.2f}x" if med[1] == med[1] and med[1] > 0 else "-"
    print(f"| median | {' | '.join('-' if s != s else f'{s:.1f}' for s in med)} | {ratio} |")

    print("\nper node (seconds from the switch, the revision label changing; median over nodes and runs):\n")
    print("| move | nodes | switch -> gate passed | range | new pod Running | new pod Ready | node total |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        per = [n for m in counted if m.kind == kind for n in m.nodes]
        if per:
            print(f"| {kind} | {len(per)} | {_sec([n.switch_to_gate for n in per])} | "
                  f"{_span([n.switch_to_gate for n in per], digits=2)} | {_sec([n.pod_running for n in per])} | "
                  f"{_sec([n.pod_ready for n in per])} | {_sec([n.total for n in per])} |")
    gate = {k: median([n.switch_to_gate for m in counted if m.kind == k for n in m.nodes
                       if n.switch_to_gate == n.switch_to_gate]) for k in (KPR, NFT)}
    if gate[NFT] == gate[NFT] and gate[NFT] > 0 and gate[KPR] == gate[KPR]:
        print(f"\nswitch -> gate passed, {KPR}/{NFT}: {gate[KPR] / gate[NFT]:.2f}x")

    warm = [m for m in moves if m.run == 0]
    for m in warm:
        splits = ", ".join(f"{n.node} {n.switch_to_gate:.2f}" for n in m.nodes)
        print(f"warm-up, not counted (the first policy; each node's first Cilium start): {m.kind} "
              f"{m.seconds:.1f} s, switch -> gate passed {splits} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="per move")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after a move before sampling memory")
    parser.add_argument("--samples", type=int, default=5, help="memory samples per node, 1 s apart")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    parser.add_argument("--no-warmup", action="store_true")
    args = parser.parse_args()

    state_dir = paths.default_state_dir()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    info = ensure_cluster(state_dir, args.nodes)
    operator: install.OperatorProcess | None = None
    moves: list[Move] = []
    bench: Bench | None = None
    services = 0
    try:
        say("installing proxyshift (CRDs, RBAC, admission, agents)")
        install.install(info.bin_dir, info.kubeconfig)
        operator = install.OperatorProcess(info.kubeconfig, state_dir / "logs" / "operator-bench-kpr.log",
                                           metrics_port=METRICS_PORT, health_port=HEALTH_PORT).start()
        operator.wait_healthy()
        nodes = [f"ps-node-{i}" for i in range(1, args.nodes + 1)]
        bench = Bench(info.kubeconfig, info.bin_dir, nodes, args.timeout, args.settle, args.samples)
        services = len(bench.core.list_service_for_all_namespaces().items)
        if not args.no_warmup:
            say("warm-up: cilium-kpr + revert (the baseline affinity, each node's first Cilium; not counted)")
            bench.one(KPR, 0, moves)
        for run in range(1, args.runs + 1):
            bench.wait_settled("iptables")
            bench.sample_memory("iptables", run)
            for mode in (TARGETS if run % 2 else tuple(reversed(TARGETS))):
                bench.one(mode, run, moves)
    finally:
        if operator is not None:
            operator.stop()
        if moves:
            print_report(moves, bench.memory if bench else [], args.nodes, services)
        say(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if not args.keep:
            say("taking the local cluster down")
            controlplane.down(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
