"""tests/support/fake_apiserver.py, made live: EndpointSlices change on command.

The dataplane fake serves a world that never changes. The mode benchmark needs
kube-proxy to see an EndpointSlice change the way a real API server sends one
(a MODIFIED watch event carrying `endpoints.kubernetes.io/last-change-trigger-time`,
which kube-proxy turns into kubeproxy_network_programming_duration_seconds), and
it needs kube-proxy's /metrics, which listens on the namespace's loopback. This
process runs inside the benchmark's namespace, so it answers both; the benchmark
drives it with one JSON command per stdin line and reads one JSON answer per
stdout line:

    {"op": "change", "service": 7}   -> {"ok": true, "ip": "198.18.240.1", "t": <epoch>}
    {"op": "metrics"}                -> {"ok": true, "text": "<kube-proxy /metrics>"}

Worlds: fake_apiserver.world(), re-shaped to `endpoints` endpoints per Service.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import sys
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer
from typing import Any

from tests.support import fake_apiserver

TRIGGER = "endpoints.kubernetes.io/last-change-trigger-time"
FIRST_EP = ipaddress.IPv4Address("198.18.16.1")
# New endpoint addresses come from a block the initial world never reaches (10k x 3 ends at
# 198.18.133.x), so "the new IP is in the kernel" can only mean the change was programmed.
CHANGED_EP = ipaddress.IPv4Address("198.18.240.1")


def bench_world(node: str, node_ip: str, services: int, endpoints: int) -> dict[str, list[dict[str, Any]]]:
    objects = fake_apiserver.world(node, node_ip, services)
    for i, eps in enumerate(objects["endpointslices"]):
        template = eps["endpoints"][0]
        eps["endpoints"] = [{**template, "addresses": [str(FIRST_EP + endpoints * i + k)]} for k in range(endpoints)]
    return objects


class Changes:
    """Append-only list of EndpointSlice MODIFIED events; watches wait on it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[dict[str, Any]] = []


def make_handler(objects: dict[str, list[dict[str, Any]]], changes: Changes) -> type:
    base = fake_apiserver.make_handler(objects)

    class Handler(base):  # type: ignore[misc, valid-type]  # base is a class made at run time
        def log_message(self, fmt: str, *args: Any) -> None:
            pass  # 10k-object lists would flood the log; errors still reach stderr via send_error

        def _watch(self, items: list[dict[str, Any]], api_version: str, kind: str, initial: bool,
                   timeout: float) -> None:
            if kind != "EndpointSlice":
                super()._watch(items, api_version, kind, initial, timeout)
                return
            with changes.cond:
                seen = len(changes.events)
            self.start_stream()
            if initial:
                self.send_initial_events(items, api_version, kind, fake_apiserver.RV)
            deadline = time.monotonic() + timeout
            while True:
                with changes.cond:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if len(changes.events) == seen:
                        changes.cond.wait(left)
                    pending = changes.events[seen:]
                    seen = len(changes.events)
                for event in pending:
                    self.send_event(event)
            self.end_stream()

    return Handler


def change(objects: dict[str, list[dict[str, Any]]], changes: Changes, service: int) -> dict[str, Any]:
    """Replace the first endpoint of `service`'s slice by a fresh address, stamped now."""
    with changes.cond:
        n = len(changes.events)
        ip = str(CHANGED_EP + n)
        now = time.time()
        old = objects["endpointslices"][service]
        meta = {**old["metadata"], "resourceVersion": str(int(fake_apiserver.RV) + n + 1),
                "annotations": {TRIGGER: datetime.datetime.fromtimestamp(now, datetime.UTC)
                                .strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
        new = {**old, "metadata": meta,
               "endpoints": [{**old["endpoints"][0], "addresses": [ip]}, *old["endpoints"][1:]]}
        objects["endpointslices"][service] = new  # a relist must see the change too
        changes.events.append({"type": "MODIFIED", "object": new})
        changes.cond.notify_all()
    return {"ok": True, "ip": ip, "t": now}


def metrics(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return {"ok": True, "text": resp.read().decode()}
    except OSError as exc:
        return {"ok": False, "error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=16443)
    p.add_argument("--metrics-port", type=int, default=10249)
    p.add_argument("--node", default="ps-node-1")
    p.add_argument("--node-ip", default="198.18.0.11")
    p.add_argument("--services", type=int, default=1000)
    p.add_argument("--endpoints", type=int, default=3)
    args = p.parse_args(argv)
    objects = bench_world(args.node, args.node_ip, args.services, args.endpoints)
    changes = Changes()
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(objects, changes))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "change":
            answer = change(objects, changes, int(cmd["service"]))
        elif cmd["op"] == "metrics":
            answer = metrics(args.metrics_port)
        else:
            answer = {"ok": False, "error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(answer), flush=True)
    srv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
