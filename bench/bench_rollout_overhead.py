"""Rollout overhead: a proxyshift migration against `kubectl rollout restart` of kube-proxy, side by side.

    sudo flock /var/lock/proxyshift-localcluster.lock nice -n 10 python -m bench.bench_rollout_overhead --runs 3
        [--matrix-cost] [--ahead-cost] [--timeline]

On the local cluster with one pool of N nodes (default `blue=4`; the cluster is
machine-wide, hence the lock). proxyshift is installed and its operator runs as a
host process. Each run measures, in alternating order:

  restart   `kubectl -n kube-system rollout restart daemonset/kube-proxy` (the baseline,
            RollingUpdate maxUnavailable 1): from the command to the moment the last new
            pod is Running and Ready. No preflight, gate or cleanup.
  restart-ready
            the same restart, timed the same way, with the baseline's kube-proxy container given
            a readinessProbe httpGet /healthz on kube-proxy's healthz port (the baseline config's
            healthzBindAddress, empty: kube-proxy's default 0.0.0.0:10256), periodSeconds 1 (the
            smallest Kubernetes allows: the most favourable to the restart), initialDelaySeconds 0,
            run by the node simulator inside the node. So the DaemonSet controller waits for each
            new kube-proxy to serve /healthz before it moves on. Caveat: kube-proxy's /healthz
            answers 200 while it is starting up (v1.37 pkg/proxy/healthcheck/proxy_health.go), so
            this waits for the process to be up and serving healthz, NOT for its first rule sync.
            The node simulator runs a due probe on time and records its result when it arrives, as a
            kubelet does (before 2026-11-30 19:10 UTC it waited for its next 0.5 s pass, which made
            restart-ready ~0.5 s per node slower than a kubelet's).
            Adding the probe before and removing it after are rollouts of their own (not timed):
            migrate and revert always run against the unchanged baseline.
  migrate   a ProxyPolicy to nftables over the pool (maxUnavailable 1, no cordon/drain,
            gate.minSyncs 1, stale-rule cleanup on): from the create to the policy's Ready.
  revert    deleting that policy (deletionPolicy Revert walks every node back to the
            baseline iptables kube-proxy): from the delete to the policy being gone.

A warm-up migrate+revert runs first and is not counted: the first policy adds the
`proxyshift.io/revision DoesNotExist` affinity to the baseline DaemonSet, which
restarts every baseline pod once (docs/architecture.md).

Every time is the benchmark's own clock at the moment its watches (pods, ProxyNodes,
ProxyPolicies) saw the change, so both sides are measured the same way. Per node, a
proxyshift migration is split into
  kube-proxy  kube-proxy's own restart: from the first sign of it on the node (the old kube-proxy
              pod seen deleting or the new one seen created, whichever came first, after phase
              Switch) to the new kube-proxy's first rule sync (its
              kubeproxy_sync_proxy_rules_last_timestamp_seconds, as the agent reported it): the
              DaemonSet controller, kube-proxy's start-up (including its cleanup of the other modes'
              rules) and first sync. Before 2026-12-05 this span started at phase Switch, so the
              rule hold and the label move (proxyshift's own work) counted as kube-proxy's.
  gate        from the later of phase Gate seen and that first sync to the gate's verdict
  own         the rest of the node's time (preflight, the rule hold, moving the label, the operator
              noticing, stale-rule cleanup + verify), and, per rollout, the time outside any node
The restart's kube-proxy time is old pod deleted -> new pod Running+Ready: the baseline
DaemonSet (like kubeadm's) has no readiness probe, so the restart never waits for a sync;
restart-ready's is the same span, up to the probe's first success. "pod Running" / "pod Ready"
show the same moments for proxyshift's nodes (from the switch).

sync floor: the sum over nodes of migrate's per-node kube-proxy time (restart -> first sync): what
any rollout that waits, node after node (maxUnavailable 1), for each node's kube-proxy to have
synced needs at the least. The report gives migrate's ratio to restart, restart-ready and the floor,
with the 1.5x target's verdict against each.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable
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
from localcluster import (  # noqa: E402
    baseline,
    behaviour_workloads,
    controlplane,
    install,
    paths,
)
from localcluster import cli as cluster_cli  # noqa: E402
from localcluster.kubeapi import Kube  # noqa: E402

GROUP, VERSION = "proxyshift.io", "v1alpha1"
POLICY = "bench-overhead"
POOL = "blue"
NAMESPACE = "kube-system"
BASELINE_DS = "kube-proxy"
REVISION_LABEL = "proxyshift.io/revision"
METRICS_PORT, HEALTH_PORT = 18180, 18181
TARGET_RATIO = 1.5
KINDS = ("restart", "restart-ready", "migrate", "revert")
NO_MATRIX = "migrate-no-matrix"  # the same migration with gate.behaviour.enabled false (--matrix-cost)
NO_AHEAD = "migrate-no-ahead"  # the same migration with rollout.preflightAhead false (--ahead-cost)
MATRIX_TARGET_RATIO = 1.35  # issue 13: the rollout with the behaviour matrix on, against the sync floor
JSON_PATCH, STRATEGIC_MERGE_PATCH = "application/json-patch+json", "application/strategic-merge-patch+json"

# Unix time - monotonic time, to place the agent's (Unix) kube-proxy timestamps on the bench's clock.
WALL_OFFSET = time.time() - time.monotonic()


def kube_proxy_healthz_port() -> int:
    """The healthz port of the baseline's kube-proxy: its config's healthzBindAddress, or kube-proxy's
    default (ports.ProxyHealthzPort) where that is empty or names no port, as kube-proxy's defaulting does."""
    address = str(baseline.kube_proxy_configuration().get("healthzBindAddress") or "")
    _, sep, port = address.rpartition(":")
    return int(port) if sep and port.isdigit() else 10256


def readiness_probe() -> dict[str, Any]:
    """restart-ready's probe: the most favourable to the restart that Kubernetes allows."""
    return {"httpGet": {"path": "/healthz", "port": kube_proxy_healthz_port()},
            "periodSeconds": 1, "initialDelaySeconds": 0}


def _labels(metadata: kubernetes.client.V1ObjectMeta | None) -> dict[str, str]:
    """An object's labels; none when the API left out its metadata or labels."""
    return (metadata.labels if metadata else None) or {}


# ---- what the watches saw ----


@dataclass
class Seen(Changes):
    """Every change the benchmark's watches delivered, stamped with its own monotonic clock."""

    # pod name -> node, first time seen deleting, first time seen Running+Ready, creation (ours)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (node, phase, startedAt) -> first time the ProxyNode was seen in that phase
    phases: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # node -> {(kube-proxy process start, its last sync)} as the agent reported them (Unix time)
    syncs: dict[str, set[tuple[float, float]]] = field(default_factory=dict)
    # every distinct ProxyNode state seen: (at, node, phase, requested op, agent's last op + state, message)
    log: list[tuple[float, str, str, str, str, str]] = field(default_factory=list)


def watch_pods(core: kubernetes.client.CoreV1Api, seen: Seen) -> None:
    for kind, pod in stream(core.list_namespaced_pod, NAMESPACE, label_selector="k8s-app=kube-proxy"):
        with seen.lock:
            record_pod(seen.pods, kind, pod, time.monotonic())
        seen.note()


def watch_proxynodes(custom: kubernetes.client.CustomObjectsApi, seen: Seen) -> None:
    for _, pn in stream(custom.list_cluster_custom_object, GROUP, VERSION, "proxynodes"):
        m = (pn.get("spec") or {}).get("migration") or {}
        if not m.get("phase"):
            continue
        key = (pn["metadata"]["name"], m["phase"], m.get("startedAt") or "")
        op = ((pn.get("spec") or {}).get("operation") or {}).get("id", "")
        status = pn.get("status") or {}
        last = status.get("lastOperation") or {}
        facts = status.get("kubeProxy") or {}
        state = (f"{last.get('id', '')} {last.get('state', '')} syncs={facts.get('syncCount')} "
                 f"healthz={facts.get('healthzStatus')}")
        entry = (time.monotonic(), key[0], m["phase"], op.rsplit(".", 2)[-2] + "." + op.rsplit(".", 1)[-1]
                 if op.count(".") >= 2 else op, state, (m.get("message") or "")[:100])
        with seen.lock:
            if facts.get("processStartTime") and facts.get("lastSyncTimestamp"):
                seen.syncs.setdefault(key[0], set()).add((float(facts["processStartTime"]),
                                                          float(facts["lastSyncTimestamp"])))
            seen.phases.setdefault(key, entry[0])
            if not seen.log or seen.log[-1][1:] != entry[1:]:
                seen.log.append(entry)
        seen.note()


# ---- one measured rollout ----


PHASES = ("Preflight", "Prepared", "Switch", "Gate", "Cleanup", "Verify")


@dataclass
class NodeSplit:
    node: str
    total: float  # first phase seen -> Done seen (restart: old pod deleted -> new pod Ready)
    kube_proxy: float  # Switch seen -> the new pod Running+Ready (restart: the whole node)
    gate: float  # Gate seen -> the gate's verdict seen
    own: float  # total - kube_proxy - gate
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds until the next phase
    # The node's moments on the rollout's critical path (the bench's clock; None: not seen): phase Switch seen,
    # kube-proxy's restart (the label move showing on the node), its first sync, the agent's gate report seen.
    switch_at: float | None = None
    restart_at: float | None = None
    sync_at: float | None = None
    report_at: float | None = None


@dataclass
class Result:
    kind: str  # restart | restart-ready | migrate | revert
    run: int
    seconds: float
    nodes: list[NodeSplit]
    started: float = math.nan  # the bench's clock at the apply/delete (migrate, revert)

    @property
    def kube_proxy(self) -> float:
        return sum(n.kube_proxy for n in self.nodes)

    @property
    def gate(self) -> float:
        return sum(n.gate for n in self.nodes)

    @property
    def own(self) -> float:
        return self.seconds - self.kube_proxy - self.gate

    @property
    def between(self) -> float:
        """Time in no node's migration: before the first, between two, after the last."""
        return self.seconds - sum(n.total for n in self.nodes)


class Bench:
    def __init__(self, kubeconfig: Path, bin_dir: Path, nodes: list[str], timeout: float) -> None:
        self.kubeconfig, self.bin_dir, self.nodes, self.timeout = kubeconfig, bin_dir, nodes, timeout
        self.show_timeline = False
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(api)
        self.apps = kubernetes.client.AppsV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.seen = Seen()
        watch_api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        for target, client in ((watch_pods, kubernetes.client.CoreV1Api(watch_api)),
                               (watch_proxynodes, kubernetes.client.CustomObjectsApi(watch_api)),
                               (watch_policies, kubernetes.client.CustomObjectsApi(watch_api))):
            threading.Thread(target=target, args=(client, self.seen), daemon=True, name=target.__name__).start()

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return install.kubectl(self.bin_dir, self.kubeconfig, *args, timeout=timeout)

    # ---- the plain rollout ----

    def _settled(self) -> bool:
        """One Running+Ready kube-proxy pod per node and nothing terminating."""
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector="k8s-app=kube-proxy").items
        live = [p for p in pods if p.metadata is not None and not p.metadata.deletion_timestamp]
        # A pod not yet scheduled has no node name: "" (sorting None among names would raise TypeError).
        return (len(pods) == len(live) == len(self.nodes)
                and all(p.status is not None and p.status.phase == "Running" for p in live)
                and sorted((p.spec.node_name if p.spec else None) or "" for p in live) == sorted(self.nodes))

    def wait_settled(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._settled():
            if time.monotonic() > deadline:
                raise TimeoutError("kube-proxy pods did not settle")
            time.sleep(0.5)
        self.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{BASELINE_DS}", "--timeout=300s",
                     timeout=320)

    def _containers(self) -> list[kubernetes.client.V1Container]:
        """The baseline DaemonSet's pod template's containers (a DaemonSet always has them)."""
        spec = self.apps.read_namespaced_daemon_set(BASELINE_DS, NAMESPACE).spec
        assert spec is not None and spec.template.spec is not None
        return spec.template.spec.containers

    def _container_index(self) -> int:
        containers = self._containers()
        return next(i for i, c in enumerate(containers) if c.name == baseline.NAME)

    def set_probe(self, on: bool) -> None:
        """Add (strategic merge, keyed by container name) or remove (JSON patch) the baseline kube-proxy
        container's readinessProbe, then wait for that rollout to settle. Not timed."""
        if on:
            body: Any = {"spec": {"template": {"spec": {"containers": [
                {"name": baseline.NAME, "readinessProbe": readiness_probe()}]}}}}
            content_type = STRATEGIC_MERGE_PATCH
        else:
            path = f"/spec/template/spec/containers/{self._container_index()}"
            body = [{"op": "test", "path": f"{path}/name", "value": baseline.NAME},
                    {"op": "remove", "path": f"{path}/readinessProbe"}]
            content_type = JSON_PATCH
        self.apps.patch_namespaced_daemon_set(BASELINE_DS, NAMESPACE, body, _content_type=content_type)
        self.wait_settled()
        container = self._containers()[self._container_index()]
        if (container.readiness_probe is not None) != on:
            raise RuntimeError(f"baseline readinessProbe {'missing' if on else 'still there'} after the patch")

    def restart_ready(self, run: int) -> Result:
        """The restart with the readiness probe on the baseline; the probe is removed again afterwards."""
        say("restart-ready: adding the readiness probe to the baseline DaemonSet (a rollout, not timed)")
        self.set_probe(True)
        try:
            return self.restart(run, "restart-ready")
        finally:
            say("restart-ready: removing the readiness probe again (a rollout, not timed)")
            self.set_probe(False)

    def restart(self, run: int, kind: str = "restart") -> Result:
        self.wait_settled()
        time.sleep(1.5)  # kubectl refuses a second restart within the same second (restartedAt)
        with self.seen.lock:
            old = {name: rec["node"] for name, rec in self.seen.pods.items() if "deleting" not in rec}
        t0 = time.monotonic()
        self.kubectl("-n", NAMESPACE, "rollout", "restart", f"daemonset/{BASELINE_DS}")

        def new_pods_ready() -> dict[str, dict[str, Any]] | None:
            fresh = {n: r for n, r in self.seen.pods.items() if n not in old and r.get("first", 0) >= t0}
            by_node = {r["node"]: r for r in fresh.values() if "ready" in r and "deleting" not in r}
            return by_node if set(by_node) >= set(self.nodes) else None

        new = self.seen.wait(new_pods_ready, self.timeout, "every node's new kube-proxy pod Ready")
        end = max(r["ready"] for r in new.values())
        with self.seen.lock:
            deleted = {rec["node"]: rec.get("deleting", t0) for name, rec in self.seen.pods.items() if name in old}
        splits = []
        for node in self.nodes:
            gone = deleted.get(node, t0)
            kp = new[node]["ready"] - gone
            phases = {"pod Ready": kp, "pod Running": new[node].get("running", new[node]["ready"]) - gone}
            splits.append(NodeSplit(node, kp, kp, 0.0, 0.0, phases))
        return Result(kind, run, end - t0, splits)

    # ---- proxyshift ----

    def policy_body(self, matrix: bool = True, ahead: bool = True) -> dict[str, Any]:
        # The behaviour workloads' NodePorts change in nftables mode (localhost, the second address): the
        # policy accepts those two documented changes, so the matrix is probed and compared in full and
        # the rollout still completes.
        behaviour = {"enabled": matrix, "allowChanges": ["LocalhostNodePorts", "NodePortAddresses"]}
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyPolicy", "metadata": {"name": POLICY},
                "spec": {"nodeSelector": {"matchLabels": {"pool": POOL}}, "mode": "nftables",
                         "rollout": {"maxUnavailable": 1, "cordon": False, "drain": False,
                                     "preflightAhead": ahead},
                         "gate": {"timeout": "2m", "minSyncs": 1, "behaviour": behaviour}}}

    def _splits(self, t0: float, end: float) -> list[NodeSplit]:
        """Per node: the migration's phases as the ProxyNode watch saw them, newer than t0."""
        with self.seen.lock:
            phases = {k: v for k, v in self.seen.phases.items() if v >= t0}
            pods = dict(self.seen.pods)
            syncs = {k: set(v) for k, v in self.seen.syncs.items()}
            log = [row for row in self.seen.log if t0 <= row[0] <= end]
        rows = []
        for node in self.nodes:
            mine = sorted((at, phase) for (n, phase, _), at in phases.items() if n == node)
            seen_at = {phase: at for at, phase in reversed(mine)}  # first sighting of each phase
            start = mine[0][0] if mine else t0
            done = seen_at.get("Done", end)
            durations: dict[str, float] = {}
            for (at, phase), (nxt, _) in itertools.pairwise(mine):
                durations[phase] = durations.get(phase, 0.0) + nxt - at
            switch = seen_at.get("Switch")
            # kube-proxy is ready to serve at its first rule sync. The agent reports the process's start
            # and last sync (the node's clock: this host's); the earliest sync of a process started after
            # the switch is that moment. Without one, fall back to the new pod being Running+Ready.
            # (The process start is only good to a second: the kernel's boot time in /proc/stat is whole seconds.)
            first_sync = None
            if switch is not None:
                switch_wall = switch + WALL_OFFSET
                first_sync = min((synced - WALL_OFFSET for started, synced in syncs.get(node, ())
                                  if started >= switch_wall - 1.0 and synced >= started), default=None)
            ready = min((r["ready"] for r in pods.values() if r.get("node") == node and "ready" in r
                         and switch is not None and r["ready"] >= switch), default=None)
            serving = first_sync if first_sync is not None else ready
            # kube-proxy's own restart starts where the label move first shows on the node; the hold and the
            # label move before it are ours.
            restart = min((at for r in pods.values() if r.get("node") == node and switch is not None
                           for at in (r.get("first"), r.get("deleting")) if at is not None and at >= switch),
                          default=switch)
            kp = (serving - restart) if serving is not None and restart is not None else 0.0
            # gating: from the later of "phase Gate seen" and "kube-proxy synced" to the verdict
            gate_start = seen_at.get("Gate")
            verdict = next((at for at, _ in mine if gate_start is not None and at > gate_start), None)
            gate = 0.0
            if verdict is not None and gate_start is not None:
                gate = max(0.0, verdict - max(gate_start, serving if serving is not None else gate_start))
            running = min((r["running"] for r in pods.values() if r.get("node") == node and "running" in r
                           and switch is not None and r["running"] >= switch), default=None)
            durations["pod Ready"] = (ready - switch) if ready is not None and switch is not None else 0.0
            durations["pod Running"] = (running - switch) if running is not None and switch is not None else 0.0
            report = next((at for at, name, phase, _op, state, _m in log if name == node and phase == "Gate"
                           and ".Gate." in state.split(" ", 1)[0] and " Succeeded " in state), None)
            rows.append(NodeSplit(node, done - start, kp, gate, done - start - kp - gate, durations,
                                  switch, restart if switch is not None else None, serving, report))
        return rows

    def timeline(self, t0: float) -> None:
        """Every node's ProxyNode states, kube-proxy pods and first syncs since t0, merged in time order: the
        critical path from one node to the next (--timeline)."""
        print("\ntimeline (seconds after the apply/delete; node, phase, requested op, agent's report; pods; syncs):")
        rows: list[tuple[float, str]] = []
        with self.seen.lock:
            for at, name, phase, op, state, message in self.seen.log:
                if at >= t0:
                    rows.append((at, f"{name:<10} {phase:<9} {op:<12} {state:<60} {message}"))
            for pod, rec in self.seen.pods.items():
                for moment in ("first", "deleting", "running", "ready"):
                    if rec.get(moment, -1.0) >= t0:
                        rows.append((rec[moment], f"{rec.get('node') or '?':<10} pod {pod} {moment}"))
            for name, seen_syncs in self.seen.syncs.items():
                for started, synced in seen_syncs:
                    if synced - WALL_OFFSET >= t0:
                        rows.append((synced - WALL_OFFSET, f"{name:<10} kube-proxy synced (its process "
                                     f"started {started - WALL_OFFSET - t0:.2f})"))
        for at, line in sorted(rows):
            print(f"  {at - t0:7.2f}  {line}")

    def migrate(self, run: int, matrix: bool = True, ahead: bool = True) -> Result:
        self.wait_settled()
        t0 = time.monotonic()
        created = cast(dict[str, Any], self.custom.create_cluster_custom_object(
            GROUP, VERSION, "proxypolicies", self.policy_body(matrix, ahead)))
        key = f"{POLICY}/{created['metadata']['uid']}"
        end = self.seen.wait(lambda: self.seen.policy_ready.get(key), self.timeout, "the policy's Ready")
        if self.show_timeline:
            self.timeline(t0)
        kind = NO_MATRIX if not matrix else NO_AHEAD if not ahead else "migrate"
        return Result(kind, run, end - t0, self._splits(t0, end), t0)

    def revert(self, run: int) -> Result:
        t0 = time.monotonic()
        self.seen.policy_gone.pop(POLICY, None)
        self.custom.delete_cluster_custom_object(GROUP, VERSION, "proxypolicies", POLICY)
        end = self.seen.wait(lambda: self.seen.policy_gone.get(POLICY), self.timeout, "the policy gone")
        left = [n for n in self.nodes if REVISION_LABEL in _labels(self.core.read_node(n).metadata)]
        if left:
            raise RuntimeError(f"policy gone but {left} still carry a revision label")
        return Result("revert", run, end - t0, self._splits(t0, end), t0)


# ---- cluster and report ----


def ensure_cluster(state_dir: Path, nodes: int) -> controlplane.ClusterInfo:
    if controlplane.load_info(state_dir) is not None:
        # Run under the machine-wide lock, so nobody uses it: a cluster left by a killed session
        # (as tests/conftest.py does). This benchmark needs its own shape (one pool of N nodes).
        say(f"removing the cluster left in {state_dir}")
        controlplane.down(state_dir)
    say(f"starting the local cluster: pool {POOL}={nodes}")
    report = cluster_cli.up(state_dir, {POOL: nodes})
    say(f"cluster up in {report['seconds']}s")
    info = controlplane.load_info(state_dir)
    assert info is not None
    return info


def floor_ratio(rows: list[Result]) -> float:
    """The median over runs of each run's total over its own sync floor. The floor is measured in the same
    rollout, so a run's ratio pairs them; the ratio of the two medians mixes runs (a long floor of one run
    against a short total of another) and is printed beside it."""
    return median([r.seconds / r.kube_proxy for r in rows if _comparable(r.seconds, r.kube_proxy)])


def _comparable(a: float, b: float) -> bool:
    """Both measured (a kind missing from a partial run is NaN) and a divisor above zero."""
    return not (math.isnan(a) or math.isnan(b)) and b > 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if _comparable(a, b) else "-"


def _verdict(a: float, b: float) -> str:
    if not _comparable(a, b):
        return "n/a"
    return "met" if a / b <= TARGET_RATIO else "MISSED"


def print_matrix_cost(results: list[Result], nodes: int) -> None:
    """The behaviour matrix's share and the preflight lookahead's: the same migration with the matrix off
    (--matrix-cost) and with rollout.preflightAhead off (--ahead-cost), each against its own floor."""
    rows_of = {kind: [r for r in results if r.kind == kind] for kind in ("migrate", NO_MATRIX, NO_AHEAD)}
    if not rows_of["migrate"] or not (rows_of[NO_MATRIX] or rows_of[NO_AHEAD]):
        return
    total = {k: median([r.seconds for r in rows]) for k, rows in rows_of.items() if rows}
    floor = {k: median([r.kube_proxy for r in rows]) for k, rows in rows_of.items() if rows}

    def phase(rows: list[Result], name: str) -> float:
        return median([n.phases.get(name, 0.0) for r in rows for n in r.nodes])

    print("\nmigrate (matrix on, preflight ahead) beside its variants, side by side (medians over runs):\n")
    print("| rollout | total s | sync floor s | total/floor (per run) | total/floor (of the medians) | "
          "Preflight per node s | Prepared per node s | Gate per node s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in total:
        rows = rows_of[kind]
        print(f"| {kind} | {total[kind]:.1f} | {floor[kind]:.1f} | {floor_ratio(rows):.2f}x | "
              f"{_ratio(total[kind], floor[kind])} | "
              f"{phase(rows, 'Preflight'):.2f} | {phase(rows, 'Prepared'):.2f} | {phase(rows, 'Gate'):.2f} |")
    if NO_MATRIX in total:
        print(f"\nthe matrix's cost per node: {(total['migrate'] - total[NO_MATRIX]) / max(nodes, 1):.2f} s")
    if NO_AHEAD in total:
        print(f"the lookahead's saving per node: {(total[NO_AHEAD] - total['migrate']) / max(nodes, 1):.2f} s")
    ratio = floor_ratio(rows_of["migrate"])
    verdict = "not measured" if math.isnan(ratio) else \
        f"{'met' if ratio <= MATRIX_TARGET_RATIO else 'missed'} ({ratio:.2f}x, the median of the runs' ratios)"
    print(f"target: migrate within {MATRIX_TARGET_RATIO}x of its sync floor: {verdict}")


def _verdict_at(a: float, b: float, target: float) -> str:
    if not _comparable(a, b):
        return "not measured"
    return f"{'met' if a <= target * b else 'missed'} ({a / b:.2f}x)"


# The segments of a rollout's critical path, in the order they follow each other (maxUnavailable 1).
PATH_SEGMENTS = ("start", "label", "kube-proxy", "agent", "handoff", "end")


def critical_path(result: Result) -> dict[str, list[float]] | None:
    """A one-node-at-a-time rollout cut into what follows what: `start` (the apply -> the first node's phase
    Switch), per node `label` (Switch -> kube-proxy's restart: the label move and the DaemonSet controller),
    `kube-proxy` (restart -> first sync: the floor), `agent` (sync -> the agent's gate report seen: noticing,
    the hold's release, the in-gate flush, the conntrack step, the matrix, the status write), per node after
    the first `handoff` (the previous report -> this node's Switch: the operator's plan and writes), `end` (the
    last report -> Ready). None when a moment is missing or nodes overlapped."""
    # (switch, restart, first sync, report) per node, in switch order.
    moments = sorted((n.switch_at, n.restart_at, n.sync_at, n.report_at) for n in result.nodes
                     if None not in (n.switch_at, n.restart_at, n.sync_at, n.report_at))
    if not moments or len(moments) < len(result.nodes) or math.isnan(result.started):
        return None
    timed = cast(list[tuple[float, float, float, float]], moments)
    path: dict[str, list[float]] = {k: [] for k in PATH_SEGMENTS}
    path["start"].append(timed[0][0] - result.started)
    for (_, _, _, reported), (switched, _, _, _) in itertools.pairwise(timed):
        if switched < reported:
            return None  # overlapping nodes: no single path
        path["handoff"].append(switched - reported)
    for switched, restarted, synced, reported in timed:
        path["label"].append(restarted - switched)
        path["kube-proxy"].append(synced - restarted)
        path["agent"].append(reported - synced)
    path["end"].append(result.started + result.seconds - timed[-1][3])
    return path


def print_critical_path(results: list[Result]) -> None:
    kinds = [k for k in ("migrate", NO_MATRIX, NO_AHEAD, "revert") if any(r.kind == k for r in results)]
    print("\nthe critical path, node after node (seconds; per-node columns: the median over nodes and runs; "
          "own in all: the median over runs of the rollout's sum):\n"
          "start = apply -> first Switch; label = Switch -> kube-proxy's restart (label move, DaemonSet controller);\n"
          "kube-proxy = restart -> first sync (the floor); agent = sync -> the agent's gate report seen;\n"
          "handoff = a report -> the next node's Switch (the operator); end = the last report -> Ready\n")
    print("| rollout | start | label | kube-proxy | agent | handoff | end | own in all (all but kube-proxy) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        paths = [p for r in results if r.kind == kind and (p := critical_path(r)) is not None]
        if not paths:
            print(f"| {kind} | not measured (a moment missing or nodes overlapped) |||||||")
            continue
        cells = [f"{median([v for p in paths for v in p[k]]):.2f}" if any(p[k] for p in paths) else "-"
                 for k in PATH_SEGMENTS]
        own = median([sum(sum(p[k]) for k in PATH_SEGMENTS if k != "kube-proxy") for p in paths])
        print(f"| {kind} | {' | '.join(cells)} | {own:.2f} |")


def print_report(results: list[Result], nodes: int) -> None:
    print(f"\n## rollout overhead, {nodes} nodes, maxUnavailable 1 (seconds; medians over runs)\n")
    print("sync floor = the sum over nodes of migrate's kube-proxy time (kube-proxy's restart -> first rule sync):\n"
          "the least any rollout that waits, node after node, for each node's kube-proxy to have synced needs.\n"
          "restart-ready's readinessProbe (/healthz, periodSeconds 1) passes once kube-proxy serves /healthz,\n"
          "which it does (200) while still starting up: it waits for the process, not for its first sync.\n")
    print("| run | restart s | restart-ready s | migrate s | revert s | sync floor s "
          "| migrate/restart | migrate/restart-ready | migrate/floor | revert/restart |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    nan = float("nan")
    by = {(r.kind, r.run): r for r in results}
    for run in sorted({r.run for r in results}):
        rs, rr, mg, rv = (by.get((kind, run)) for kind in KINDS)
        sec = {k: (x.seconds if x else nan) for k, x in zip(KINDS, (rs, rr, mg, rv), strict=True)}
        floor = mg.kube_proxy if mg else nan
        cells = ["-" if math.isnan(v) else f"{v:.1f}" for v in (*sec.values(), floor)]
        ratios = [_ratio(sec["migrate"], sec["restart"]), _ratio(sec["migrate"], sec["restart-ready"]),
                  _ratio(sec["migrate"], floor), _ratio(sec["revert"], sec["restart"])]
        print(f"| {run} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    med = {k: median([r.seconds for r in results if r.kind == k]) for k in KINDS}
    floor_med = median([r.kube_proxy for r in results if r.kind == "migrate"])
    paired = floor_ratio([r for r in results if r.kind == "migrate"])
    # migrate/floor: the median of the column above (each run against its own floor), not of the medians.
    print(f"| median | {med['restart']:.1f} | {med['restart-ready']:.1f} | {med['migrate']:.1f} | "
          f"{med['revert']:.1f} | {floor_med:.1f} | {_ratio(med['migrate'], med['restart'])} | "
          f"{_ratio(med['migrate'], med['restart-ready'])} | {paired:.2f}x | "
          f"{_ratio(med['revert'], med['restart'])} |")
    print(f"\nsync floor (sum over nodes of migrate's kube-proxy restart -> first sync, maxUnavailable 1): "
          f"{floor_med:.1f} s; "
          f"migrate/floor {paired:.2f}x as the median of the runs' ratios, "
          f"{_ratio(med['migrate'], floor_med)} as the ratio of the medians")
    print(f"target: migrate within {TARGET_RATIO}x of the restart: {_verdict(med['migrate'], med['restart'])}")
    print(f"target: migrate within {TARGET_RATIO}x of restart-ready: {_verdict(med['migrate'], med['restart-ready'])}")
    print(f"target: migrate within {TARGET_RATIO}x of the sync floor: "
          f"{'n/a' if math.isnan(paired) else 'met' if paired <= TARGET_RATIO else 'MISSED'}\n")

    print("| rollout | total s | kube-proxy s | gate s | own s | outside any node s |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        rows = [r for r in results if r.kind == kind]
        if rows:
            print(f"| {kind} | {median([r.seconds for r in rows]):.1f} | {median([r.kube_proxy for r in rows]):.1f} | "
                  f"{median([r.gate for r in rows]):.1f} | {median([r.own for r in rows]):.1f} | "
                  f"{median([r.between for r in rows]):.1f} |")
    print("\nper node, median over nodes and runs (seconds; a phase lasts until the next one is seen;\n"
          "restarts: kube-proxy = old pod deleted -> new pod Ready; migrate/revert: kube-proxy = its restart -> first\n"
          "sync, pod times from the switch):\n")
    print("| rollout | node total | kube-proxy | pod Running | pod Ready | " + " | ".join(PHASES) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(PHASES))
    for kind in KINDS:
        per_node = [n for r in results if r.kind == kind for n in r.nodes]
        if per_node:
            cells = [f"{median([n.phases.get(p, 0.0) for n in per_node]):.2f}" for p in PHASES]
            print(f"| {kind} | {median([n.total for n in per_node]):.2f} | "
                  f"{median([n.kube_proxy for n in per_node]):.2f} | "
                  f"{median([n.phases.get('pod Running', 0.0) for n in per_node]):.2f} | "
                  f"{median([n.phases.get('pod Ready', n.kube_proxy) for n in per_node]):.2f} | "
                  + " | ".join(cells) + " |")

    def node_median(kind: str, node: str, key: str | None) -> str:
        values = [n.kube_proxy if key is None else n.phases.get(key, nan)
                  for r in results if r.kind == kind for n in r.nodes if n.node == node]
        return f"{median(values):.2f}" if values else "-"

    print_matrix_cost(results, nodes)
    print_critical_path(results)

    print("\neach node, median over runs (seconds; restarts: from the old pod deleted; migrate: from the switch):\n")
    print("| node | restart pod Ready | restart-ready pod Running | restart-ready pod Ready "
          "| migrate kube-proxy (to first sync) | migrate pod Ready |")
    print("|---|---:|---:|---:|---:|---:|")
    nodes_seen = sorted({n.node for r in results for n in r.nodes})
    for node in nodes_seen:
        print(f"| {node} | {node_median('restart', node, 'pod Ready')} | "
              f"{node_median('restart-ready', node, 'pod Running')} | "
              f"{node_median('restart-ready', node, 'pod Ready')} | {node_median('migrate', node, None)} | "
              f"{node_median('migrate', node, 'pod Ready')} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="per rollout")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--timeline", action="store_true",
                        help="print every node's ProxyNode states, pods and syncs per migration")
    parser.add_argument("--ahead-cost", action="store_true",
                        help="also migrate with rollout.preflightAhead off (matrix on), side by side")
    parser.add_argument("--matrix-cost", action="store_true",
                        help="also migrate with the behaviour matrix off, side by side, and create the behaviour "
                        "workloads (every Service kind) so the matrix probes all of them")
    args = parser.parse_args()

    state_dir = paths.default_state_dir()
    info = ensure_cluster(state_dir, args.nodes)
    operator: install.OperatorProcess | None = None
    results: list[Result] = []
    try:
        say("installing proxyshift (CRDs, RBAC, admission, agents)")
        install.install(info.bin_dir, info.kubeconfig)
        operator = install.OperatorProcess(info.kubeconfig, state_dir / "logs" / "operator-bench.log",
                                           metrics_port=METRICS_PORT, health_port=HEALTH_PORT).start()
        operator.wait_healthy()
        nodes = [f"ps-node-{i}" for i in range(1, args.nodes + 1)]
        bench = Bench(info.kubeconfig, info.bin_dir, nodes, args.timeout)
        if args.matrix_cost:
            say("creating the behaviour workloads (every Service kind the matrix samples)")
            behaviour_workloads.create(state_dir, Kube(info.kubeconfig, pool_size=16), nodes=nodes)
        bench.show_timeline = args.timeline
        if not args.no_warmup:
            say("warm-up: migrate + revert (adds the baseline affinity; not counted)")
            bench.migrate(0)
            bench.revert(0)
        measure: dict[str, Callable[[int], Result]] = {
            "restart": bench.restart, "restart-ready": bench.restart_ready, "migrate": bench.migrate,
            NO_MATRIX: lambda run: bench.migrate(run, matrix=False),
            NO_AHEAD: lambda run: bench.migrate(run, ahead=False)}
        for run in range(1, args.runs + 1):
            # the restarts and the migration alternate which goes first; restart-ready is next to restart
            order: tuple[str, ...] = (("restart", "restart-ready", "migrate") if run % 2
                                      else ("migrate", "restart-ready", "restart"))
            if args.matrix_cost:
                order = (NO_MATRIX, *order) if run % 2 else (*order, NO_MATRIX)
            if args.ahead_cost:
                order = (*order, NO_AHEAD) if run % 2 else (NO_AHEAD, *order)
            for kind in order:
                result = measure[kind](run)
                say(f"run {run}: {kind} {result.seconds:.1f}s")
                results.append(result)
                if kind in ("migrate", NO_MATRIX, NO_AHEAD):
                    result = bench.revert(run)
                    say(f"run {run}: revert {result.seconds:.1f}s")
                    results.append(result)
    finally:
        if operator is not None:
            operator.stop()
        if results:
            print_report(results, args.nodes)
        if not args.keep:
            say("taking the local cluster down")
            controlplane.down(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
