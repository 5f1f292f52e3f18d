"""Lean list+watch caches of the fleet-sized kinds: Nodes, kube-proxy pods, ProxyNodes.

kopf gives every watched object its own worker task, and with indexes every one of those workers
waits on one shared toggle set until all indexes are filled: each new or finished toggle wakes all
waiters, which is quadratic in the number of objects (5,000 nodes = 15,000 objects never got past
start-up, docs/benchmarks.md). These kinds need no handlers, only a current view, so they are
mirrored here instead: one thread per kind lists (paged) and watches with the plain client, parses
each object into the small view the planner needs (the full bodies are dropped at once), and hands
the result to the event loop, where all stores are changed. The loop is the only writer, so the
rollout step reads consistent dicts without locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from proxyshift.controller.rest import Collection

log = logging.getLogger("proxyshift.mirror")

LIST_PAGE = 500
WATCH_SECONDS = 300
RETRY_SECONDS = 2.0

# (raw object) -> (key, value) or None to ignore the object; runs on the watch thread.
ViewFn = Callable[[dict[str, Any]], "tuple[str, Any] | None"]
# (Mirror, key, old value or None, new value or None); runs on the event loop after the store changed.
ChangeFn = Callable[["Mirror", str, Any, Any], None]


@dataclass
class Mirror:
    """One kind, kept current by a thread; `items` is changed only on the event loop."""

    name: str
    list_fn: Callable[..., Any]  # rest.Collection.list, or a client's list_* method, with watch/paging args
    view: ViewFn
    on_change: ChangeFn
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    items: dict[str, Any] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    # When a list first succeeded after the API server could not be reached (event-loop side).
    reconnected_at: datetime | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"mirror-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # ---- event-loop side ----

    def _replace_all(self, fresh: dict[str, Any]) -> None:
        """After a (re-)list: the listed state is the truth; report what changed against the old store."""
        old = self.items
        self.items = fresh
        for key in old.keys() - fresh.keys():
            self.on_change(self, key, old[key], None)
        for key, value in fresh.items():
            if old.get(key) is not value:
                self.on_change(self, key, old.get(key), value)
        self.synced.set()

    def _reconnected(self, moment: datetime) -> None:
        self.reconnected_at = moment

    def _apply(self, key: str, value: Any) -> None:
        old = self.items.get(key)
        if value is None:
            self.items.pop(key, None)
        else:
            self.items[key] = value
        self.on_change(self, key, old, value)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # ---- watch thread ----

    def _run(self) -> None:
        client = kubernetes.client.ApiClient()  # one per thread: the client's pool is not shared
        api = self.list_fn.__self__  # type: ignore[attr-defined]  # list_fn is a bound method of an API class
        # A rest.Collection (what the operator lists) or a class constructed with a client (a typed API).
        again = api.for_client(client) if isinstance(api, Collection) else type(api)(client)
        bound = getattr(again, self.list_fn.__name__)
        unreachable = False
        while not self._stop.is_set():
            try:
                version: str | None = self._list(bound)
                if unreachable:
                    self._post(self._reconnected, datetime.now(UTC))
                    unreachable = False
                while not self._stop.is_set() and version is not None:
                    version = self._watch(bound, version)
            except ApiException as exc:
                log.warning("mirror %s: API error %s %s; listing again", self.name, exc.status, exc.reason)
                self._stop.wait(RETRY_SECONDS)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                # Refused, reset or timed out: the API server is away (restarting, or the network).
                log.warning("mirror %s: API server unreachable (%s); listing again", self.name, exc)
                unreachable = True
                self._stop.wait(RETRY_SECONDS)
            except Exception:  # the mirror must outlive any one bad response
                log.exception("mirror %s failed; listing again", self.name)
                self._stop.wait(RETRY_SECONDS)

    def _list(self, fn: Callable[..., Any]) -> str:
        fresh: dict[str, Any] = {}
        token: str | None = None
        while True:
            kwargs = dict(self.kwargs, limit=LIST_PAGE, _preload_content=False, _request_timeout=(10, 120))
            if token:
                kwargs["_continue"] = token
            page = json.loads(fn(*self.args, **kwargs).data)
            for item in page.get("items") or []:
                found = self.view(item)
                if found is not None:
                    fresh[found[0]] = found[1]
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                self._post(self._replace_all, fresh)
                return str(meta.get("resourceVersion") or "")

    def _watch(self, fn: Callable[..., Any], version: str) -> str | None:
        """Watch from `version` until the server ends the stream; the version to go on from, or None to re-list."""
        resp = fn(*self.args, **self.kwargs, watch=True, resource_version=version, allow_watch_bookmarks=True,
                  timeout_seconds=WATCH_SECONDS, _preload_content=False, _request_timeout=(10, WATCH_SECONDS + 30))
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return None
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    # 410 Gone: our version is too old to resume from; anything else: start over too.
                    log.info("mirror %s: watch error %s; listing again", self.name, obj.get("code"))
                    return None
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                found = self.view(obj)
                if kind == "DELETED":
                    if found is not None:
                        self._post(self._apply, found[0], None)
                elif found is not None:
                    self._post(self._apply, found[0], found[1])
                else:
                    # An object that no longer qualifies (e.g. a pod that lost its node) leaves the store.
                    key = self._key_of(obj)
                    if key is not None:
                        self._post(self._apply, key, None)
        finally:
            resp.close()
            resp.release_conn()
        return version

    def _key_of(self, obj: dict[str, Any]) -> str | None:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace')}/{meta.get('name')}" if meta.get("namespace") else meta.get("name")
