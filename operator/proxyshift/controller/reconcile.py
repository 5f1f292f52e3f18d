"""The reconcile step and the rollout loop: snapshot the caches, ask `planner.plan`, perform its actions.

Each step reads a World from the mirrors (controller/fleet.py) and kopf's indexes, asks the planner for
the next step, performs its actions (idempotent API calls, controller/executor.py) and waits until its
own writes are back in the caches. The rollout loop repeats that until something it watches changes.
Kill the operator at any point and the next one continues from the API objects alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller import metrics
from proxyshift.controller.executor import StepBlocked, Written, announced_elsewhere, in_waves
from proxyshift.controller.fleet import Fleet
from proxyshift.controller.kube import describe_api_error
from proxyshift.controller.runtime import OperatorRuntime
from proxyshift.controller.service_cache import probe_service_ips
from proxyshift.controller.snapshot import baseline_mode, build_world, current_revisions, first, observed
from proxyshift.planner import planner
from proxyshift.planner import world as w

log = logging.getLogger("proxyshift.operator")

# kopf's index stores: key -> the values indexed under it (ours keep one per key).
Store = Mapping[str, Collection[Any]]
INDEX_NAMES = ("policy_index", "baseline_configmap_index", "baseline_daemonset_index")

# How long the loop waits for its own writes to reach its caches before planning anyway. After an API
# server restart the watches re-list; planning on the older view in the meantime re-entered a switch
# (a second switchedAt for one migration, seen in the fault suite with 10 s).
OBSERVE_TIMEOUT_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Indexes:
    """The kopf indexes a step reads (controller/handlers.py declares them), as kopf hands them over. The
    revisions are not among them: the fleet mirrors them (controller/fleet.py says why)."""

    policies: Store
    baseline_configmap: Store
    baseline_daemonset: Store

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Indexes:
        """kopf passes each index as the keyword named after its handler."""
        policies, configmap, daemonset = (kwargs[n] for n in INDEX_NAMES)
        return cls(policies, configmap, daemonset)


async def step(runtime: OperatorRuntime, name: str, indexes: Indexes) -> w.Plan:
    """One level-triggered step for policy `name`: snapshot, plan, perform."""
    fleet, executor = runtime.fleet, runtime.executor
    await fleet.synced()
    planning_started = time.monotonic()
    baseline_cm = first(indexes.baseline_configmap.get("body"))
    baseline_ds = first(indexes.baseline_daemonset.get("body"))
    policies: dict[str, ProxyPolicy] = {
        k: v for k, store in indexes.policies.items() if (v := first(store)) is not None}
    targets, render_errors = current_revisions(policies, baseline_cm, baseline_ds)
    if name in render_errors:
        log.warning("policy %s: %s", name, render_errors[name])
    policy = policies.get(name)
    services = fleet.services()
    view = fleet.view()
    world = build_world(
        policies=policies,
        nodes=view.nodes,
        proxynodes=view.proxynodes,
        revisions=fleet.revision_views(),
        pods=view.pods,
        baseline_mode=baseline_mode(baseline_cm),
        current_revisions=targets,
        render_errors=render_errors,
        service_ips=probe_service_ips(services, policy) if policy else {},
        services=services,
        api_back_at=view.api_back_at,
    )
    report = runtime.compat.report(world, name, baseline_cm) if policy else None
    if report is not None:
        world = dataclasses.replace(world, compat={name: report})
    plan = planner.plan(world, name)
    runtime.pacing.planned(name, time.monotonic() - planning_started)
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

    waves, policy_actions = in_waves(plan.actions, plan.after_others)
    loop = asyncio.get_running_loop()
    try:
        for wave in waves:
            # The pool's size bounds how many nodes' steps run at once; each group is one task in it.
            outcomes = await asyncio.gather(*(loop.run_in_executor(runtime.node_pool, perform, g) for g in wave),
                                            return_exceptions=True)
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                # A slot granted late was freed by a step of the first wave; the policy's status must not
                # describe steps that did not happen.
                raise failed
        await asyncio.to_thread(perform, policy_actions)
    finally:
        # The planner must never act on a world that lacks its own last writes (a stale view would
        # re-issue a switch and move switchedAt): wait for the watch streams to deliver them.
        await wait_observed(fleet, written)
    return plan


async def wait_observed(fleet: Fleet, written: list[Written], timeout: float = OBSERVE_TIMEOUT_SECONDS) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    pending = list(written)
    while pending:
        pending = [item for item in pending if not observed(fleet.seen_version(item), item.resource_version)]
        if not pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            log.warning("writes not yet seen by the watch after %gs: %s", timeout,
                        ", ".join(f"{p.index}/{p.key}" for p in pending[:5]))
            return
        await asyncio.sleep(0.02)


async def rollout_loop(runtime: OperatorRuntime, name: str, indexes: Indexes, stopped: kopf.DaemonStopped,
                       logger: kopf.Logger) -> None:
    """Step, then sleep until something the policy depends on changes; errors cost a pause, never the loop."""
    with runtime.wakers.registered(name) as event, metrics.exported(name):
        while not stopped:
            event.clear()
            delay = runtime.config.idle_requeue_seconds
            try:
                plan = await step(runtime, name, indexes)
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
            await runtime.pacing.pause(name, event, delay)
