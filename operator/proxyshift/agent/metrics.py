"""The node agent's own Prometheus metrics and health, served on `--listen` (default 0.0.0.0:9811).

    GET /metrics  the proxyshift_agent_* series below (prometheus_client's text format)
    GET /healthz  200 while the loop turns and the API server answered recently, else 503 (liveness)
    GET /readyz   200 once the agent has heard from the API server and /healthz holds, else 503 (readiness)

The port sits beside the probe server's 9810 and away from kube-proxy's 10249/10256: the agent runs on
the host network, so it shares the node's ports. Recording goes through the functions here, called
from a few places in agent/loop.py; Health is pure (a clock and timestamps) so tests drive it.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter

log = logging.getLogger("proxyshift.agent.metrics")

DEFAULT_LISTEN = "0.0.0.0:9811"
# Longer than any gap a healthy agent leaves: it writes a heartbeat every status interval (60 s), its
# watch ends every watch timeout (300 s) and, before its ProxyNode exists, it GETs every 10 s.
DEFAULT_STALE_SECONDS = 600.0

OPERATIONS = PromCounter(
    "proxyshift_agent_operations_total",
    "Operations this agent finished, by type (Preflight, Cleanup, Hold, Probe) and result (succeeded, failed).",
    ("type", "result"),  # tuples: test_dockerfile reads literal lists in agent/ as argv
)
OPERATION_SECONDS = Histogram(
    "proxyshift_agent_operation_duration_seconds",
    "Wall time of one operation, from its Running write to its result.",
    ("type",),
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
FLUSH_SECONDS = Histogram(
    "proxyshift_agent_flush_duration_seconds",
    "Wall time of one flush of the removed modes' objects (the body of a Cleanup).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PROBE_SECONDS = Histogram(
    "proxyshift_agent_kube_proxy_probe_duration_seconds",
    "Wall time of one probe of the node's kube-proxy (/metrics, /proxyMode, /healthz).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
ERRORS = PromCounter(
    "proxyshift_agent_errors_total",
    "Failures the agent survived, by where: status_write (a status patch the API server refused or did not "
    "answer), watch (the ProxyNode GET or watch), loop (a loop step that raised; retried), operation (an "
    "operation that raised; reported Failed), kube_proxy_probe (kube-proxy did not answer in full).",
    ("where",),
)
LAST_STATUS_WRITE = Gauge(
    "proxyshift_agent_last_status_write_timestamp_seconds",
    "When this agent last wrote its ProxyNode status (Unix time, the agent's clock); 0 before the first write.",
)
HEARTBEAT_AGE = Gauge(
    "proxyshift_agent_heartbeat_age_seconds",
    "Seconds since this agent last wrote its ProxyNode status (since it started, before its first write).",
)

ERROR_PLACES = ("status_write", "watch", "loop", "operation", "kube_proxy_probe")
for _where in ERROR_PLACES:
    ERRORS.labels(_where)  # exported at 0, so rate() and increase() see the first error


@dataclass
class Health:
    """What /healthz, /readyz and the heartbeat age are computed from: timestamps on the agent's clock."""

    clock: Callable[[], float] = time.time
    stale_after: float = DEFAULT_STALE_SECONDS
    started: float = field(default=math.nan)
    last_loop: float | None = None  # the run loop last began a step
    last_contact: float | None = None  # the API server last answered a GET, a watch or a status write
    last_write: float | None = None  # the last status write that succeeded

    def __post_init__(self) -> None:
        if math.isnan(self.started):
            self.started = self.clock()

    def loop_turned(self) -> None:
        self.last_loop = self.clock()

    def contact(self) -> None:
        self.last_contact = self.clock()

    def wrote(self) -> None:
        self.last_write = self.last_contact = self.clock()

    def heartbeat_age(self) -> float:
        return self.clock() - (self.started if self.last_write is None else self.last_write)

    def live(self) -> tuple[bool, str]:
        """Alive: the loop turned and the API server answered within stale_after (or since the start)."""
        now = self.clock()
        loop = self.started if self.last_loop is None else self.last_loop
        if now - loop > self.stale_after:
            return False, f"the agent loop has not turned for {now - loop:.0f}s"
        contact = self.started if self.last_contact is None else self.last_contact
        if now - contact > self.stale_after:
            return False, f"no successful API call (status write, GET or watch) for {now - contact:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Ready: alive, and the API server has answered at least once (the agent read or looked for its
        ProxyNode): an agent that never reached it cannot run an operation."""
        if self.last_contact is None:
            return False, "the API server has not answered yet"
        return self.live()


def record_operation(op_type: str, state: str, seconds: float) -> None:
    OPERATIONS.labels(op_type, state.lower()).inc()
    OPERATION_SECONDS.labels(op_type).observe(max(seconds, 0.0))


def record_error(where: str) -> None:
    ERRORS.labels(where).inc()


def record_status_write(health: Health) -> None:
    health.wrote()
    assert health.last_write is not None
    LAST_STATUS_WRITE.set(health.last_write)


def track_heartbeat(health: Health) -> None:
    """Make the heartbeat age gauge read this agent's Health at every scrape (one agent per process)."""
    HEARTBEAT_AGE.set_function(health.heartbeat_age)


def parse_listen(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen wants HOST:PORT, not {address!r}")
    return host.strip("[]"), int(port)


def respond(path: str, health: Health, registry: CollectorRegistry = REGISTRY) -> tuple[int, str, bytes]:
    """(status, content type, body) for a GET of `path`: the server's whole logic, without a socket."""
    route = path.split("?", 1)[0]
    if route == "/metrics":
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
    if route in ("/healthz", "/livez", "/readyz"):
        ok, why = health.ready() if route == "/readyz" else health.live()
        return (200 if ok else 503), "text/plain; charset=utf-8", (why + "\n").encode()
    return 404, "text/plain; charset=utf-8", b"not found: /metrics, /healthz, /readyz\n"


BIND_WAIT_SECONDS = 30.0


def _bind(host: str, port: int, handler: type[BaseHTTPRequestHandler],
          wait: float = BIND_WAIT_SECONDS) -> ThreadingHTTPServer:
    """Bind, waiting a while for a port still held: on the host network the agent this one replaces (a
    DaemonSet rollout) may not have closed its socket yet. A port held longer is a real conflict."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            log.warning("port %d is still in use (the agent this one replaces?); trying again", port)
            time.sleep(1.0)


def serve(address: str, health: Health) -> ThreadingHTTPServer:
    """Start the metrics and health server on a daemon thread; raises OSError if the port is taken."""
    host, port = parse_listen(address)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, content_type, body = respond(self.path, health)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a kubelet probe every few seconds and a scrape every 30 s are not worth a log line

    server = _bind(host, port, Handler)
    server.daemon_threads = True
    track_heartbeat(health)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    log.info("agent metrics and health on %s:%d (/metrics, /healthz, /readyz)", host or "*", server.server_port)
    return server
