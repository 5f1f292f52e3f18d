"""kopf handlers: thin. Indexes mirror the world; one rollout loop per policy asks the planner.

Each loop iteration reads a World from the indexes, asks `planner.plan` for the
next step, performs its actions (idempotent API calls) and sleeps until
something it watches changes. Kill the operator at any point and the next one
continues from the API objects alone: no state lives only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller import metrics
from proxyshift.controller.executor import Executor, StepBlocked, Written
from proxyshift.controller.kube import ClusterAPI, describe_api_error
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

# policy name -> event set whenever something the policy's loop depends on changes
_wakers: dict[str, asyncio.Event] = {}
_state: dict[str, Any] = {}


def wake(policy: str | None = None) -> None:
    targets = [_wakers[policy]] if policy and policy in _wakers else list(_wakers.values())
    for event in targets:
        event.set()


# ---- login and settings ----


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG")


def load_client_config() -> None:
    """Configure the kubernetes client (our writes) the same way kopf logs in (its watches)."""
    if in_cluster():
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


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
    settings.peering.priority = int(os.environ.get("PROXYSHIFT_PEERING_PRIORITY") or random.randint(1, 32767))
    load_client_config()
    _state["api"] = ClusterAPI()
    peering = os.environ.get("PROXYSHIFT_PEERING_ACTIVE")
    if peering:
        # Replicas find each other through this object; creating it here spares users an ordering
        # problem (a custom resource applied in the same `kubectl apply` as its CRD is refused).
        _state["api"].ensure_peering(peering)
    _state["executor"] = Executor(_state["api"])


# ---- indexes: the operator's memory of the world ----


@kopf.index("", "v1", "nodes")
def node_index(name: str, labels: dict[str, str], spec: dict[str, Any], status: dict[str, Any], uid: str,
               meta: kopf.Meta, **_: Any) -> dict[str, w.NodeView]:
    executor: Executor | None = _state.get("executor")
    if executor is not None:
        executor.node_uids[name] = uid
    wake()
    return {name: node_view(name, labels, spec, status, str(meta.get("resourceVersion", "")))}


@kopf.index(GROUP, VERSION, "proxynodes")
def proxynode_index(name: str, body: kopf.Body, **_: Any) -> dict[str, ProxyNode]:
    node = ProxyNode.model_validate(dict(body))
    wake(node.spec.policy)
    return {name: node}


@kopf.index("", "v1", "pods", labels={"k8s-app": "kube-proxy"})
def kube_proxy_pod_index(body: kopf.Body, **_: Any) -> dict[str, w.KubeProxyPodView]:
    view = kube_proxy_pod_view(body)
    if view is None:
        return {}
    wake()
    return {view.node: view}


@kopf.index("apps", "v1", "daemonsets", labels={LABEL_MANAGED_BY: MANAGED_BY})
def revision_index(body: kopf.Body, **_: Any) -> dict[str, w.RevisionView]:
    view = revision_view(body)
    return {view.name: view} if view else {}


@kopf.index(GROUP, VERSION, "proxypolicies")
def policy_index(name: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> dict[str, ProxyPolicy]:
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
def baseline_configmap_index(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    wake()
    return {"body": {"metadata": {"name": name, "namespace": CONFIG.kube_proxy_namespace},
                     "data": dict(body.get("data") or {})}}


@kopf.index("apps", "v1", "daemonsets", when=_is_baseline)
def baseline_daemonset_index(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    wake()
    return {"body": {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}}


def baseline_mode(configmap: dict[str, Any] | None) -> str:
    text = ((configmap or {}).get("data") or {}).get("config.conf", "")
    try:
        # kube-proxy's default mode on Linux is iptables when mode is empty.
        return KubeProxyConfiguration.from_yaml(text).mode or "iptables"
    except ValueError:
        return "iptables"


@kopf.on.event("", "v1", "nodes")
async def node_inventory(name: str, uid: str, type: str, proxynode_index: kopf.Index, **_: Any) -> None:
    """Every Node gets a ProxyNode, policy or not: its agent reports the node's real mode and kernel,
    which makes `kubectl get proxynodes` the fleet view and lets `proxyshift plan` predict preflight."""
    if type == "DELETED" or name in proxynode_index or "api" not in _state:
        return
    await asyncio.to_thread(_state["api"].ensure_proxynode, name, uid, {}, replace=False)


# ---- the rollout loop ----


async def step(name: str, indexes: dict[str, Any]) -> w.Plan:
    """One level-triggered step: snapshot, plan, perform."""
    baseline_cm = first(indexes["baseline_configmap_index"].get("body"))
    baseline_ds = first(indexes["baseline_daemonset_index"].get("body"))
    policies = {k: v for k, store in indexes["policy_index"].items() if (v := first(store)) is not None}
    targets, render_errors = current_revisions(policies, baseline_cm, baseline_ds)
    if name in render_errors:
        log.warning("policy %s: %s", name, render_errors[name])
    executor: Executor = _state["executor"]
    policy = policies.get(name)
    service_ips = await asyncio.to_thread(executor.api.service_ips, policy) if policy else {}
    world = build_world(
        policies=policies,
        nodes=indexes["node_index"],
        proxynodes=indexes["proxynode_index"],
        revisions=indexes["revision_index"],
        pods=indexes["kube_proxy_pod_index"],
        baseline_mode=baseline_mode(baseline_cm),
        current_revisions=targets,
        service_ips=service_ips,
    )
    plan = planner.plan(world, name)
    metrics.record_plan(name, world, plan.actions)
    written: list[Written] = []
    try:
        for action in plan.actions:
            result = await asyncio.to_thread(executor.perform, action, world.policies)
            if result is not None:
                written.append(result)
    finally:
        # The planner must never act on a world that lacks its own last writes (a stale view would
        # re-issue a switch and move switchedAt): wait for the watch streams to deliver them.
        await wait_observed(written, indexes)
    return plan


def _index_version(indexes: dict[str, Any], item: Written) -> str | None:
    value = first(indexes[item.index].get(item.key))
    if value is None:
        return None
    if isinstance(value, w.NodeView):
        return value.resource_version
    return str((getattr(value, "metadata", None) or {}).get("resourceVersion", ""))


async def wait_observed(written: list[Written], indexes: dict[str, Any], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    pending = list(written)
    while pending:
        pending = [item for item in pending if not observed(_index_version(indexes, item), item.resource_version)]
        if not pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            log.warning("writes not yet seen by the watch after %gs: %s", timeout,
                        ", ".join(f"{p.index}/{p.key}" for p in pending[:5]))
            return
        await asyncio.sleep(0.05)


def _indexes(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("policy_index", "node_index", "proxynode_index", "revision_index", "kube_proxy_pod_index",
             "baseline_configmap_index", "baseline_daemonset_index")
    return {n: kwargs[n] for n in names}


@kopf.daemon(GROUP, VERSION, "proxypolicies", cancellation_timeout=10)
async def rollout(name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any) -> None:
    event = _wakers.setdefault(name, asyncio.Event())
    indexes = _indexes(kwargs)
    try:
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
            # Batch bursts of watch events (our own writes echo back) before planning again.
            await asyncio.sleep(CONFIG.min_requeue_seconds)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=max(0.0, delay - CONFIG.min_requeue_seconds))
    finally:
        _wakers.pop(name, None)


@kopf.on.delete(GROUP, VERSION, "proxypolicies")
async def on_delete(name: str, **kwargs: Any) -> None:
    """Deletion: Revert walks the nodes back to the baseline; the finalizer goes when the planner says so."""
    indexes = _indexes(kwargs)
    plan = await step(name, indexes)
    if not any(isinstance(a, w.RemoveFinalizer) for a in plan.actions):
        raise kopf.TemporaryError("reverting nodes before the policy goes away", delay=2)
    # The baseline DaemonSet keeps its `proxyshift.io/revision DoesNotExist` affinity: it is inert with no
    # revision labels, and undoing it would restart every baseline kube-proxy a second time. Uninstalling
    # applies the inverse recorded on the baseline (docs/migration-guide.md, "Uninstall").
