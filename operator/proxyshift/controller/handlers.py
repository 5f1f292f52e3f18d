"""kopf handlers: thin. Caches mirror the world; one rollout loop per policy asks the planner.

The fleet-sized kinds (Nodes, kube-proxy pods, ProxyNodes) are kept by controller/mirror.py, the
few others (policies, revisions, the baseline) by kopf indexes. Each loop iteration reads a World
from them, asks `planner.plan` for the
next step, performs its actions (idempotent API calls) and sleeps until
something it watches changes. Kill the operator at any point and the next one
continues from the API objects alone: no state lives only here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller import metrics
from proxyshift.controller.compat_report import CompatCache
from proxyshift.controller.executor import Executor, StepBlocked, Written, announced_elsewhere, by_node
from proxyshift.controller.kube import API_GROUP, API_VERSION, PROXYNODES, ClusterAPI, describe_api_error
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.service_cache import probe_service_ips, service_mirrors, service_world
from proxyshift.controller.settings import CONFIG
from proxyshift.controller.snapshot import (
    build_world,
    current_revisions,
    first,
    kube_proxy_pod_view,
    node_view,
    observed,
    revision_view,
)
from proxyshift.planner import planner
from proxyshift.planner import world as w
from proxyshift.render import LABEL_MANAGED_BY, MANAGED_BY

log = logging.getLogger("proxyshift.operator")
GROUP, VERSION = "proxyshift.io", "v1alpha1"

# policy name -> the events of the loops working on it (the rollout daemon, a deletion handler), set
# whenever something they depend on changes. Only ever touched on the event loop.
_wakers: dict[str, set[asyncio.Event]] = {}
_state: dict[str, Any] = {}
# The fleet-sized kinds, mirrored outside kopf (controller/mirror.py): "nodes", "pods", "proxynodes".
_mirrors: dict[str, Mirror] = {}


def wake(policy: str | None = None) -> None:
    targets = _wakers.get(policy) if policy and policy in _wakers else None
    for events in [targets] if targets is not None else list(_wakers.values()):
        for event in events:
            event.set()


@contextlib.contextmanager
def _waker(name: str) -> Iterator[asyncio.Event]:
    event = asyncio.Event()
    _wakers.setdefault(name, set()).add(event)
    try:
        yield event
    finally:
        events = _wakers.get(name)
        if events is not None:
            events.discard(event)
            if not events:
                _wakers.pop(name, None)


# ---- login and settings ----


KUBE_CONTEXT: str | None = None  # `proxyshift operator --context`; None: the kubeconfig's current context


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG") and not KUBE_CONTEXT


def load_client_config() -> None:
    """Configure the kubernetes client (our writes) the same way kopf logs in (its watches)."""
    if in_cluster():
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), context=KUBE_CONTEXT)


def login_with_context(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """kopf's own kubeconfig login reads only the current context; with --context, log in as the client does.

    The fields are those kopf.login_via_client takes from the client's configuration, which we loaded for
    the named context (login_via_client itself would load the current one again).
    """
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None,
        scheme=scheme or None, token=token or None,
        certificate_path=config.cert_file, private_key_path=config.key_file,
        trust_env=settings.networking.trust_env,
    )


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Log in explicitly: a kubeconfig when one is given, else the pod's service account.

    In a pod, the address comes from KUBERNETES_SERVICE_HOST/PORT (as the official client does), not
    from the name kubernetes.default.svc: it needs no cluster DNS. kopf logs in again on a 401, which
    picks up the rotated projected token.
    """
    load_client_config()
    if in_cluster():
        return kopf.login_via_client(**kwargs)
    if KUBE_CONTEXT:
        return login_with_context(kwargs["settings"])
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base live in the status: annotations would show up as drift in Argo CD.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        field="status.kopf.lastHandledConfiguration"
    )
    settings.persistence.finalizer = "proxyshift.io/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    # Replicas of equal priority all pause (kopf treats them as conflicting): a random priority
    # makes exactly one active, and a standby takes over when its peer's lease lapses.
    settings.peering.priority = CONFIG.peering_priority or random.randint(1, 32767)
    load_client_config()
    _state["api"] = ClusterAPI()
    peering = os.environ.get("PROXYSHIFT_PEERING_ACTIVE")
    if peering:
        # Replicas find each other through this object; creating it here spares users an ordering
        # problem (a custom resource applied in the same `kubectl apply` as its CRD is refused).
        _state["api"].ensure_peering(peering)
    _state["executor"] = Executor(_state["api"])


# ---- mirrors and indexes: the operator's memory of the world ----


def _node_item(obj: dict[str, Any]) -> tuple[str, tuple[w.NodeView, str]] | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        return None
    view = node_view(name, meta.get("labels") or {}, obj.get("spec") or {}, obj.get("status") or {},
                     str(meta.get("resourceVersion", "")))
    return name, (view, str(meta.get("uid") or ""))


def _pod_item(obj: dict[str, Any]) -> tuple[str, w.KubeProxyPodView] | None:
    view = kube_proxy_pod_view(obj)
    meta = obj.get("metadata") or {}
    return (f"{meta.get('namespace')}/{meta.get('name')}", view) if view is not None else None


def _proxynode_item(obj: dict[str, Any]) -> tuple[str, ProxyNode] | None:
    name = (obj.get("metadata") or {}).get("name")
    if not name:
        return None
    try:
        return name, ProxyNode.model_validate(obj)
    except ValidationError as exc:
        log.warning("ProxyNode %s is invalid and is ignored: %s", name, exc)
        return None


def _on_node(_: Mirror, name: str, old: Any, new: Any) -> None:
    wake()
    if new is not None:
        _inventory(name)


def _on_pod(_: Mirror, key: str, old: Any, new: Any) -> None:
    wake()


def _on_proxynode(_: Mirror, name: str, old: ProxyNode | None, new: ProxyNode | None) -> None:
    metrics.record_proxynode(name, new, _state.get("baseline_mode"))
    policies = {pn.spec.policy for pn in (old, new) if pn is not None and pn.spec.policy}
    if not policies:
        wake()  # a ProxyNode no policy holds may be the one a policy waits to take
    for policy in policies:
        wake(policy)


class _NodeUids(Mapping[str, str]):
    """The Executor's node name -> uid (for ownerReferences and Events), read from the node mirror."""

    def __getitem__(self, name: str) -> str:
        return _mirrors["nodes"].items[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(_mirrors["nodes"].items)

    def __len__(self) -> int:
        return len(_mirrors["nodes"].items)


def _inventory(name: str) -> None:
    """Every Node gets a ProxyNode, policy or not: its agent reports the node's real mode and kernel,
    which makes `kubectl get proxynodes` the fleet view and lets `proxyshift plan` predict preflight."""
    nodes, proxynodes = _mirrors.get("nodes"), _mirrors.get("proxynodes")
    pending: set[str] = _state.setdefault("inventory_pending", set())
    if (nodes is None or proxynodes is None or not nodes.synced.is_set() or not proxynodes.synced.is_set()
            or name in proxynodes.items or name in pending or name not in nodes.items or "api" not in _state):
        return
    pending.add(name)
    uid = nodes.items[name][1]

    async def create() -> None:
        try:
            await asyncio.to_thread(_state["api"].ensure_proxynode, name, uid, {}, replace=False)
        except ApiException as exc:
            log.warning("creating the ProxyNode of %s: %s", name, describe_api_error(exc))
        finally:
            pending.discard(name)

    task = asyncio.get_running_loop().create_task(create())
    _state.setdefault("tasks", set()).add(task)
    task.add_done_callback(_state["tasks"].discard)


@kopf.on.startup()
async def start_mirrors(**_: Any) -> None:
    """List+watch Nodes, kube-proxy pods and ProxyNodes outside kopf (see controller/mirror.py)."""
    load_client_config()
    core = kubernetes.client.CoreV1Api()
    custom = kubernetes.client.CustomObjectsApi()
    _mirrors["nodes"] = Mirror("nodes", core.list_node, _node_item, _on_node)
    _mirrors["pods"] = Mirror("pods", core.list_namespaced_pod, _pod_item, _on_pod,
                              args=(CONFIG.kube_proxy_namespace,),
                              kwargs={"label_selector": CONFIG.kube_proxy_pod_label})
    _mirrors["proxynodes"] = Mirror("proxynodes", custom.list_cluster_custom_object, _proxynode_item,
                                    _on_proxynode, args=(API_GROUP, API_VERSION, PROXYNODES))
    _mirrors.update(service_mirrors())
    loop = asyncio.get_running_loop()
    for mirror in _mirrors.values():
        mirror.start(loop)
    executor: Executor | None = _state.get("executor")
    if executor is not None:
        executor.node_uids = _NodeUids()

    async def first_inventory() -> None:
        await asyncio.gather(*(m.synced.wait() for m in _mirrors.values()))
        log.info("mirrors synced: %s", ", ".join(f"{k} {len(m.items)}" for k, m in _mirrors.items()))
        for name in list(_mirrors["nodes"].items):
            _inventory(name)
        wake()

    task = loop.create_task(first_inventory())
    _state.setdefault("tasks", set()).add(task)
    task.add_done_callback(_state["tasks"].discard)


@kopf.on.cleanup()
async def stop_mirrors(**_: Any) -> None:
    for mirror in _mirrors.values():
        mirror.stop()


async def mirrors_synced() -> None:
    await asyncio.gather(*(m.synced.wait() for m in _mirrors.values()))


# Index handlers are coroutines so that they run on the event loop (kopf runs plain functions in a
# thread pool), where wake() may touch asyncio events.
@kopf.index("apps", "v1", "daemonsets", labels={LABEL_MANAGED_BY: MANAGED_BY})
async def revision_index(body: kopf.Body, **_: Any) -> dict[str, w.RevisionView]:
    view = revision_view(body)
    return {view.name: view} if view else {}


@kopf.index(GROUP, VERSION, "proxypolicies")
async def policy_index(name: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> dict[str, ProxyPolicy]:
    try:
        policy = ProxyPolicy.model_validate(dict(body))
    except ValidationError as exc:
        # The CRD's schema and CEL rules refuse such specs; this only guards an older CRD.
        logger.error("ProxyPolicy %s is invalid and is ignored: %s", name, exc)
        return {}
    wake(name)
    return {name: policy}


def _is_baseline(name: str, namespace: str, **_: Any) -> bool:
    return namespace == CONFIG.kube_proxy_namespace and name in (CONFIG.baseline_configmap,
                                                                 CONFIG.baseline_daemonset)


@kopf.index("", "v1", "configmaps", when=_is_baseline)
async def baseline_configmap_index(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    wake()
    configmap = {"metadata": {"name": name, "namespace": CONFIG.kube_proxy_namespace},
                 "data": dict(body.get("data") or {})}
    _baseline_changed(baseline_mode(configmap))
    return {"body": configmap}


def _baseline_changed(mode: str) -> None:
    """ProxyNodes no policy holds should run the baseline's mode: their mode series follow it."""
    if _state.get("baseline_mode") == mode:
        return
    _state["baseline_mode"] = mode
    proxynodes = _mirrors.get("proxynodes")
    for name, pn in list(proxynodes.items.items()) if proxynodes is not None else ():
        metrics.record_proxynode(name, pn, mode)


@kopf.index("apps", "v1", "daemonsets", when=_is_baseline)
async def baseline_daemonset_index(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    wake()
    return {"body": {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}}


def baseline_mode(configmap: dict[str, Any] | None) -> str:
    text = ((configmap or {}).get("data") or {}).get("config.conf", "")
    try:
        # kube-proxy's default mode on Linux is iptables when mode is empty.
        return KubeProxyConfiguration.from_yaml(text).mode or "iptables"
    except ValueError:
        return "iptables"


# ---- the rollout loop ----


def _fleet() -> tuple[dict[str, w.NodeView], dict[str, ProxyNode], dict[str, list[w.KubeProxyPodView]]]:
    nodes = {name: view for name, (view, _) in _mirrors["nodes"].items.items()}
    pods: dict[str, list[w.KubeProxyPodView]] = {}
    for view in _mirrors["pods"].items.values():
        pods.setdefault(view.node, []).append(view)
    return nodes, dict(_mirrors["proxynodes"].items), pods


def _compat_cache() -> CompatCache:
    cache = _state.get("compat")
    if cache is None:
        cache = _state["compat"] = CompatCache()
    return cache


def _node_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for node steps only: the default executor (min(32, CPUs + 4) threads, shared with every
    other to_thread call) would cap PROXYSHIFT_NODE_CONCURRENCY below its setting on a small host."""
    pool = _state.get("node_pool")
    if pool is None:
        pool = _state["node_pool"] = concurrent.futures.ThreadPoolExecutor(
            max(1, CONFIG.node_concurrency), thread_name_prefix="node-steps")
    return pool


async def step(name: str, indexes: dict[str, Any]) -> w.Plan:
    """One level-triggered step: snapshot, plan, perform."""
    await mirrors_synced()
    planning_started = time.monotonic()
    baseline_cm = first(indexes["baseline_configmap_index"].get("body"))
    baseline_ds = first(indexes["baseline_daemonset_index"].get("body"))
    policies = {k: v for k, store in indexes["policy_index"].items() if (v := first(store)) is not None}
    targets, render_errors = current_revisions(policies, baseline_cm, baseline_ds)
    if name in render_errors:
        log.warning("policy %s: %s", name, render_errors[name])
    executor: Executor = _state["executor"]
    policy = policies.get(name)
    services = service_world(_mirrors)
    nodes, proxynodes, pods = _fleet()
    world = build_world(
        policies=policies,
        nodes=nodes,
        proxynodes=proxynodes,
        revisions={k: v for k, store in indexes["revision_index"].items() if (v := first(store)) is not None},
        pods=pods,
        baseline_mode=baseline_mode(baseline_cm),
        current_revisions=targets,
        render_errors=render_errors,
        service_ips=probe_service_ips(services, policy) if policy else {},
        services=services,
    )
    report = _compat_cache().report(world, name, baseline_cm) if policy else None
    if report is not None:
        world = dataclasses.replace(world, compat={name: report})
    plan = planner.plan(world, name)
    _state.setdefault("planning_seconds", {})[name] = time.monotonic() - planning_started
    metrics.record_plan(name, world, plan.actions)
    written: list[Written] = []
    executor.fleet[name] = int(plan.details.get("nodes") or 0)
    told = announced_elsewhere(plan.actions)

    def perform(actions: list[w.Action]) -> None:
        # A node's steps in order, stopping at its first error (the next plan repeats from its record).
        for action in actions:
            announce = (getattr(action, "node", None), action.reason) not in told
            result = executor.perform(action, world.policies, announce=announce)
            if result is not None:
                written.append(result)

    node_groups, policy_actions = by_node(plan.actions)
    loop, pool = asyncio.get_running_loop(), _node_pool()
    try:
        # The pool's size bounds how many nodes' steps run at once; each group is one task in it.
        outcomes = await asyncio.gather(*(loop.run_in_executor(pool, perform, g) for g in node_groups),
                                        return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed  # the policy's status must not describe steps that did not happen
        await asyncio.to_thread(perform, policy_actions)
    finally:
        # The planner must never act on a world that lacks its own last writes (a stale view would
        # re-issue a switch and move switchedAt): wait for the watch streams to deliver them.
        await wait_observed(written)
    return plan


def _index_version(item: Written) -> str | None:
    if item.index == "node_index":
        node = _mirrors["nodes"].items.get(item.key)
        return node[0].resource_version if node is not None else None
    pn = _mirrors["proxynodes"].items.get(item.key)
    return str((pn.metadata or {}).get("resourceVersion", "")) if pn is not None else None


# How long the loop waits for its own writes to reach its caches before planning anyway. After an API
# server restart the watches re-list; planning on the older view in the meantime re-entered a switch
# (a second switchedAt for one migration, seen in the fault suite with 10 s).
OBSERVE_TIMEOUT_SECONDS = 30.0


async def wait_observed(written: list[Written], timeout: float = OBSERVE_TIMEOUT_SECONDS) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    pending = list(written)
    while pending:
        pending = [item for item in pending if not observed(_index_version(item), item.resource_version)]
        if not pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            log.warning("writes not yet seen by the watch after %gs: %s", timeout,
                        ", ".join(f"{p.index}/{p.key}" for p in pending[:5]))
            return
        await asyncio.sleep(0.02)


def _indexes(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("policy_index", "revision_index", "baseline_configmap_index", "baseline_daemonset_index")
    return {n: kwargs[n] for n in names}


async def _pause(name: str, event: asyncio.Event, delay: float) -> None:
    """Sleep until something the policy depends on changes, or `delay` passes.

    Bursts of watch events (our own writes echo back) are batched by a short pause before the next
    plan. The pause follows the cost of planning: as long as the last plan took, at least
    min_requeue_seconds. A small fleet re-plans within milliseconds of an agent's report; a fleet of
    thousands, whose every plan reads the whole world, spends at most about half its time planning.
    """
    batch = max(CONFIG.min_requeue_seconds, _state.get("planning_seconds", {}).get(name, 0.0))
    await asyncio.sleep(min(batch, delay))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=max(0.0, delay - batch))


@contextlib.contextmanager
def _exported(name: str) -> Iterator[None]:
    """The policy's gauges live as long as this replica's loop for it: kopf stops the daemon when the
    policy is deleted (the delete handler steps and exports from then on) and when peering pauses
    this replica, whose last values would otherwise outlive what the active peer reports."""
    try:
        yield
    finally:
        metrics.forget_policy(name)


@kopf.daemon(GROUP, VERSION, "proxypolicies", cancellation_timeout=10)
async def rollout(name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any) -> None:
    indexes = _indexes(kwargs)
    with _waker(name) as event, _exported(name):
        while not stopped:
            event.clear()
            delay = CONFIG.idle_requeue_seconds
            try:
                plan = await step(name, indexes)
                if plan.requeue_after_seconds is not None:
                    delay = plan.requeue_after_seconds
            except StepBlocked as exc:
                logger.info("%s", exc)
                delay = 5.0
            except ApiException as exc:
                metrics.RECONCILE_ERRORS.labels(name, f"api{exc.status}").inc()
                logger.warning("API error in rollout step: %s", describe_api_error(exc))
                delay = 2.0
            except Exception as exc:
                metrics.RECONCILE_ERRORS.labels(name, type(exc).__name__).inc()
                logger.exception("rollout step failed")
                delay = 5.0
            await _pause(name, event, delay)


# How long one call of the delete handler keeps stepping before handing back to kopf (which calls it
# again at once): kopf stops daemons on deletion, so this handler walks the nodes back itself.
DELETE_HANDLER_SECONDS = 60.0


@kopf.on.delete(GROUP, VERSION, "proxypolicies")
async def on_delete(name: str, **kwargs: Any) -> None:
    """Deletion: Revert walks the nodes back to the baseline; the finalizer goes when the planner says so.

    The handler steps like the rollout loop (woken by the same changes) instead of returning after
    each step: a kopf retry costs its delay plus a status patch per step.
    """
    indexes = _indexes(kwargs)
    deadline = time.monotonic() + DELETE_HANDLER_SECONDS
    with _waker(name) as event:
        while True:
            event.clear()
            plan = await step(name, indexes)
            if any(isinstance(a, w.RemoveFinalizer) for a in plan.actions):
                return
            if time.monotonic() > deadline:
                raise kopf.TemporaryError("reverting nodes before the policy goes away", delay=0.5)
            await _pause(name, event, min(plan.requeue_after_seconds or 2.0, 2.0))
    # The baseline DaemonSet keeps its `proxyshift.io/revision DoesNotExist` affinity: it is inert with no
    # revision labels, and undoing it would restart every baseline kube-proxy a second time. Uninstalling
    # applies the inverse recorded on the baseline (docs/migration-guide.md, "Uninstall").
