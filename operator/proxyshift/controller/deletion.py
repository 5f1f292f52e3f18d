"""Deletion of a ProxyPolicy: walk its nodes back (deletionPolicy Revert) or let them go (Orphan), and
let the finalizer go once the planner says so (its RemoveFinalizer action).

kopf stops a policy's rollout daemon when its deletion begins, so the delete handler steps itself,
woken by the same changes as the rollout loop, instead of returning after one step and asking kopf to
retry 2 s later: a revert of four nodes took 60 s that way, nearly all of it retry delays.
"""

from __future__ import annotations

import time

import kopf

from proxyshift.controller.reconcile import Indexes, step
from proxyshift.controller.runtime import OperatorRuntime
from proxyshift.planner import world as w

# How long one call of the delete handler keeps stepping before handing back to kopf (which calls it
# again at once).
DELETE_HANDLER_SECONDS = 60.0
# The longest pause between two steps of a deletion: a revert waits on agents and kube-proxy pods.
DELETE_STEP_PAUSE_SECONDS = 2.0


async def finish_deletion(runtime: OperatorRuntime, name: str, indexes: Indexes,
                          seconds: float = DELETE_HANDLER_SECONDS) -> None:
    """Step until the plan removes the finalizer (then return: kopf removes it); after `seconds`, ask kopf
    to call again (kopf.TemporaryError), so one call never holds the handler forever."""
    deadline = time.monotonic() + seconds
    with runtime.wakers.registered(name) as event:
        while True:
            event.clear()
            plan = await step(runtime, name, indexes)
            if any(isinstance(a, w.RemoveFinalizer) for a in plan.actions):
                return
            if time.monotonic() > deadline:
                raise kopf.TemporaryError("reverting nodes before the policy goes away", delay=0.5)
            await runtime.pacing.pause(name, event, min(plan.requeue_after_seconds or DELETE_STEP_PAUSE_SECONDS,
                                                        DELETE_STEP_PAUSE_SECONDS))
