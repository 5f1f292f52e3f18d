"""Fault injection for the reliability tests: faults on the local cluster, fired as a migration enters each step.

`StepInjector` watches the ProxyNodes (spec.migration.phase) from a thread and fires a fault once per
node step, on the first node it sees entering that step, so a single migration exercises the fault
at every step instead of one migration per (fault, step). While it runs it records what the
invariants need: every (node uid, attempt) -> the switchedAt values seen (a node switched twice
would show two), and every change of a node's revision label.

The faults are real: SIGKILL of the operator and agent processes, SIGKILL of kube-proxy in a loop,
kube-apiserver stopped and started again with its recorded argv, SIGSTOP/SIGCONT of etcd, the Node
object deleted (the node simulator registers it again, as a kubelet does), and an nftables rule in
the node's namespace dropping the agent's connections to kube-proxy's metrics and health ports.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loss_budget import BEFORE_SWITCH, DELETED, Budget, Seen, attribute, timeline_json

from localcluster import controlplane, state
from localcluster.kubeapi import Kube
from proxyshift.agent.hold import HOLD_CHAIN_PREFIX, NFT_HOLD_TABLE
from proxyshift.commands import run
from tests.support.operator_harness import IPTABLES_MODE_CHAINS, REVISION_LABEL, Harness, migration
from tests.support.polling import wait_until
from tests.support.processes import container_pid

BLUE = ["ps-node-1", "ps-node-2"]
ALL_NODES = [*BLUE, "ps-node-3"]
# Verify is not among them: the cleanup's own report verifies the node, and Verify is entered only when
# that report cannot (an old agent, a kube-proxy that did not answer it), which a healthy migration never
# needs. The runs arm it besides (the fault fires there whenever a node enters it, VERIFY_STEPS), and
# test_a_fault_in_verify makes a node enter it.
ALL_STEPS = ("Preflight", "Cordon", "Switch", "Gate", "Cleanup", "Uncordon")
VERIFY = "Verify"
# Uncordon lasts ~50-80 ms (one plan: the node patch, then Done): a slower look misses it.
POLL_SECONDS = 0.05
ETCD_PAUSE_SECONDS = 5.0
FAULT_POLL_SECONDS = 0.2  # how often a fault waits for what it acts on (a pid, a restarted API server)
PROBE_BLOCK_SECONDS = 20.0
HOLD_GONE_WITHIN = 30.0  # after a run settled, every rule hold gone (check_end_state)
PROBE_BLOCK_TABLE = "ps-fault-probe"  # a user's table: the agent's flush must leave it alone
KUBE_PROXY_PORTS = (10249, 10256)  # metrics (/proxyMode, /metrics) and health (/healthz): what the agent probes


@dataclass
class Firing:
    step: str
    node: str
    at: float
    seconds: float = 0.0
    detail: str = ""


@dataclass
class History:
    """What the injector saw of each node while it ran."""

    # (node, node uid, toRevision, startedAt, attempt): one node migration -> every switchedAt recorded for it
    switched_at: dict[tuple[str, str, str, str, int], set[str]] = field(default_factory=lambda: defaultdict(set))
    # (node, node uid) -> the revision label's successive values (None: no label, the baseline)
    labels: dict[tuple[str, str], list[str | None]] = field(default_factory=lambda: defaultdict(list))
    # node -> successive (attempt, phase)
    phases: dict[str, list[tuple[int, str]]] = field(default_factory=lambda: defaultdict(list))
    # node -> successive steps with when they were seen (loss_budget.Seen): the phases above, plus DELETED while
    # the Node or its ProxyNode is gone and until a Node registered again reaches its Switch. What the lost
    # connections are charged to (loss_budget.attribute).
    timeline: dict[str, list[Seen]] = field(default_factory=lambda: defaultdict(list))


class ClusterReader(Protocol):
    """What StepInjector reads the cluster with: a Kube, or a unit test's scripted fake."""

    def get(self, path: str, *, timeout: float = ...) -> Any: ...


class StepInjector:
    """Fires `fault(step, node) -> detail` once per step in `steps`, on entering it; records history."""

    def __init__(self, kube: ClusterReader, nodes: Iterable[str], fault: Callable[[str, str], str] | None,
                 steps: Iterable[str] = ALL_STEPS, max_per_node: int | None = None) -> None:
        self.kube, self.nodes, self.fault = kube, set(nodes), fault
        # At most this many firings on one node; a step entered by a node that had its share waits for the next.
        self.max_per_node = max_per_node
        self.armed = list(steps) if fault is not None else []
        self.fired: list[Firing] = []
        # (step, node) of an armed step a node was seen in while the previous fault still ran (not fired).
        self.busy_at: list[tuple[str, str]] = []
        self.looks = 0  # successful looks at the ProxyNodes and Nodes
        self.history = History()
        self._looked = False  # the first successful look has been recorded
        self._before: set[tuple[str, str, str, str, int]] = set()  # migrations that ended before the run
        self._gone: set[str] = set()  # nodes whose Node or ProxyNode vanished and that have not switched since
        self._last_look: float | None = None  # wall time the previous successful look started
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-injector", daemon=True)

    def start(self) -> StepInjector:
        self._thread.start()
        return self

    def stop(self) -> History:
        """The history; raises the first fault that could not be injected, and fails an injector that never
        saw the nodes (the API unreadable from its thread the whole run): its history would prove nothing."""
        self._stop.set()
        self._thread.join(timeout=120)
        if self.errors:
            raise self.errors[0]
        seen = {n for n, phases in self.history.phases.items() if phases}
        assert self.looks > 0 and seen, f"the step injector never saw the nodes {sorted(self.nodes)} " \
                                        f"({self.looks} successful looks): nothing was observed or fired"
        return self.history

    def entered(self, step: str) -> list[str]:
        """The nodes seen in `step` during the run."""
        return sorted(n for n, phases in self.history.phases.items() if any(p == step for _, p in phases))

    def unfired(self, step: str) -> list[str]:
        """Nodes seen in armed `step` although the fault never fired there and was never busy then: an injector
        that looked away. Empty when `step` was not armed."""
        if any(f.step == step for f in self.fired) or step not in self.armed:
            return []
        excused = {n for s, n in self.busy_at if s == step}
        if self.max_per_node is not None:  # a node that had its share of firings is passed over by design
            excused |= {n for n in self.nodes if sum(f.node == n for f in self.fired) >= self.max_per_node}
        return [n for n in self.entered(step) if n not in excused]

    def _observe(self) -> list[tuple[str, str]]:
        """Record one look at the nodes; (node, phase) of every node now in an armed step."""
        started = time.time()
        pns = self.kube.get("/apis/proxyshift.io/v1alpha1/proxynodes", timeout=3)["items"]
        nodes = {n["metadata"]["name"]: n for n in self.kube.get("/api/v1/nodes", timeout=3)["items"]}
        # Both reads are done: anything they show was so by now (the upper end of a change's time).
        looked = time.time()
        due = []
        steps: dict[str, tuple[int, str]] = dict.fromkeys(self.nodes, (0, DELETED))
        for pn in pns:
            name = pn["metadata"]["name"]
            node = nodes.get(name)
            if name not in self.nodes or node is None:
                continue
            uid = node["metadata"]["uid"]
            owners = {o.get("uid") for o in pn["metadata"].get("ownerReferences") or [] if o.get("kind") == "Node"}
            m = migration(pn)
            attempt, phase = int(m.get("attempt") or 0), m.get("phase") or "Pending"
            if not owners or uid in owners:  # a ProxyNode of a deleted Node, not yet collected, is not this Node's
                steps[name] = (attempt, phase)
            key = (name, uid, m.get("toRevision") or "baseline", m.get("startedAt") or "", attempt)
            if not self._looked and phase in ("Done", "Failed", "RolledBack"):
                # Ended before this run started (the previous run's, on a policy flipped back): not
                # this run's switch.
                self._before.add(key)
            if m.get("switchedAt") and key not in self._before:
                self.history.switched_at[key].add(m["switchedAt"])
            phases = self.history.phases[name]
            if not phases or phases[-1] != (attempt, phase):
                phases.append((attempt, phase))
            if phase in self.armed:
                due.append((name, phase))
        for name, (attempt, step) in steps.items():
            if step == DELETED:
                self._gone.add(name)
            elif name in self._gone and step in BEFORE_SWITCH:
                attempt, step = 0, DELETED  # registered again, still on the kube-proxy it started with
            else:
                self._gone.discard(name)
            timeline = self.history.timeline[name]
            if not timeline or (timeline[-1].attempt, timeline[-1].step) != (attempt, step):
                timeline.append(Seen(looked, self._last_look, attempt, step))
        for name, node in nodes.items():
            if name in self.nodes:
                label = (node["metadata"].get("labels") or {}).get(REVISION_LABEL)
                seen = self.history.labels[(name, node["metadata"]["uid"])]
                if not seen or seen[-1] != label:
                    seen.append(label)
        self._looked = True
        self._last_look = started
        self.looks += 1
        return due

    def _fire(self, firing: Firing) -> None:
        started = time.monotonic()
        try:
            assert self.fault is not None
            firing.detail = self.fault(firing.step, firing.node)
        except BaseException as exc:  # surfaced by stop(): a fault that cannot be injected fails the test
            self.errors.append(exc)
            self._stop.set()
        firing.seconds = time.monotonic() - started

    def _run(self) -> None:
        # The fault runs in its own thread so the history keeps being recorded while it lasts (a node
        # that migrates meanwhile is still seen); one fault at a time.
        busy: threading.Thread | None = None
        while not self._stop.is_set():
            try:
                due = self._observe()
            except Exception:  # the API may be down: that is one of the faults
                self._stop.wait(POLL_SECONDS)
                continue
            if busy is not None and busy.is_alive():
                self.busy_at += [(step, node) for node, step in due
                                 if step in self.armed and (step, node) not in self.busy_at]
            else:
                for node, step in due:
                    if step not in self.armed:
                        continue
                    if self.max_per_node is not None and \
                            sum(f.node == node for f in self.fired) >= self.max_per_node:
                        continue
                    self.armed.remove(step)
                    firing = Firing(step, node, time.time())
                    self.fired.append(firing)
                    busy = threading.Thread(target=self._fire, args=(firing,), name=f"fault-{step}", daemon=True)
                    busy.start()
                    break
            self._stop.wait(POLL_SECONDS)
        if busy is not None:
            busy.join(timeout=120)


# ---- the faults ----


def agent_pid(state_dir: Path, node: str) -> int | None:
    return container_pid(state_dir, node, "proxyshift-system", "proxyshift-agent-", "agent")


def _record(state_dir: Path, name: str) -> dict[str, Any]:
    records = [r for r in state.read_state(state_dir)["processes"] if r["name"] == name]
    assert records, f"no {name} recorded in {state_dir}/state.json"
    return records[0]


@dataclass
class Faults:
    """The fault catalogue, each `(step, node) -> what was done` (the injector calls them)."""

    h: Harness
    kube: Kube
    state_dir: Path
    all_nodes: list[str]
    _probe_blocks: dict[str, threading.Timer] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def operator_kill(self, step: str, node: str) -> str:
        self.h.operator.kill(signal.SIGKILL)
        # With no operator at all, no node is left without kube-proxy: a pod swap under way when it
        # died completes by itself (the DaemonSet controller's work).
        wait_until(lambda: all(self.h.kube_proxy_running(n) for n in self.all_nodes), 60,
                   "a running kube-proxy on every node while no operator runs", interval=FAULT_POLL_SECONDS)
        self.h.operator.start()
        self.h.operator.wait_healthy()
        return "operator SIGKILLed; kube-proxy ran on every node meanwhile; a new operator started"

    def agent_kill(self, step: str, node: str) -> str:
        # Not waiting for the restart: the simulator's back-off (like the kubelet's) is part of the fault.
        pid = wait_until(lambda: agent_pid(self.state_dir, node), 60, f"the agent's pid on {node}",
                         interval=FAULT_POLL_SECONDS)
        os.kill(pid, signal.SIGKILL)
        return f"agent pid {pid} SIGKILLed"

    def apiserver_restart(self, step: str, node: str) -> str:
        record = _record(self.state_dir, "kube-apiserver")
        state.stop_process(record)
        down_at = time.monotonic()
        state.spawn(self.state_dir, "kube-apiserver", record["argv"], env=controlplane.daemon_env(),
                    stop_grace=controlplane.APISERVER_STOP_GRACE_SECONDS)
        info = controlplane.load_info(self.state_dir)
        assert info is not None
        context = controlplane.admin_ssl_context(info.pki_dir)
        wait_until(lambda: controlplane.http_get(f"{info.api_url}/readyz", context)[0] == 200, 120,
                   "kube-apiserver /readyz after its restart", interval=FAULT_POLL_SECONDS)
        return f"kube-apiserver stopped and started again; ready after {time.monotonic() - down_at:.1f}s"

    def etcd_pause(self, step: str, node: str) -> str:
        pid = _record(self.state_dir, "etcd")["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(ETCD_PAUSE_SECONDS)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"etcd SIGSTOPped for {ETCD_PAUSE_SECONDS:g}s, then SIGCONT"

    def node_delete(self, step: str, node: str) -> str:
        # The node simulator registers the Node again (new uid, no proxyshift label), as a kubelet does after
        # its Node was deleted; that takes ~25 s. Not waited for here: meanwhile the other node moves on, and
        # the run only settles once every node of the pool exists again and is Done.
        uid = self.kube.get(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        self.kube.delete(f"/api/v1/nodes/{node}")
        return f"Node {node} ({uid[:8]}) deleted"

    def probe_block(self, step: str, node: str) -> str:
        """Drop every connection inside the node to kube-proxy's metrics and health ports for a while."""
        ports = ", ".join(str(p) for p in KUBE_PROXY_PORTS)
        script = (f"add table inet {PROBE_BLOCK_TABLE}\n"
                  f"add chain inet {PROBE_BLOCK_TABLE} out {{ type filter hook output priority -300; }}\n"
                  f"flush chain inet {PROBE_BLOCK_TABLE} out\n"
                  f"add rule inet {PROBE_BLOCK_TABLE} out oifname \"lo\" tcp dport {{ {ports} }} drop\n")
        with self._lock:
            run(["nft", "-f", "-"], netns=node, input=script, timeout=10)
            old = self._probe_blocks.pop(node, None)
            if old is not None:
                old.cancel()
            timer = threading.Timer(PROBE_BLOCK_SECONDS, self.probe_unblock, args=(node,))
            timer.daemon = True
            self._probe_blocks[node] = timer
            timer.start()
        return f"tcp to 127.0.0.1:{{{ports}}} dropped in {node} for {PROBE_BLOCK_SECONDS:g}s"

    def probe_block_at_cleanup(self, step: str, node: str) -> str:
        """Fired at Gate: the moment the node's ProxyNode says Cleanup, freeze its agent (SIGSTOP), drop its
        reads of kube-proxy (probe_block), and let it go on (SIGCONT). Its report after the flush then cannot
        read kube-proxy, so the node cannot be verified on it and enters Verify.

        A watch, not the injector's 50 ms poll: the agent gets the same watch event and finishes its flush
        and report within tens of milliseconds, which a poll loses to (the first version of
        test_a_fault_in_verify, blocking on the injector's sight of Cleanup, never saw a node enter Verify)."""
        from kubernetes import client, watch

        custom = client.CustomObjectsApi(client.ApiClient(self.h.custom.api_client.configuration))
        stream = watch.Watch()
        for event in stream.stream(custom.list_cluster_custom_object, "proxyshift.io", "v1alpha1", "proxynodes",
                                   field_selector=f"metadata.name={node}", timeout_seconds=180):
            if migration(event["object"]).get("phase") != "Cleanup":
                continue
            stream.stop()
            pid = agent_pid(self.state_dir, node)
            assert pid, f"no agent running on {node} at its Cleanup"
            os.kill(pid, signal.SIGSTOP)
            try:
                blocked = self.probe_block("Cleanup", node)
            finally:
                os.kill(pid, signal.SIGCONT)
            return f"at Cleanup: agent pid {pid} stopped while {blocked}, then continued"
        raise AssertionError(f"{node} did not enter Cleanup within 180 s of its Gate")

    def probe_unblock(self, node: str) -> None:
        with self._lock:
            self._probe_blocks.pop(node, None)
            run(["nft", "delete", "table", "inet", PROBE_BLOCK_TABLE], netns=node, timeout=10, check=False)

    def unblock_all(self) -> None:
        for node in list(self._probe_blocks):
            timer = self._probe_blocks.get(node)
            if timer is not None:
                timer.cancel()
            self.probe_unblock(node)


class KubeProxyCrashLoop:
    """SIGKILLs the node's kube-proxy of one revision every time it starts, until stopped."""

    def __init__(self, state_dir: Path, node: str, revision: str) -> None:
        self.state_dir, self.node, self.revision = state_dir, node, revision
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"crashloop-{node}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pid = container_pid(self.state_dir, self.node, "kube-system", f"kube-proxy-{self.revision}-",
                                "kube-proxy")
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
            self._stop.wait(0.2)

    def start(self) -> KubeProxyCrashLoop:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.kills


# ---- what every fault run must end with ----


def outages(failures: list[tuple[float, str]], gap: float = 2.0) -> list[tuple[float, float, int]]:
    """Failed connections grouped into outages: (start, end, failed connections); a gap > `gap` s splits."""
    spans: list[tuple[float, float, int]] = []
    for at, _ in sorted(failures):
        if spans and at - spans[-1][1] <= gap:
            start, _, count = spans[-1]
            spans[-1] = (start, at, count + 1)
        else:
            spans.append((at, at, 1))
    return spans


def leftover_modes(h: Harness, node: str, iptables_chains: Iterable[str]) -> list[str]:
    """Rules of kube-proxy modes other than the node's current one (stale rules)."""
    mode = h.proxy_mode(node)
    found = []
    if mode != "nftables":
        found += [f"nft table {t}" for t in h.nft_tables(node) & {"ip kube-proxy", "ip6 kube-proxy"}]
    if mode != "iptables":
        found += [f"iptables chain {c}" for c in h.iptables_chains(node) & set(iptables_chains)]
    return found


def rule_holds(h: Harness, node: str) -> list[str]:
    """A rule hold's copies still on the node (agent/hold.py: PSHOLD-* chains, proxyshift-hold tables)."""
    found = [f"iptables chain {c}" for c in sorted(h.iptables_chains(node)) if c.startswith(HOLD_CHAIN_PREFIX)]
    return found + [f"nft table {t}" for t in sorted(h.nft_tables(node)) if t.endswith(f" {NFT_HOLD_TABLE}")]


def report_path(cluster: Any) -> Path:
    default = (cluster.state_dir or Path("/tmp")) / "logs" / "reliability.jsonl"
    return Path(os.environ.get("PROXYSHIFT_RELIABILITY_REPORT", str(default)))


# What explains a node's lost connections after the fact: the agent's hold decisions and kube-proxy's own exits
# and waits for its Node (kube-proxy 1.37 exits when its Node is deleted or its addresses change).
_EXPLAINING = ("rule hold", "Node is being deleted", "Timed out waiting for node", "NodeIPs changed",
               "Using iptables Proxier", "Using nftables Proxier")


def explaining_log_lines(state_dir: Path, node: str, limit: int = 40) -> list[str]:
    """The node's agent and kube-proxy log lines that say when rules were held, released, or left unprogrammed,
    in time order (each cut to 200 characters; the last `limit`), for a run's failure message: a CI run keeps
    nothing else of the node."""
    lines: list[tuple[str, str]] = []
    for path in sorted((state_dir / "nodes" / node / "logs").glob("*.log")):
        if not path.name.startswith(("proxyshift-agent-", "kube-proxy-")):
            continue
        with path.open(errors="replace") as fh:
            for line in fh:
                if any(p in line for p in _EXPLAINING):
                    lines.append((_log_time(line), f"{path.name.split('_')[0]}: {line.strip()[:200]}"))
    return [text for _, text in sorted(lines)[-limit:]]


def _log_time(line: str) -> str:
    """A sortable time of day from the agent's (`2026-12-05 22:15:47,501 ...`) or klog's (`I1205 22:15:46.1 ...`)
    line; lines without one sort first."""
    parts = line.split()
    return parts[1].replace(",", ".") if len(parts) > 1 and parts[1][:2].isdigit() and ":" in parts[1] else ""


def record(cluster: Any, row: dict[str, Any]) -> None:
    path = report_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
    print(json.dumps(row, indent=1, default=str))


def service_answers_everywhere(h: Harness, tcp_probe: Callable[..., Any], service: Any) -> None:
    for node in ALL_NODES:
        h.wait_for(lambda n=node: tcp_probe(n, service.cluster_ip, service.port, 3).failed == 0, 60,
                   f"{service.name} to answer from {node}")


def check_end_state(h: Harness, name: str, history: History, tcp_probe: Callable[..., Any], service: Any,
                    probe_failures: dict[str, list[tuple[float, str]]], gate_timeout: float) -> dict[str, Any]:
    """The invariants every fault run must end with; returns the measured facts for the report."""
    def answered_mode(node: str) -> str | None:
        # A Node registered again a moment ago has a kube-proxy that is still starting: refused until it
        # listens.
        try:
            return h.proxy_mode(node)
        except OSError:
            return None

    for node in ALL_NODES:
        h.wait_for(lambda n=node: h.kube_proxy_running(n), 60, f"a running kube-proxy on {node}")
    modes = {n: h.wait_for(lambda n=n: answered_mode(n), 60, f"kube-proxy on {n} answering /proxyMode")
             for n in ALL_NODES}
    assert set(modes.values()) <= {"iptables", "nftables"}, modes
    # Never switched twice: one switchedAt per node migration (node, Node uid, target, start, attempt), and
    # the revision label moved onto a revision at most once per such migration of that Node object.
    twice = {k: v for k, v in history.switched_at.items() if len(v) > 1}
    assert not twice, f"a node was switched twice within one migration: {twice}"
    for (node, uid), labels in history.labels.items():
        migrations = sum(1 for k in history.switched_at if k[:2] == (node, uid))
        # A rollback moves the label back onto the revision the node came from (None for the baseline): one
        # more move per rolled-back attempt, not a second switch.
        rollbacks = len({attempt for attempt, phase in history.phases[node] if phase == "RollingBack"})
        onto = sum(1 for a, b in itertools.pairwise(labels) if b is not None and a != b)
        assert onto <= migrations + rollbacks, f"{node} ({uid}) label history {labels}: {onto} switches for " \
                                               f"{migrations} migration(s) and {rollbacks} rollback(s)"
    stale = {n: found for n in ALL_NODES if (found := leftover_modes(h, n, IPTABLES_MODE_CHAINS))}
    assert not stale, f"stale rules of another mode: {stale}"
    # A hold left behind DNATs to endpoints that may have gone. Its agent lets it go as soon as the record no
    # longer names its migration in flight and a kube-proxy serves (at the status echo after Done), so a few
    # seconds; HOLD_GONE_WITHIN is far less than its time to live.
    deadline = time.monotonic() + HOLD_GONE_WITHIN
    while (held := {n: found for n in ALL_NODES if (found := rule_holds(h, n))}) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not held, f"a rule hold stayed on a node {HOLD_GONE_WITHIN:g}s after the rollout settled: {held}"
    spans = {n: outages(f) for n, f in probe_failures.items()}
    longest = {n: max((end - start for start, end, _ in s), default=0.0) for n, s in spans.items()}
    assert all(v < gate_timeout for v in longest.values()), f"an outage outlasted the gate timeout: {spans}"
    for node in ALL_NODES:
        h.wait_for(lambda n=node: tcp_probe(n, service.cluster_ip, service.port, 3).failed == 0, 30,
                   f"traffic through {service.name} from {node} after the run")
    records = {n: migration(pn) for n, pn in h.proxynodes().items() if n in history.phases}
    attempts = {n: m.get("attempt") for n, m in records.items()}
    switches = {n: sum(1 for k in history.switched_at if k[0] == n) for n in ALL_NODES}
    # Why a node rolled back or failed: without it a Degraded end in the report says only that it did.
    reasons = {n: f"{m.get('reason')}: {(m.get('message') or '')[:300]}" for n, m in records.items()
               if m.get("reason")}
    return {"modes": modes, "attempts": attempts, "switches": switches, "reasons": reasons,
            "longest_outage_s": {n: round(v, 2) for n, v in longest.items()},
            "phases": dict(history.phases)}


def loss_facts(history: History, failures: dict[str, list[tuple[float, str]]], pool: Iterable[str],
               budget: Budget | None, *, probe_timeout: float, with_timeline: bool = True) -> dict[str, Any]:
    """Every failed connection charged to its node's step (loss_budget.attribute), for the report row:
    `lost_by_step` (node -> step -> count), `over_budget` (each visit of a step charged beyond `budget`, with its
    failure times; left out without a budget: each failure is then charged to the step its node was in),
    `failure_times` (wall times of each node's failed connections) and each node's `timeline`."""
    attribution = attribute(failures, history.timeline, set(pool), budget.steps if budget else {},
                            budget.shared if budget else (), probe_timeout=probe_timeout, poll=POLL_SECONDS)
    facts: dict[str, Any] = {"lost_by_step": attribution.lost_by_step(),
                             "failure_times": {n: [round(t, 3) for t, _ in f] for n, f in failures.items() if f}}
    if budget is not None:
        facts["over_budget"] = attribution.over_budget()
    if with_timeline:
        facts["timeline"] = {n: timeline_json(t) for n, t in history.timeline.items()}
    return facts
