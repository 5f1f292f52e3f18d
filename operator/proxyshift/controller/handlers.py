"""kopf handlers: wiring only. Each decorated function finds the runtime in kopf's memo and calls into
a module with one job: login (controller/login.py), the fleet's caches (fleet.py, inventory.py), the
reconcile step and the rollout loop (reconcile.py), wakeups and pacing (wakeups.py), deletion
(deletion.py).

The handlers' names are their kopf ids (progress and diff-base in the policy's status, the index
keywords), and the finalizer and index names are in the policies' stored state: renaming any of them
would strand what an operator upgraded in place left behind. tests/unit/test_handlers.py pins them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import kopf
from pydantic import ValidationError

from proxyshift.api import schema_drift
from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller import login as login_to
from proxyshift.controller.deletion import finish_deletion
from proxyshift.controller.kube import ClusterAPI
from proxyshift.controller.reconcile import Indexes, rollout_loop
from proxyshift.controller.runtime import MEMO_KEY, OperatorRuntime, kube_context_of, peering_of, runtime_of
from proxyshift.controller.settings import CONFIG, FINALIZER
from proxyshift.controller.snapshot import baseline_mode

GROUP, VERSION = "proxyshift.io", "v1alpha1"


# ---- the operator: login, start-up, shutdown ----


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Log in explicitly: a kubeconfig when one is given, else the pod's service account (login.py)."""
    return login_to.connection_info(kube_context_of(memo), memo=memo, **kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base live in the status: annotations would show up as drift in Argo CD.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        field="status.kopf.lastHandledConfiguration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    # Replicas of equal priority all pause (kopf treats them as conflicting): a random priority
    # makes exactly one active, and a standby takes over when its peer's lease lapses.
    settings.peering.priority = CONFIG.peering_priority or random.randint(1, 32767)
    # The operator serves kube-proxy's namespace only (main.py), where it may read ConfigMaps and
    # DaemonSets. kopf would list and watch every Namespace to find it (refused: the name is exact, it
    # needs no finding) and every CRD to notice new ones; with scanning off it serves the namespace as
    # named and the resources the API server serves at start, which the check below makes sure of.
    settings.scanning.disabled = True
    # One ClusterKopfPeering for all replicas, as when the operator was cluster-wide (kopf would use a
    # KopfPeering in each served namespace).
    settings.peering.clusterwide = True
    login_to.load_client_config(kube_context_of(memo))
    api = ClusterAPI()
    peering = peering_of(memo)
    missing = api.unserved_resources(with_peering=bool(peering))
    if missing:
        # kopf retries the startup; without scanning, a CRD created after the start would go unserved.
        raise kopf.TemporaryError(f"the API server does not serve {', '.join(missing)} yet: install the CRDs "
                                  "(crds/); waiting", delay=STARTUP_WAIT_SECONDS)
    _check_served_schemas(api)
    if peering:
        # Replicas find each other through this object; creating it here spares users an ordering
        # problem (a custom resource applied in the same `kubectl apply` as its CRD is refused).
        api.ensure_peering(peering)
    memo[MEMO_KEY] = OperatorRuntime.create(api)


# How often a start that found old CRDs looks again: an upgrade of the CRDs is a person's step.
CRD_DRIFT_RETRY_SECONDS = 15
# How often a start waiting for something that comes by itself (the CRDs served, the `configure` handler) looks.
STARTUP_WAIT_SECONDS = 5


def _check_served_schemas(api: ClusterAPI) -> None:
    """Wait (kopf retries the startup) while the served CRDs cannot hold what this version writes: an old
    CRD's API server drops new fields without an error (api/schema_drift.py)."""
    from proxyshift import __version__

    document = api.served_openapi()
    if document is None:
        return  # told by served_openapi; an API server without OpenAPI v3 still serves the operator
    drifts = schema_drift.crd_drift(document)
    if drifts:
        raise kopf.TemporaryError(
            f"the proxyshift CRDs this API server serves are older than this operator ({__version__}): "
            f"{schema_drift.describe(drifts)}. Upgrade them with `{schema_drift.UPGRADE_COMMAND}` "
            "(Helm never upgrades a chart's crds/); waiting", delay=CRD_DRIFT_RETRY_SECONDS)


@kopf.on.startup()
async def start_mirrors(memo: kopf.Memo, **_: Any) -> None:
    """List+watch Nodes, kube-proxy pods, ProxyNodes and the Services side outside kopf (controller/mirror.py)."""
    if not isinstance(memo.get(MEMO_KEY), OperatorRuntime):
        # kopf runs every startup handler each round and retries each on its own: while `configure` waits (for
        # the CRDs, above), this one waits too, told in one line and soon after, not kopf's minute and traceback.
        raise kopf.TemporaryError("waiting for the startup handler 'configure'", delay=STARTUP_WAIT_SECONDS)
    login_to.load_client_config(kube_context_of(memo))
    runtime_of(memo).start_fleet(asyncio.get_running_loop())


@kopf.on.cleanup()
async def stop_mirrors(memo: kopf.Memo, **_: Any) -> None:
    runtime = memo.get(MEMO_KEY)
    if isinstance(runtime, OperatorRuntime):  # absent when the start-up failed
        runtime.fleet.stop()
        if runtime.executor.events is not None:
            await asyncio.to_thread(runtime.executor.events.close)


# ---- indexes: the few kinds kopf keeps for us ----
# Index handlers are coroutines so that they run on the event loop (kopf runs plain functions in a
# thread pool), where waking a loop may touch asyncio events.


@kopf.index(GROUP, VERSION, "proxypolicies")
async def policy_index(name: str, body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo,
                       **_: Any) -> dict[str, ProxyPolicy]:
    try:
        policy = ProxyPolicy.model_validate(dict(body))
    except ValidationError as exc:
        # The CRD's schema and CEL rules refuse such specs; this only guards an older CRD.
        logger.error("ProxyPolicy %s is invalid and is ignored: %s", name, exc)
        return {}
    runtime_of(memo).wakers.wake(name)
    return {name: policy}


def _is_baseline(name: str, namespace: str | None, **_: Any) -> bool:
    return namespace == CONFIG.kube_proxy_namespace and name in (CONFIG.baseline_configmap,
                                                                 CONFIG.baseline_daemonset)


@kopf.index("", "v1", "configmaps", when=_is_baseline)
async def baseline_configmap_index(name: str, body: kopf.Body, memo: kopf.Memo,
                                   **_: Any) -> dict[str, dict[str, Any]]:
    runtime = runtime_of(memo)
    runtime.wakers.wake()
    configmap = {"metadata": {"name": name, "namespace": CONFIG.kube_proxy_namespace},
                 "data": dict(body.get("data") or {})}
    runtime.executor.kept.saw("configmap", json.dumps(configmap["data"], sort_keys=True))
    runtime.fleet.baseline_changed(baseline_mode(configmap))
    return {"body": configmap}


@kopf.index("apps", "v1", "daemonsets", when=_is_baseline)
async def baseline_daemonset_index(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
    runtime = runtime_of(memo)
    runtime.wakers.wake()
    runtime.executor.kept.saw("daemonset", body.get("metadata", {}).get("generation"))
    return {"body": {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}}


# ---- policies: the rollout loop and the deletion ----


@kopf.daemon(GROUP, VERSION, "proxypolicies", cancellation_timeout=10)
async def rollout(name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, memo: kopf.Memo,
                  **kwargs: Any) -> None:
    await rollout_loop(runtime_of(memo), name, Indexes.from_kwargs(kwargs), stopped, logger)


@kopf.on.delete(GROUP, VERSION, "proxypolicies")
async def on_delete(name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """Deletion: Revert walks the nodes back to the baseline; the finalizer goes when the planner says so."""
    await finish_deletion(runtime_of(memo), name, Indexes.from_kwargs(kwargs))
    # The baseline DaemonSet keeps its `proxyshift.io/revision DoesNotExist` affinity: it is inert with no
    # revision labels, and undoing it would restart every baseline kube-proxy a second time. Uninstalling
    # applies the inverse recorded on the baseline (docs/migration-guide.md, "Uninstall").
