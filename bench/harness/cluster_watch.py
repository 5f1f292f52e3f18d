"""What the cluster benchmarks' watches saw, stamped with the bench's own monotonic clock.

The rollout benchmarks (bench_rollout_overhead, bench_cilium_kpr) time a rollout by what their own watches
deliver: Nodes' revision labels, data-plane pods, ProxyNode phases, the policy's Ready and its deletion. The
pieces both need live here: a watch that never ends (`stream`), a pod's readiness, the pod record both keep,
the policy watch, and `Changes`, the lock and condition their records hang on, with a wait on a predicate.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import kubernetes
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from proxyshift.api.common import API_GROUP as GROUP
from proxyshift.api.common import API_VERSION as VERSION

WATCH_SECONDS = 120  # each watch call's server-side timeout; the stream then re-watches


def say(message: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Changes:
    """The lock every record is written under, and a condition noted after each watch event."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(default_factory=threading.Condition)
    # policy name/uid -> Ready observed for its generation at; policy name -> gone at
    policy_ready: dict[str, float] = field(default_factory=dict)
    policy_gone: dict[str, float] = field(default_factory=dict)

    def note(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """The predicate's first true value (evaluated under the lock after each change), or TimeoutError."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                with self.lock:
                    value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} not seen within {timeout:g}s")
                self.changed.wait(min(left, 1.0))


def stream(list_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Watch forever (re-listing after an error or an expired resourceVersion), as plain dicts."""
    while True:
        try:
            for event in watch.Watch().stream(list_fn, *args, timeout_seconds=WATCH_SECONDS, **kwargs):
                obj = event["object"]
                if not isinstance(obj, dict):
                    obj = kubernetes.client.ApiClient().sanitize_for_serialization(obj)
                yield event["type"], obj
        except (ApiException, OSError, ValueError) as exc:
            say(f"watch restarted: {exc}")
            time.sleep(0.5)


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def record_pod(pods: dict[str, dict[str, Any]], kind: str, pod: dict[str, Any], now: float) -> dict[str, Any]:
    """Keep a pod's first sightings: `first`, `node`, `deleting`, `gone`, `running`, `ready` (call under the
    lock). Returns its record, for what a bench keeps besides."""
    meta = pod.get("metadata") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    rec = pods.setdefault(meta.get("name", ""), {"node": node, "first": now})
    rec["node"] = rec.get("node") or node
    if (kind == "DELETED" or meta.get("deletionTimestamp")) and "deleting" not in rec:
        rec["deleting"] = now
    if kind == "DELETED":
        rec.setdefault("gone", now)
    live = kind != "DELETED" and not meta.get("deletionTimestamp")
    if live and (pod.get("status") or {}).get("phase") == "Running" and "running" not in rec:
        rec["running"] = now
    if live and pod_ready(pod) and "ready" not in rec:
        rec["ready"] = now
    return rec


def watch_policies(custom: kubernetes.client.CustomObjectsApi, seen: Changes) -> None:
    """Each ProxyPolicy's Ready (for its current generation, once per name/uid) and its deletion."""
    for kind, body in stream(custom.list_cluster_custom_object, GROUP, VERSION, "proxypolicies"):
        meta = body.get("metadata") or {}
        name, now = meta.get("name", ""), time.monotonic()
        status = body.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        with seen.lock:
            if kind == "DELETED":
                seen.policy_gone[name] = now
            elif ready and status.get("observedGeneration") == meta.get("generation"):
                seen.policy_ready.setdefault(f"{name}/{meta.get('uid')}", now)
        seen.note()
