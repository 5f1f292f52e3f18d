"""The node agent: `proxyshift agent --node $NODE_NAME`.

It watches only its own ProxyNode (field selector metadata.name=<node>), runs
the operation in spec.operation at most once per id, and writes what it finds
(operation results, kube-proxy facts, inventory, leftovers, heartbeat) to the
status subresource with JSON merge patches.

Once per id: before running an operation the agent records it as Running in
the status. A restarted agent that finds its own operation still Running did
not finish it; for a Cleanup it does not run the flush again blindly but looks
at the node and reports (Succeeded if nothing of the removed modes is left,
Failed with what is left otherwise), so the operator decides on a new id.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import math
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, cast

from proxyshift.agent import backoff as backoff_mod
from proxyshift.agent import diagnostics as diagnostics_mod
from proxyshift.agent import flush as flush_mod
from proxyshift.agent import hold as hold_mod
from proxyshift.agent import inventory as inventory_mod
from proxyshift.agent import metrics as metrics_mod
from proxyshift.agent import probe as probe_mod
from proxyshift.agent.effects import KernelNodeEffects, NodeEffects
from proxyshift.agent.iptables_save import Dump
from proxyshift.agent.ownership import MODES
from proxyshift.agent.preflight import Missing
from proxyshift.api.behaviour import BehaviourMatrix, BehaviourParams, ConntrackParams, ConntrackReport
from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.api.proxynode import (
    CleanupParams,
    CleanupResult,
    HoldOutcome,
    HoldParams,
    HoldResult,
    KubeProxyFacts,
    NodeMigration,
    Operation,
    OperationResult,
    OperationStatus,
    OperationType,
    PreflightParams,
    PreflightResult,
    ProbeParams,
    ProbeResult,
    ProxyNodeSpec,
    RuleHold,
    clip_status,
)
from proxyshift.api.replacement import ReplacementFacts
from proxyshift.kubeconfig import loading
from proxyshift.modes import DEFAULT_MODE

log = logging.getLogger("proxyshift.agent")

PLURAL = "proxynodes"
# JSON has no infinity and the API server refuses it: a p99 "above the largest bucket"
# is written as this many seconds, which fails any sensible gate bound.
P99_ABOVE_BUCKETS = 1e9
MESSAGE_LIMIT = 4000
FLUSH_MESSAGE_LIMIT = 1000  # a flush's message inside a Probe's details (the probe's own message has it too)
MAX_PROBE_AWAIT_SECONDS = 30.0  # whatever a Probe asks, the agent never sits longer on one
# A Probe that waits for kube-proxy's sync (Agent._await_sync). kube-proxy offers no way to be told of a sync:
# the agent polls, and the cheapest answer that moves with a sync is /healthz's per-family time of the last one
# (probe.KubeProxyHealth), a small JSON object. So the wait reads only /healthz every PROBE_HEALTH_POLL_SECONDS
# (half of it on average is the gate's verdict lag per node) and the full probe (three GETs, the whole /metrics
# text parsed) only when that answer changes, then at every poll for PROBE_CHASE_SECONDS (the metrics count a
# sync a moment after /healthz shows it: the sync's tail, service health checks and UDP conntrack cleanup, runs
# in between), and at the latest every PROBE_FALLBACK_SECONDS. A /healthz without per-family times (a
# kube-proxy from before them, one not in its sync loop yet, none answering) is waited on as before it:
# the full probe every PROBE_AWAIT_POLL_SECONDS.
PROBE_HEALTH_POLL_SECONDS = 0.01
PROBE_CHASE_SECONDS = 0.1
PROBE_FALLBACK_SECONDS = 0.25
PROBE_AWAIT_POLL_SECONDS = 0.05
# A round on the replacement's socket: its health, and while that is Ok its Service table and endpoints.
REPLACEMENT_AWAIT_POLL_SECONDS = 0.1
# A watch that ran this long before failing was healthy: the failure is a new outage, the back-off starts anew.
HEALTHY_WATCH_SECONDS = 5.0
# Operations that change nothing on the node: a diagnose request may be read while one runs.
READ_ONLY_OPERATIONS: tuple[OperationType, ...] = ("Preflight", "Probe")


def now_rfc3339(clock: Callable[[], float] = time.time) -> str:
    return datetime.fromtimestamp(clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProxyNodeAPI(Protocol):
    """The three calls the agent makes; the real one is KubeProxyNodeAPI, tests use a fake."""

    def get(self, name: str) -> dict[str, Any] | None: ...

    def watch(self, name: str, resource_version: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]: ...


def client_retries() -> Any:
    """The client's own retries: none of a connection that could not be made, one of an answer that broke.

    urllib3's default (3 of each, at once, a warning logged per retry) multiplied every try of the watch's
    back-off by four against an API server that is away, so the back-off did not bound the agent's rate. The
    one read retry covers a pooled keep-alive connection the server closed meanwhile, which is no outage.
    """
    from urllib3.util.retry import Retry

    return Retry(total=1, connect=0, read=1, redirect=0, status=0, other=0, backoff_factor=0)


def client_configuration(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """The agent's kubernetes client configuration: in-cluster, or KUBECONFIG; retries as `client_retries`."""
    from kubernetes import client, config

    conf = client.Configuration()
    if not (kubeconfig or context) and os.environ.get("KUBERNETES_SERVICE_HOST") and Path(
            "/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        config.load_incluster_config(client_configuration=conf)
    else:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=conf)
    conf.retries = client_retries()
    return conf


class KubeProxyNodeAPI:
    """ProxyNodes through the kubernetes client: in-cluster config, or KUBECONFIG."""

    def __init__(self, api_client: Any = None, *, kubeconfig: str | None = None, context: str | None = None) -> None:
        from kubernetes import client

        if api_client is None:
            api_client = client.ApiClient(client_configuration(kubeconfig, context))
        self._api = client.CustomObjectsApi(api_client)

    def get(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            # The custom-objects API types its answers `object`: they are the decoded JSON, dicts here.
            return cast(dict[str, Any], self._api.get_cluster_custom_object(API_GROUP, API_VERSION, PLURAL, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def watch(self, name: str, resource_version: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes import watch

        # Bookmarks: the API server's current version while the object does not change (see _watch_loop).
        kwargs: dict[str, Any] = {"field_selector": f"metadata.name={name}", "timeout_seconds": timeout,
                                  "_request_timeout": timeout + 10, "allow_watch_bookmarks": True}
        if resource_version:
            kwargs["resource_version"] = resource_version
        for event in watch.Watch().stream(self._api.list_cluster_custom_object, API_GROUP, API_VERSION, PLURAL,
                                          **kwargs):
            yield event["type"], event["object"]

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], self._api.patch_cluster_custom_object_status(
            API_GROUP, API_VERSION, PLURAL, name, {"status": status},
            _content_type="application/merge-patch+json",
        ))


def facts_patch(facts: KubeProxyFacts) -> dict[str, Any]:
    """Every field, with nulls: a merge patch must clear an old error or an old p99."""
    data = facts.model_dump(by_alias=True, mode="python")
    p99 = data.get("syncDurationP99Seconds")
    if isinstance(p99, float) and math.isinf(p99):
        data["syncDurationP99Seconds"] = P99_ABOVE_BUCKETS
    return data


def operation_patch(op: OperationStatus) -> dict[str, Any]:
    """The whole lastOperation with nulls, so nothing of the previous operation survives the merge."""
    data = op.model_dump(by_alias=True, mode="json")
    data["message"] = data.get("message", "")[:MESSAGE_LIMIT]
    if not data.get("details"):
        data["details"] = None
    return data


@dataclass(frozen=True)
class HoldRecord:
    """A rule hold this agent knows of (agent/hold.py), and when it may go."""

    from_mode: str | None
    to_mode: str | None
    # process_start_time of the kube-proxy that ran when the hold was made: a hold is no longer
    # needed once a different kube-proxy process has synced. None: unknown (found after a restart).
    kube_proxy_start: float | None
    expires: float  # agent clock; a hold never outlives this, synced or not
    # The operation that made it (a Preflight asked to hold, or a Hold): the hold goes as soon as the ProxyNode no
    # longer names that operation's migration in flight (hold.abandoned). None: found after a restart.
    operation_id: str | None = None


# A hold found on the node by a restarted agent: released at the first synced kube-proxy, or after this.
ORPHAN_HOLD_TTL = 120.0


def with_nulls(answer: BehaviourMatrix | ReplacementFacts | RuleHold) -> dict[str, Any]:
    """Every field, with nulls: a merge patch must not keep an old answer's field (a matrix's podPathError, the
    replacement's read error once its API answers, a hold's operation id once a restarted agent holds one)."""
    return answer.model_dump(by_alias=True, mode="json")


@dataclass
class AgentConfig:
    node: str
    metrics_address: str = probe_mod.DEFAULT_METRICS_ADDRESS
    health_address: str = probe_mod.DEFAULT_HEALTH_ADDRESS
    probe_interval: float = 15.0
    status_interval: float = 60.0
    inventory_interval: float = 120.0
    watch_timeout: int = 300
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    modules_root: Path = Path("/lib/modules")
    kubeconfig: str | None = None  # None: in-cluster, else $KUBECONFIG / ~/.kube/config
    context: str | None = None
    listen: str = metrics_mod.DEFAULT_LISTEN  # the agent's own /metrics, /healthz, /readyz; "" serves none
    stale_seconds: float = metrics_mod.DEFAULT_STALE_SECONDS


def kernel_effects(cfg: AgentConfig) -> KernelNodeEffects:
    """The real node, as the agent's flags describe it."""
    return KernelNodeEffects(metrics_address=cfg.metrics_address, health_address=cfg.health_address,
                             proc_root=cfg.proc_root, sys_root=cfg.sys_root, modules_root=cfg.modules_root)


# Runs one operation: (its report, the other status fields to write with it).
Runner = Callable[["Agent", Operation, str], tuple[OperationStatus, dict[str, Any]]]


@dataclass
class Agent:
    cfg: AgentConfig
    api: ProxyNodeAPI
    # Everything that touches the node: kernel_effects(cfg) for real, a fake in the unit tests.
    effects: NodeEffects
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # Uniform in [0, 1): where in [floor, ceiling] each watch back-off lands (agent/backoff.py). A constant 1.0
    # is the back-off without jitter, which only the tests and the reconnect-storm bench's comparison use.
    backoff_draw: Callable[[], float] = random.random
    hold: HoldRecord | None = None
    _hold_checked: bool = False
    # spec.migration as the last ProxyNode event had it (None until one came): whose hold may stay.
    _migration: NodeMigration | None = None
    # The abandoned hold last said to stay (_abandoned_hold_may_go): said once a hold, not every probe.
    _kept_abandoned: HoldRecord | None = None
    _spec_seen: bool = False
    facts: KubeProxyFacts | None = None
    inventory: inventory_mod.Inventory | None = None
    _started: set[str] = field(default_factory=set)
    _last_probe: float = -math.inf
    _last_status: float = -math.inf
    _last_inventory: float = -math.inf
    _node_facts: dict[str, Any] | None = None
    # Status writes wait until the ProxyNode exists: the operator creates it, not the agent.
    node_seen: bool = False
    # An operation result the API server did not take yet: retried before anything else.
    _unsent: dict[str, Any] | None = None
    # spec.diagnose (proxyshift diagnose): the last id answered.
    _diagnosed: str | None = None
    # What /healthz, /readyz and the heartbeat age read (agent/metrics.py); on the agent's clock.
    health: metrics_mod.Health = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.health = metrics_mod.Health(self.clock, self.cfg.stale_seconds)

    # ---- node facts ----

    def _probe(self) -> KubeProxyFacts:
        began = self.clock()
        facts = self.effects.probe()
        metrics_mod.PROBE_SECONDS.observe(max(self.clock() - began, 0.0))
        if facts.error:
            metrics_mod.record_error("kube_proxy_probe")
        return facts

    def _flush(self, remove: list[str], target: str | None) -> tuple[flush_mod.FlushReport, hold_mod.HoldReport]:
        """The flush, with the hold released in its round (effects.cleanup)."""
        began = self.clock()
        try:
            report, released = self.effects.cleanup(remove, target)
        finally:
            metrics_mod.FLUSH_SECONDS.observe(max(self.clock() - began, 0.0))
        if released.ok:
            self.hold = None
        return report, released

    def _release_hold(self) -> hold_mod.HoldReport:
        report = self.effects.release_hold()
        if report.ok:
            self.hold = None
        return report

    def _maybe_release_hold(self) -> None:
        """Drop the hold once a new kube-proxy has programmed its rules, or when its time is up."""
        if self.hold is None:
            if self._hold_checked:
                return
            self._hold_checked = True
            if not self.effects.hold_present():
                return
            log.warning("found a rule hold left by an earlier agent; it goes once kube-proxy has synced")
            self.hold = HoldRecord(None, None, None, self.clock() + ORPHAN_HOLD_TTL)
        facts, held = self.facts, self.hold
        if self._abandoned_hold_may_go(lambda: facts):
            self._release_abandoned()
            return
        synced = (facts is not None and facts.synced_since_start() and facts.proxy_mode in MODES
                  and facts.process_start_time != held.kube_proxy_start
                  and hold_mod.sync_frees(facts.proxy_mode, self._migration))
        expired = self.clock() >= held.expires
        if not (synced or expired):
            return
        why = f"kube-proxy ({facts.proxy_mode if facts else '?'}) has synced" if synced else "its time ran out"
        report = self._release_hold()
        (log.info if report.ok else log.error)("%s (%s)", report.message(), why)

    def _abandoned_hold_may_go(self, read_facts: Callable[[], KubeProxyFacts | None]) -> bool:
        """Whether the hold is abandoned (hold.abandoned) and kube-proxy's own rules serve without it
        (hold.kube_proxy_serves); an abandoned hold they do not yet serve without stays until a kube-proxy has
        synced or its time runs out (_maybe_release_hold). `read_facts` is called only for an abandoned hold."""
        held = self.hold
        if held is None or not self._spec_seen or not hold_mod.abandoned(held.operation_id, self._migration):
            return False
        if hold_mod.kube_proxy_serves(read_facts(), held.kube_proxy_start):
            return True
        if held is not self._kept_abandoned:
            self._kept_abandoned = held
            log.warning("the rule hold's migration is over, but no kube-proxy serves the node's Services without "
                        "it (none answers, or it has not synced since it started): the hold stays until one has, "
                        "%.0fs at most", max(held.expires - self.clock(), 0.0))
        return False

    def _release_abandoned(self) -> None:
        """Drop a hold whose migration the ProxyNode no longer names in flight (abandoned before its switch, ended,
        or replaced by another attempt): nothing will switch under it, and a copy left would go stale."""
        m = self._migration
        why = "no migration" if m is None else f"migration {m.phase} ({m.reason or 'no reason'})"
        report = self._release_hold()
        (log.info if report.ok else log.error)("%s (its migration is over: %s)", report.message(), why)

    def hold_status(self) -> dict[str, Any] | None:
        """status.hold: the hold this agent keeps, or None."""
        held = self.hold
        if held is None:
            return None
        return with_nulls(RuleHold(operation_id=held.operation_id, expires=now_rfc3339(lambda: held.expires)))

    def _make_hold(self, op_id: str, p: HoldParams) -> hold_mod.HoldReport | None:
        """Copy the old mode's service rules (a Hold, or a passed preflight asked to); None: the move needs none."""
        from_mode, to_mode, ttl = p.from_mode or "", p.to_mode or "", float(p.ttl_seconds or 600)
        if not hold_mod.hold_applies(from_mode, to_mode):
            return None
        facts = self._probe()  # the kube-proxy running now: the hold goes when a different one has synced
        report = self.effects.install_hold(from_mode)
        if report.changed:
            self.hold = HoldRecord(from_mode, to_mode, facts.process_start_time, self.clock() + ttl, op_id)
            self._hold_checked = True
        return report

    def node_facts(self) -> dict[str, Any]:
        """Kernel release, modules and tool versions: they only change with a reboot, read once."""
        if self._node_facts is None:
            # Any mode's check reports the node's facts; the default mode's reads nothing more (a check for
            # nftables would also list the IPVS table).
            report = self.effects.preflight(DEFAULT_MODE)
            self._node_facts = {"kernelRelease": report.kernel_release, "modules": report.present_modules(),
                                "tools": report.tools.as_status()}
        return self._node_facts

    def observe(self, *, inventory: bool, release_hold: bool = True,
                fresh: Mapping[str, Dump] | None = None) -> dict[str, Any]:
        """Fresh probe (and inventory when asked or due): the status fields they fill. release_hold=False: the
        caller releases the hold itself (a Probe whose in-gate flush takes it in the flush's own round). `fresh`:
        the flush's verifying reads, just taken, which the inventory uses instead of reading those again."""
        self.facts = self._probe()
        self._last_probe = self.clock()
        if inventory or self.inventory is None:
            self.inventory = self.effects.inventory(fresh)
            self._last_inventory = self.clock()
        if release_hold:
            self._maybe_release_hold()
        mode = self.facts.proxy_mode if self.facts.proxy_mode in MODES else None
        return {
            "observedMode": mode,
            "kubeProxy": facts_patch(self.facts),
            "objects": [o.to_k8s() for o in inventory_mod.mode_objects(self.inventory, mode)],
            "leftovers": inventory_mod.leftovers(self.inventory, mode),
            "leftoverObjects": inventory_mod.leftover_objects(self.inventory, mode),
            "foreignIPVS": inventory_mod.foreign_ipvs(self.inventory).to_k8s(),
            "hold": self.hold_status(),
        }

    def write(self, status: dict[str, Any]) -> None:
        from proxyshift import __version__

        status = {**status, "heartbeat": now_rfc3339(self.clock), "agentVersion": __version__}
        try:
            self.api.patch_status(self.cfg.node, clip_status(status))
        except Exception:
            metrics_mod.record_error("status_write")
            raise
        self._last_status = self.clock()
        metrics_mod.record_status_write(self.health)

    # ---- operations ----

    def handle(self, obj: dict[str, Any]) -> None:
        """React to the current ProxyNode: run its operation if it is new."""
        self.node_seen = True
        spec = ProxyNodeSpec.model_validate(obj.get("spec") or {})
        self._migration, self._spec_seen = spec.migration, True
        # A fresh probe: the last one may predate the switch, when the old kube-proxy still served.
        if self._abandoned_hold_may_go(self._probe):
            self._release_abandoned()
            if self.hold is None:  # told at once; a failed release is retried by the next observe, not here
                self.write({"hold": None})
        op = spec.operation
        last = (obj.get("status") or {}).get("lastOperation") or {}
        if op is not None and op.id not in self._started and last.get("id") != op.id \
                and op.type in READ_ONLY_OPERATIONS:
            # The operator asks for the "before" distribution with the Preflight: both only read, so they run
            # side by side and answer in one write (alone, the diagnose was 0.3-0.5 s of each node's preflight).
            self._run_operation(op, beside=diagnostics_mod.pending_request(obj, self._diagnosed))
            return
        self._serve_diagnose(obj)
        if op is None or op.id in self._started:
            return
        if last.get("id") == op.id:
            if last.get("state") == "Running":
                self._started.add(op.id)
                self._recover(op, last)
            return  # already reported by us (before a restart or just now)
        self._run_operation(op, beside=None)

    def _run_operation(self, op: Operation, *, beside: dict[str, Any] | None) -> None:
        """Record the operation Running, run it (and the diagnose request `beside` it), report both at once."""
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="diagnose") as pool:
            answer = pool.submit(self._diagnose_answer, beside) if beside is not None else None
            started, began = now_rfc3339(self.clock), self.clock()
            running = {"lastOperation": operation_patch(OperationStatus(
                id=op.id, type=op.type, state="Running", message=f"{op.type} started", started_at=started))}
            # It runs while its Running record is written (one API round trip, 0.05-0.15 s of every
            # operation on the bench): running one twice changes nothing. Preflight and Probe only read, a
            # Hold replaces any hold, a Cleanup removes what is left of the modes it names (run again, it
            # finds nothing). Still counted as started only once the record is written, and reported after
            # it: if the write fails, the result is dropped and the next event runs it again. An agent that
            # dies meanwhile leaves either no record (the next one runs it) or Running (_recover).
            recorded = pool.submit(self.write, running)
            log.info("operation %s (%s) started: %s", op.id, op.type, op.params)
            result, extra = self._execute(op, started)
            recorded.result()
            self._started.add(op.id)
            answered = False
            if answer is not None:
                try:
                    extra = {**answer.result(), **extra}
                    answered = True
                except Exception:  # the operation's report must go out; the request is served next event
                    log.exception("diagnose %s beside operation %s failed", beside and beside.get("id"), op.id)
        log.info("operation %s %s: %s", op.id, result.state, result.message)
        self._send_result(result, extra, began)
        if answered and beside is not None:
            self._diagnosed = beside["id"]

    def _serve_diagnose(self, obj: dict[str, Any]) -> None:
        """spec.diagnose is a channel of its own beside operations: read-only, answered once per id."""
        body = diagnostics_mod.pending_request(obj, self._diagnosed)
        if body is None:
            return
        self.write(self._diagnose_answer(body))
        self._diagnosed = body["id"]

    def _diagnose_answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The status patch answering a diagnose request.

        Its own probe, not the last heartbeat's facts: the counters to read depend on the mode kube-proxy
        runs now, and a kube-proxy that restarted since (a DaemonSet rollout) was seen with no mode. It
        never touches self.facts: it may run beside an operation. Never raises (answer_patch answers a bad
        request with its error; a probe failure is a fact with an error, not an exception).
        """
        began = self.clock()
        facts = self._probe()
        mode = facts.proxy_mode if facts.proxy_mode in MODES else None
        patch = diagnostics_mod.answer_patch(body, mode, self.effects.diagnose)
        log.info("diagnose %s answered in %.3f s (%s mode)", body["id"], self.clock() - began, mode or "no")
        return patch

    def _send_result(self, result: OperationStatus, extra: dict[str, Any], began: float) -> None:
        """Report a finished operation (counted here, once, whether or not the first write goes through)."""
        metrics_mod.record_operation(result.type, result.state, self.clock() - began)
        self._unsent = {**extra, "lastOperation": operation_patch(result)}
        self._send_unsent()

    def _send_unsent(self) -> None:
        assert self._unsent is not None
        self.write(self._unsent)
        self._unsent = None

    def _execute(self, op: Operation, started: str) -> tuple[OperationStatus, dict[str, Any]]:
        try:
            return RUNNERS[op.type](self, op, started)
        except Exception as exc:  # an operation must always end in a report, never a dead agent
            log.exception("operation %s failed", op.id)
            metrics_mod.record_error("operation")
            return self._done(op, started, False, f"{op.type} failed: {exc.__class__.__name__}: {exc}"), {}

    def _done(self, op: Operation, started: str, ok: bool, message: str,
              result: OperationResult | None = None) -> OperationStatus:
        return OperationStatus(id=op.id, type=op.type, state="Succeeded" if ok else "Failed", message=message,
                               started_at=started, finished_at=now_rfc3339(self.clock),
                               details=result.to_details() if result is not None else {})

    def _run_preflight(self, op: Operation, started: str) -> tuple[OperationStatus, dict[str, Any]]:
        p = op.params_as(PreflightParams)
        behaviour = p.behaviour
        # The matrix only reads (dials and conntrack look-ups), so it is taken while the preflight checks
        # the kernel and tools instead of after: the two cost about the same, and this is per node.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="behaviour-before") as pool:
            pending = pool.submit(self._take_behaviour, op, behaviour) if behaviour is not None else None
            report = self.effects.preflight(p.mode, p.scheduler or None, load_modules=p.load_modules,
                                            extra_modules=p.extra_modules, allow_changes=p.allow_changes,
                                            ipvs_exclude_cidrs=p.ipvs_exclude_cidrs)
            matrix = pending.result() if pending is not None else None
        self._node_facts = None if report.loaded else self._node_facts
        extra: dict[str, Any] = {"kernelRelease": report.kernel_release, "modules": report.present_modules(),
                                 "tools": report.tools.as_status()}
        replaced = None
        if p.replacement is not None:
            # A target without kube-proxy: its agent, if it runs here already, must be healthy. One that is not
            # here yet may start with the node's label (a DaemonSet that selects it): that is no refusal.
            replaced = self.effects.replacement(p.replacement, with_services=False)
            extra["replacement"] = with_nulls(replaced)
            if replaced.agent_state is not None and replaced.agent_state != "Ok":
                report.missing.append(Missing(
                    "a healthy kube-proxy replacement agent",
                    f"it runs on the node but reports {replaced.agent_state}"
                    + (f" ({replaced.agent_message})" if replaced.agent_message else ""),
                    "fix the agent on the node (its logs say why), then retry"))
        if report.foreign_ipvs is not None and not report.foreign_ipvs_excluded_some:
            # status.foreignIPVS is every foreign virtual server; a move to ipvs names only those it deletes.
            extra["foreignIPVS"] = report.foreign_ipvs.to_k8s()
        message, details = report.message(), PreflightResult.model_validate(report.details())
        if replaced is not None:
            details = details.model_copy(update={"replacement": replaced})
            message += ("; its kube-proxy replacement agent is not on the node yet (it must start there with the "
                        f"node's label): {replaced.error}" if replaced.agent_state is None
                        else f"; its kube-proxy replacement agent reports {replaced.agent_state}")
        if report.ok and matrix is not None:
            # The "before" of this migration; an "after" of an earlier one means nothing any more.
            extra["behaviour"] = {"before": with_nulls(matrix), "after": None}
            message += f"; {_matrix_summary(matrix)}"
        if report.ok and p.hold is not None:
            # Made now, while the node waits for its switch, the hold costs the switch no round trip. Its
            # failure is no failed preflight: the switch asks for a Hold of its own, as without it.
            held = self._make_hold(op.id, p.hold)
            if held is not None:
                details = details.model_copy(update={"hold": HoldOutcome(ok=held.ok, message=held.message())})
                message += f"; {held.message()}"
            extra["hold"] = self.hold_status()
        return self._done(op, started, report.ok, message, details), extra

    def _take_behaviour(self, op: Operation, params: BehaviourParams) -> BehaviourMatrix:
        mode = self.facts.proxy_mode if self.facts is not None and self.facts.proxy_mode in MODES else None
        return self.effects.behaviour(params, mode=mode, operation_id=op.id)

    @staticmethod
    def _cleanup_args(p: CleanupParams) -> tuple[list[str], str | None]:
        flush_mod.validate_modes(p.remove_modes, p.target_mode)
        return p.remove_modes, p.target_mode or None

    def _flush_stale(self, p: CleanupParams) -> tuple[bool, str, CleanupResult, Mapping[str, Dump]]:
        """Flush the modes `p` names and drop the rule hold in the same round (a copy of stale rules too: a
        cleanup never leaves it behind): (ok, message, the flush's details, its verifying reads for the
        inventory that follows)."""
        remove, target = self._cleanup_args(p)
        report, released = self._flush(remove, target)
        message = report.message() + (f" | {released.message()}" if released.changed or not released.ok else "")
        details = CleanupResult.model_validate({**report.details(), "hold": released.message()})
        return report.ok and released.ok, message, details, report.after

    def _run_cleanup(self, op: Operation, started: str) -> tuple[OperationStatus, dict[str, Any]]:
        p = op.params_as(CleanupParams)
        began = self.clock()
        ok, message, details, after = self._flush_stale(p)
        flushed = self.clock()
        # kube-proxy and the node's objects as they are right after the flush (in `extra`) and, when asked,
        # the gate's Services reached from here: the operator verifies the node on this report without
        # another probe. The connects only read, so they run beside the inventory.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cleanup-connects") as pool:
            connects = pool.submit(self.effects.connect, p.services) if p.services else None
            extra = self.observe(inventory=True, fresh=after)
            details.connects = connects.result() if connects is not None else None
        log.info("cleanup %s: flush %.3f s, then kube-proxy, inventory and connects %.3f s", op.id,
                 flushed - began, self.clock() - flushed)
        return self._done(op, started, ok, message, details), extra

    def _run_hold(self, op: Operation, started: str) -> tuple[OperationStatus, dict[str, Any]]:
        """Copy the old mode's service rules so they outlive the new kube-proxy's startup cleanup."""
        p = op.params_as(HoldParams)
        report = self._make_hold(op.id, p)
        if report is None:
            return self._done(op, started, True, f"no rule hold needed for {p.from_mode} -> {p.to_mode}",
                              HoldResult()), {}
        return self._done(op, started, report.ok, report.message(), HoldResult()), {"hold": self.hold_status()}

    def _run_probe(self, op: Operation, started: str) -> tuple[OperationStatus, dict[str, Any]]:
        p = op.params_as(ProbeParams)
        # Read before the first full probe: a sync after that probe then shows as a change of this answer.
        seen = self.effects.health() if p.await_mode else None
        # With an in-gate flush asked, the rule hold is not released as the sync shows: if the flush runs (the
        # sync came), the hold leaves in the flush's own round, one save and one restore per family for both;
        # if it does not, it is released below as any observe would have.
        flush_asked = p.cleanup is not None and bool(p.await_mode)
        extra = self.observe(inventory=False, release_hold=not flush_asked)
        if p.await_mode and seen is not None:
            # Wait here, polling the node's own kube-proxy, rather than answer "not synced yet" and
            # make the operator ask again a round later. Bounded; the gate judges whatever comes.
            deadline = self.clock() + min(p.await_seconds or 0.0, MAX_PROBE_AWAIT_SECONDS)
            extra = self._await_sync(p.await_mode, p.await_syncs or 1, deadline, seen,
                                     release_hold=not flush_asked) or extra
        services = p.services
        replaced = None
        if p.replacement is not None:
            # As for kube-proxy's sync: wait here, reading the replacement's own API, until it proves itself
            # (its host datapath loads seconds after its health turns Ok), rather than answer "not yet" and
            # make the operator ask again a round later. Bounded; the gate judges whatever comes. A round is one
            # read: the client reads the endpoints and the Service table only as far as the health it has just
            # read allows (cilium_api.read_replacement), so a starting replacement costs one small GET a round.
            replaced = self.effects.replacement(p.replacement, with_services=True)
            deadline = self.clock() + min(p.await_seconds or 0.0, MAX_PROBE_AWAIT_SECONDS)
            while not replaced.proves(p.replacement.expected_frontends) and self.clock() < deadline:
                self.sleep(REPLACEMENT_AWAIT_POLL_SECONDS)
                replaced = self.effects.replacement(p.replacement, with_services=True)
            extra = {**extra, "replacement": with_nulls(replaced)}
        synced = self.clock()
        flushed: CleanupResult | None = None
        flush = bool(flush_asked and _synced_in(self.facts, p.await_mode or "", p.await_syncs or 1))
        if flush_asked and not flush:
            held = self.hold
            self._maybe_release_hold()
            if self.hold is not held:
                extra = {**extra, "hold": self.hold_status()}
        # After the sync, three parts, the first two side by side (they shared the critical path one after the
        # other): the flush of the old mode's leftovers with the inventory after it; the conntrack step then
        # the connects; then the "after" matrix, which must judge the node as it stays, so it waits for both.
        # The conntrack step and the connects need nothing of the flush: it runs only where the new kube-proxy
        # already deleted the old mode's Service rules at its start (planner/machine.py _cleanup_in_gate), and
        # they only delete un-NATed entries and reach Services through the new rules. The conntrack step goes
        # first, as before the matrix: a connect whose source port happens to be that of an un-NATed entry
        # left from the switch's gap (its client gave up, the entry stays) would hang through its SYN retries
        # and fail the gate for nothing. A rule hold still on the node (the flush releases it in its round)
        # keeps the connects waiting for the flush: a connect must reach its Service through kube-proxy's rules,
        # not the hold's copy of the old ones. The conntrack step does not wait.
        released = threading.Event()
        held_through = flush and self.hold is not None
        if not held_through:
            released.set()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probe-checks") as pool:
            checks = pool.submit(self._conntrack_then_connect, p.conntrack, services, released)
            try:
                if flush and p.cleanup is not None:
                    after: Mapping[str, Dump] = {}
                    try:
                        ok, said, flushed, after = self._flush_stale(p.cleanup)
                    except ValueError as exc:  # modes the flush refuses: told, never a failed probe
                        ok, said, flushed = False, str(exc), CleanupResult()
                    released.set()
                    flushed.ok, flushed.message = ok, said[:FLUSH_MESSAGE_LIMIT]
                    extra = self.observe(inventory=True, fresh=after)
            finally:
                released.set()  # whatever happened, the connects must not wait for ever
            cleaned_up = self.clock()
            cleaned, connects, conntrack_took, connects_took = checks.result()
        checked = self.clock()
        behaviour = p.behaviour
        matrix = self._take_behaviour(op, behaviour) if behaviour is not None else None
        # Where the time after kube-proxy's sync goes: the gate's own part of a node's switch. The parts overlap:
        # "in all" is what they cost the node before the matrix.
        log.info("probe %s after the sync: cleanup %.3f s; beside it conntrack %.3f s then connects %.3f s%s; "
                 "%.3f s in all; then behaviour %.3f s", op.id, cleaned_up - synced, conntrack_took, connects_took,
                 " (after the flush's round: a rule hold was on the node)" if held_through and services else "",
                 checked - synced, self.clock() - checked)
        facts = self.facts or KubeProxyFacts()
        if replaced is not None:
            # No kube-proxy runs here: the replacement's account is the probe's answer.
            parts = [f"kube-proxy replacement {replaced.kube_proxy_replacement or 'unknown'}, agent "
                     f"{replaced.agent_state or 'unreachable'}"]
            if replaced.cluster_ip_frontends is not None:
                parts.append(f"{replaced.cluster_ip_frontends} ClusterIP frontends, {replaced.missing_count} of "
                             f"{len(p.replacement.frontends if p.replacement else [])} asked missing")
            if replaced.error:
                parts.append(f"error: {replaced.error}")
        else:
            parts = [f"kube-proxy mode {facts.proxy_mode or 'unknown'}", f"healthz {facts.healthz_status}"]
            if facts.error:
                parts.append(f"error: {facts.error}")
        if services:
            reached = sum(1 for v in connects.values() if v is True)
            parts.append(f"{reached}/{len(services)} service connects ok")
        details = ProbeResult(connects=connects if services else None, conntrack=cleaned, cleanup=flushed)
        if flushed is not None:
            parts.append(f"cleanup{'' if flushed.ok else ' FAILED'}: {flushed.message}")
        if cleaned is not None:
            parts.append(f"conntrack: {cleaned.deleted_tcp} TCP and {cleaned.deleted_udp} UDP un-NATed entries "
                         "deleted" + (f" ({cleaned.error})" if cleaned.error else ""))
        if matrix is not None:
            extra = {**extra, "behaviour": {"after": with_nulls(matrix)}}
            parts.append(_matrix_summary(matrix))
        return self._done(op, started, True, "; ".join(parts), details), extra

    def _await_sync(self, mode: str, syncs: int, deadline: float, seen: probe_mod.KubeProxyHealth, *,
                    release_hold: bool = True) -> dict[str, Any] | None:
        """Poll until `_settled` or `deadline` (agent clock): /healthz alone while its per-family sync times
        hold still, the full probe when they move (PROBE_HEALTH_POLL_SECONDS and its neighbours say why).
        `seen`: /healthz as read just before the last full probe. The last full probe's status fields, None
        if none was taken."""
        extra: dict[str, Any] | None = None
        observed, changed = self.clock(), -math.inf
        while not _settled(self.facts, mode, syncs) and self.clock() < deadline:
            self.sleep(PROBE_AWAIT_POLL_SECONDS if seen.proxiers is None else PROBE_HEALTH_POLL_SECONDS)
            now_seen = self.effects.health()
            now = self.clock()
            if now_seen.proxiers is None:
                due = True  # nothing to watch: the full probe at every poll, as before /healthz had the times
            elif now_seen.mark != seen.mark:
                due, changed = True, now
            else:
                due = now - changed < PROBE_CHASE_SECONDS or now - observed >= PROBE_FALLBACK_SECONDS
            seen = now_seen
            if due:
                extra = self.observe(inventory=False, release_hold=release_hold)
                observed = self.clock()
        return extra

    def _conntrack_then_connect(self, params: ConntrackParams | None, services: list[str],
                                released: threading.Event
                                ) -> tuple[ConntrackReport | None, dict[str, bool | str], float, float]:
        """A gate Probe's conntrack step (with `params`), then, once `released` is set (no rule hold on the node
        any more), its connects to `services`: their answers and the seconds each took (the connects' with their
        wait). Runs beside the in-gate flush (_run_probe says why it may)."""
        began = self.clock()
        cleaned = self.effects.conntrack(params) if params is not None else None
        between = self.clock()
        if services:
            released.wait()
        connects = self.effects.connect(services) if services else {}
        return cleaned, connects, between - began, self.clock() - between

    def _recover(self, op: Operation, last: dict[str, Any]) -> None:
        """Our own operation is still Running in the status: a previous agent died during it."""
        log.warning("operation %s (%s) was left Running by a previous agent", op.id, op.type)
        started, began = last.get("startedAt") or now_rfc3339(self.clock), self.clock()
        if op.type != "Cleanup":
            # Preflight and Probe change nothing on the node, and a Hold replaces any older hold:
            # simply run them now.
            result, extra = self._execute(op, started)
            self._send_result(result, extra, began)
            return
        try:
            remove, target = self._cleanup_args(op.params_as(CleanupParams))
        except ValueError as exc:
            self._send_result(self._done(op, started, False, str(exc)), {}, began)
            return
        extra = self.observe(inventory=True)
        assert self.inventory is not None
        counted = {m: self.inventory.count(m, observed=target, stale_only=True)
                   for m in remove if m in MODES and m != target}
        left: dict[str, int] = {m: n for m, n in counted.items() if n}
        if not left:
            result = self._done(op, started, True, "the agent restarted during this cleanup; the node now has no "
                                "objects of " + ", ".join(remove) + " left, so it completed",
                                CleanupResult(recovered=True, remaining={}))
        else:
            what = ", ".join(f"{n} {m} objects" for m, n in left.items())
            result = self._done(op, started, False, "the agent restarted during this cleanup and did not re-run it; "
                                f"still on the node: {what}; request the cleanup again with a new operation id",
                                CleanupResult(recovered=True, remaining=left))
        self._send_result(result, extra, began)

    # ---- the loop ----

    def tick(self) -> None:
        """Periodic work: probe, and write status when due or when something meaningful changed."""
        now = self.clock()
        if not self.node_seen:
            return
        if self._unsent is not None:
            self._send_unsent()
        if now - self._last_probe < self.cfg.probe_interval and now - self._last_status < self.cfg.status_interval:
            return
        before, held = self.facts, self.hold
        status = self.observe(inventory=now - self._last_inventory >= self.cfg.inventory_interval)
        # A hold that went (a new kube-proxy synced, its time ran out) is told at once: status.hold is what
        # the operator reads before it switches under a hold made with the preflight.
        if now - self._last_status >= self.cfg.status_interval or _meaningful_change(before, self.facts) \
                or self.hold is not held:
            self.write({**self.node_facts(), **status})

    def run(self, stop: threading.Event) -> None:
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        watcher = threading.Thread(target=self._watch_loop, args=(events, stop), daemon=True, name="watch")
        watcher.start()
        latest: dict[str, Any] | None = None
        pending = False
        while not stop.is_set():
            self.health.loop_turned()
            with contextlib.suppress(queue.Empty):
                latest, pending = events.get(timeout=1.0), True
            try:
                if pending and latest is not None:
                    # Kept until handled: an operation whose start could not be recorded
                    # (API server away) is tried again without waiting for a new event.
                    self.handle(latest)
                    pending = False
                self.tick()
            except Exception:  # the API server being away must not kill the agent
                log.exception("agent step failed; retrying")
                metrics_mod.record_error("loop")
                stop.wait(5)

    def _watch_loop(self, events: queue.Queue[dict[str, Any]], stop: threading.Event) -> None:
        """GET once, then watch from the last resourceVersion. After an error the watch starts from the API
        server's current state (no resourceVersion), whose first event is the object: the GET's answer, in the
        watch's first event.

        Re-listing on every renewal would cost the API server a GET per node per
        renewal; 5,000 agents make that matter. After an API server restart each agent made three requests
        (a GET, a watch from the GET's version that the new server answered 410, a watch from now); now one.
        """
        backoff = backoff_mod.BASE_SECONDS  # the ceiling; the wait is drawn below it
        rv: str | None = None
        # After a 410 the next watch starts from the API server's current state (its first event is the object,
        # ADDED), not from the object's own resourceVersion: an object unchanged since before an API server
        # restart carries a version older than the new server's watch window, and watching from it answers
        # 410 again, after every GET, until something writes the object (the reconnect-storm bench saw every
        # agent loop so).
        from_now = False
        watching_since: float | None = None
        said_missing = -math.inf
        while not stop.is_set():
            started = time.monotonic()
            try:
                if rv is None and not from_now:  # from now: the watch's first event is the object, no GET needed
                    obj = self.api.get(self.cfg.node)
                    self.health.contact()  # a 404 is an answer too: the operator has not created it yet
                    if obj is None:
                        if started - said_missing > 300:  # say it now and then, not every poll
                            log.info("ProxyNode %s does not exist yet; waiting for the operator", self.cfg.node)
                            said_missing = started
                        stop.wait(10)
                        continue
                    events.put(obj)
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                watching_since = time.monotonic()
                for kind, item in self.api.watch(self.cfg.node, None if from_now else rv, self.cfg.watch_timeout):
                    if stop.is_set():
                        return
                    self.health.contact()
                    if kind in ("ADDED", "MODIFIED"):
                        rv = (item.get("metadata") or {}).get("resourceVersion") or rv
                        from_now = False
                        events.put(item)
                    elif kind == "BOOKMARK":
                        # The API server's current version, sent while the object sits unchanged: the renewal
                        # resumes inside the watch window instead of from a version that may have left it.
                        rv = (item.get("metadata") or {}).get("resourceVersion") or rv
                    elif kind in ("DELETED", "ERROR"):
                        # Gone: a GET says so (and waits for the operator). An error (a 410: the version left the
                        # window): the server's current state, from the next watch's first event.
                        rv, from_now = None, kind == "ERROR"
                        break
                self.health.contact()  # the watch ran to its timeout: the API server kept it open
                backoff = backoff_mod.BASE_SECONDS
                if time.monotonic() - started < 1.0:
                    stop.wait(1.0)  # a server that ends watches at once must not make this spin
            except Exception as exc:
                log.warning("watching ProxyNode %s: %s", self.cfg.node, exc)
                metrics_mod.record_error("watch")
                # From now, not GET + watch from the object's version: after an API server restart that version
                # is older than the new server's window (a 410) unless something wrote the object since, and
                # the 410 (here or raised as one by the client) needs the watch from now anyway.
                rv, from_now = None, True
                if watching_since is not None and time.monotonic() - watching_since >= HEALTHY_WATCH_SECONDS:
                    # A watch that ran ended by a new outage, not a longer one. Kept growing, two API server
                    # restarts a minute apart left the agent asleep up to 30 s after the second, the
                    # operator's Hold, Probe or Cleanup unseen meanwhile.
                    backoff = backoff_mod.BASE_SECONDS
                watching_since = None
                # Drawn, not the ceiling itself: a fleet of agents that lost their watches together (an API
                # server restart) must not all come back in the same instant, again and again.
                stop.wait(backoff_mod.jittered_wait(backoff, self.backoff_draw()))
                backoff = backoff_mod.next_ceiling(backoff)


# The dispatch table: how the agent runs each operation type (a unit test checks every type has one).
RUNNERS: dict[OperationType, Runner] = {
    "Preflight": Agent._run_preflight,
    "Hold": Agent._run_hold,
    "Cleanup": Agent._run_cleanup,
    "Probe": Agent._run_probe,
}


def _matrix_summary(matrix: BehaviourMatrix) -> str:
    answered = sum(1 for c in matrix.cells if c.outcome == "answered")
    text = f"behaviour: {answered}/{len(matrix.cells)} cells answered in {matrix.duration_seconds or 0:.2f}s"
    if matrix.truncated:
        text += " (cut by the budget)"
    if matrix.pod_path_error:
        text += f"; pod path: {matrix.pod_path_error}"
    return text


def _settled(facts: KubeProxyFacts | None, mode: str, syncs: int) -> bool:
    """Whether waiting longer can change the gate's answer: kube-proxy runs `mode` and has synced
    `syncs` times since it started, or it runs another mode (the gate fails that at once)."""
    if facts is None or not facts.proxy_mode:
        return False
    return facts.proxy_mode != mode or _synced_in(facts, mode, syncs)


def _synced_in(facts: KubeProxyFacts | None, mode: str, syncs: int) -> bool:
    """Whether kube-proxy runs `mode`, answers /healthz 200 and has synced `syncs` times since it started."""
    if facts is None or facts.proxy_mode != mode:
        return False
    return facts.synced_since_start() and (facts.sync_count or 0) >= syncs and facts.healthz_status == 200


def _meaningful_change(before: KubeProxyFacts | None, after: KubeProxyFacts | None) -> bool:
    """Worth a status write before the heartbeat is due: a new mode, process, health or error."""
    def key(f: KubeProxyFacts | None) -> tuple[Any, ...]:
        return (None,) if f is None else (f.proxy_mode, f.process_start_time, f.healthz_status, bool(f.error))
    return key(before) != key(after)


def parse_args(argv: Sequence[str]) -> AgentConfig:
    p = argparse.ArgumentParser(
        prog="proxyshift agent", description="the proxyshift node agent",
        epilog="one-shot commands for a person on the node: proxyshift agent {inventory,preflight,cleanup,probe} "
               "--help")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    p.add_argument("--metrics-address", default=probe_mod.DEFAULT_METRICS_ADDRESS,
                   help="kube-proxy's metricsBindAddress (/metrics, /proxyMode)")
    p.add_argument("--health-address", default=probe_mod.DEFAULT_HEALTH_ADDRESS,
                   help="kube-proxy's healthzBindAddress (/healthz)")
    p.add_argument("--probe-interval", type=float, default=15.0, help="seconds between probes of kube-proxy")
    p.add_argument("--status-interval", type=float, default=60.0, help="seconds between heartbeats")
    p.add_argument("--inventory-interval", type=float, default=120.0, help="seconds between inventories")
    p.add_argument("--watch-timeout", type=int, default=300, help="seconds before a watch is renewed")
    p.add_argument("--proc-root", default="/proc")
    p.add_argument("--sys-root", default="/sys")
    p.add_argument("--modules-root", default="/lib/modules")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("--context", default=None, help="the kubeconfig context to use (default: its current one)")
    p.add_argument("--listen", default=metrics_mod.DEFAULT_LISTEN,
                   help="HOST:PORT of the agent's own /metrics, /healthz and /readyz (default %(default)s; "
                        "empty: serve none)")
    p.add_argument("--stale-seconds", type=float, default=metrics_mod.DEFAULT_STALE_SECONDS,
                   help="/healthz fails when the loop stalled or no API call succeeded for this long "
                        "(default %(default)s)")
    args = p.parse_args(list(argv))
    if not args.node:
        p.error("--node (or NODE_NAME) is required")
    if args.listen:
        try:
            metrics_mod.parse_listen(args.listen)
        except ValueError as exc:
            p.error(str(exc))
    for flag, seconds in (("--probe-interval", args.probe_interval), ("--status-interval", args.status_interval),
                          ("--inventory-interval", args.inventory_interval), ("--watch-timeout", args.watch_timeout),
                          ("--stale-seconds", args.stale_seconds)):
        if not seconds > 0:
            p.error(f"{flag} must be a positive number of seconds, not {seconds}")
    # Every check and flush reads these: a wrong mount would otherwise show only as odd preflight verdicts.
    for flag, root, marker in (("--proc-root", args.proc_root, "self"), ("--sys-root", args.sys_root, "class")):
        if not (Path(root) / marker).exists():
            p.error(f"{flag} {root}: not a {flag[2:-5]} filesystem (no {marker} in it); mount the host's "
                    f"/{flag[2:-5]} there")
    return AgentConfig(node=args.node, metrics_address=args.metrics_address, health_address=args.health_address,
                       probe_interval=args.probe_interval, status_interval=args.status_interval,
                       inventory_interval=args.inventory_interval, watch_timeout=args.watch_timeout,
                       proc_root=Path(args.proc_root),
                       sys_root=Path(args.sys_root), modules_root=Path(args.modules_root),
                       kubeconfig=args.kubeconfig, context=args.context, listen=args.listen,
                       stale_seconds=args.stale_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """`proxyshift agent --node N` runs the agent; `proxyshift agent <command>` one job (agent/oneshot.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    from proxyshift.agent import oneshot

    if args and args[0] in oneshot.COMMANDS:
        return oneshot.main(args)
    cfg = parse_args(args)
    # The client's loader would end the agent with a traceback; proxyshift.cli prints these as one line.
    with loading(cfg.kubeconfig, cfg.context,
                 where_default=os.environ.get("KUBECONFIG") or "in-cluster or ~/.kube/config"):
        node_api = KubeProxyNodeAPI(kubeconfig=cfg.kubeconfig, context=cfg.context)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(cfg, node_api, kernel_effects(cfg))
    stop = threading.Event()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("agent for node %s: kube-proxy metrics %s, health %s", cfg.node, cfg.metrics_address,
             cfg.health_address)
    server = metrics_mod.serve(cfg.listen, agent.health) if cfg.listen else None
    try:
        agent.run(stop)
    finally:
        if server is not None:
            server.shutdown()
    return 0
