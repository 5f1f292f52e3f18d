"""Every Node gets a ProxyNode, policy or not: its agent reports the node's real mode and kernel, which
makes `kubectl get proxynodes` the fleet view and lets `proxyshift plan` predict preflight."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from proxyshift.controller.fleet import NODES, PROXYNODE_MIRROR, Fleet
from proxyshift.controller.kube import ClusterAPI, describe_api_error

log = logging.getLogger("proxyshift.operator")

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass
class Inventory:
    """Creates the missing ProxyNode of a Node (owned by it, so it goes with it), once at a time per node."""

    fleet: Fleet
    api: ClusterAPI
    spawn: Spawn  # runs a coroutine in the background, keeping a reference until it ends
    pending: set[str] = field(default_factory=set)  # nodes whose ProxyNode is being created

    def ensure(self, name: str) -> None:
        """Called on the event loop; before both mirrors are synced, a missing ProxyNode may just be unread."""
        if not self.fleet.is_synced(NODES, PROXYNODE_MIRROR):
            return
        nodes, proxynodes = self.fleet.mirrors[NODES], self.fleet.mirrors[PROXYNODE_MIRROR]
        if name in proxynodes.items or name in self.pending or name not in nodes.items:
            return
        self.pending.add(name)
        uid = nodes.items[name][1]

        async def create() -> None:
            try:
                await asyncio.to_thread(self.api.ensure_proxynode, name, uid, {}, replace=False)
            except ApiException as exc:
                log.warning("creating the ProxyNode of %s: %s", name, describe_api_error(exc))
            finally:
                self.pending.discard(name)

        self.spawn(create())
