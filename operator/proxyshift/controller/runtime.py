"""The operator's runtime: everything it keeps in memory while it runs, in one typed object.

Made by the startup handler (controller/handlers.py `configure`) and kept in kopf's operator memo,
whose shallow copy every resource handler receives as `memo`: the handlers reach the runtime through
`runtime_of(memo)`, and nothing in controller/ keeps state at module level. Nothing here is the
truth: kill the operator at any point and the next one rebuilds all of it from the API objects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxyshift.controller.compat_report import CompatCache
from proxyshift.controller.event_sender import EventSender
from proxyshift.controller.executor import Executor
from proxyshift.controller.fleet import NODES, Fleet
from proxyshift.controller.inventory import Inventory
from proxyshift.controller.kube import ClusterAPI
from proxyshift.controller.settings import CONFIG, OperatorConfig
from proxyshift.controller.wakeups import Pacing, Wakers

log = logging.getLogger("proxyshift.operator")

MEMO_KEY = "runtime"
# `proxyshift operator --context`, put in the operator memo by main.py (None: the kubeconfig's current one).
MEMO_KUBE_CONTEXT = "kube_context"
# `proxyshift operator --peering`, put in the memo by main.py; None with --standalone (no peering).
MEMO_PEERING = "peering"


@dataclass
class BackgroundTasks:
    """Tasks the operator starts and does not await (ProxyNode creation, the first inventory): asyncio
    keeps only weak references to running tasks, so they are held here until they end."""

    running: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)


@dataclass
class OperatorRuntime:
    config: OperatorConfig
    api: ClusterAPI
    executor: Executor
    wakers: Wakers
    pacing: Pacing
    fleet: Fleet
    inventory: Inventory
    compat: CompatCache
    # Threads for node steps only: the default executor (min(32, CPUs + 4) threads, shared with every
    # other to_thread call) would cap PROXYSHIFT_NODE_CONCURRENCY below its setting on a small host.
    node_pool: concurrent.futures.ThreadPoolExecutor
    tasks: BackgroundTasks

    @classmethod
    def create(cls, api: ClusterAPI, config: OperatorConfig = CONFIG, executor: Executor | None = None
               ) -> OperatorRuntime:
        wakers, tasks = Wakers(), BackgroundTasks()
        fleet = Fleet(wakers)
        inventory = Inventory(fleet, api, tasks.spawn)
        fleet.on_node = inventory.ensure
        if executor is None:
            executor = Executor(api, config=config, events=EventSender(api.emit_event))
        executor.node_uids = fleet.node_uids
        kept = executor.kept
        fleet.on_revision_daemonset = lambda revision, generation: kept.saw("daemonset", generation, revision)
        return cls(
            config=config, api=api, executor=executor, wakers=wakers, pacing=Pacing(config.min_requeue_seconds),
            fleet=fleet, inventory=inventory, compat=CompatCache(),
            node_pool=concurrent.futures.ThreadPoolExecutor(max(1, config.node_concurrency),
                                                            thread_name_prefix="node-steps"),
            tasks=tasks,
        )

    def start_fleet(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the mirrors (built by the caller, or here); once all are synced, take the first inventory."""
        if not self.fleet.mirrors:
            self.fleet.build(self.config)
        self.fleet.start(loop)

        async def first_inventory() -> None:
            await self.fleet.synced()
            log.info("mirrors synced: %s", self.fleet.describe())
            for name in list(self.fleet.mirrors[NODES].items):
                self.inventory.ensure(name)
            self.wakers.wake()

        self.tasks.spawn(first_inventory())


def runtime_of(memo: Mapping[str, Any]) -> OperatorRuntime:
    """The runtime from a kopf memo (the operator's, or a resource's shallow copy of it)."""
    runtime = memo.get(MEMO_KEY)
    if not isinstance(runtime, OperatorRuntime):
        raise RuntimeError("the operator runtime is missing from kopf's memo: the startup handler did not run")
    return runtime


def kube_context_of(memo: Mapping[str, Any]) -> str | None:
    context = memo.get(MEMO_KUBE_CONTEXT)
    return str(context) if context else None


def peering_of(memo: Mapping[str, Any]) -> str | None:
    """The ClusterKopfPeering's name the operator takes part in, None when it runs standalone."""
    peering = memo.get(MEMO_PEERING)
    return str(peering) if peering else None
