"""Probe of the node's kube-proxy from its own endpoints, and TCP connects to services.

Every read is bounded in time (a deadline for the whole answer, not just per
socket operation, so a server trickling one byte a second cannot hold the
agent) and in size (a server answering gigabytes cannot exhaust its memory).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.planner.metrics import MetricsError, parse_kube_proxy_metrics

DEFAULT_METRICS_ADDRESS = "127.0.0.1:10249"
DEFAULT_HEALTH_ADDRESS = "127.0.0.1:10256"
DEFAULT_TIMEOUT = 3.0
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
HEALTHZ_MAX_BYTES = 64 * 1024  # kube-proxy's /healthz is one small JSON object
_CHUNK = 64 * 1024


def split_address(address: str, *, default_port: int | None = None) -> tuple[str, int]:
    """"host:port" / "[v6]:port" -> (host, port); a wildcard bind address means loopback."""
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ValueError(f"{address!r} has no port")
        port_text = str(default_port)
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"{address!r}: port out of range")
    host = host or "0.0.0.0"
    if host in ("0.0.0.0", "::"):
        # kube-proxy binds the wildcard; from the node itself the loopback reaches it.
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return host, port


@dataclass(frozen=True)
class HttpAnswer:
    url: str
    status: int | None = None
    body: str = ""
    error: str | None = None
    too_large: bool = False  # the server sent more than the cap: its answer is refused, not merely unread


class BodyTimedOut(Exception):
    """The answer's body did not end by the deadline."""


class BodyTooLarge(Exception):
    """The answer's body is larger than the cap."""


def read_body(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, *, deadline: float,
              max_bytes: int) -> bytes:
    """An answer's body, in chunks, each read given what is left of `deadline` (time.monotonic()), at most
    `max_bytes`: a server that trickles or floods costs a bounded time and memory."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BodyTimedOut
        if conn.sock is not None:
            conn.sock.settimeout(left)
        chunk = resp.read1(_CHUNK) if hasattr(resp, "read1") else resp.read(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)


def http_get(address: str, path: str, *, timeout: float = DEFAULT_TIMEOUT,
             max_bytes: int = DEFAULT_MAX_BYTES) -> HttpAnswer:
    host, port = split_address(address)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}{path}"
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": "text/plain", "User-Agent": "proxyshift-agent"})
        resp = conn.getresponse()
        try:
            body = read_body(conn, resp, deadline=deadline, max_bytes=max_bytes)
        except BodyTimedOut:
            return HttpAnswer(url, resp.status, error=f"GET {url}: no complete answer within {timeout:g}s")
        except BodyTooLarge:
            return HttpAnswer(url, resp.status, error=f"GET {url}: answer larger than {max_bytes} bytes",
                              too_large=True)
        return HttpAnswer(url, resp.status, body.decode("utf-8", errors="replace"))
    except (OSError, http.client.HTTPException) as exc:
        return HttpAnswer(url, error=f"GET {url}: {exc.__class__.__name__}: {exc}")
    finally:
        conn.close()


@dataclass(frozen=True)
class ProbeResult:
    proxy_mode: HttpAnswer
    metrics: HttpAnswer
    healthz: HttpAnswer


def probe(metrics_address: str = DEFAULT_METRICS_ADDRESS, health_address: str = DEFAULT_HEALTH_ADDRESS, *,
          timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES) -> ProbeResult:
    """Raw answers of /proxyMode, /metrics and /healthz (each independently bounded)."""
    return ProbeResult(
        proxy_mode=http_get(metrics_address, "/proxyMode", timeout=timeout, max_bytes=4096),
        metrics=http_get(metrics_address, "/metrics", timeout=timeout, max_bytes=max_bytes),
        healthz=http_get(health_address, "/healthz", timeout=timeout, max_bytes=HEALTHZ_MAX_BYTES),
    )


@dataclass(frozen=True)
class ProxierSync:
    """One proxier (IP family) in /healthz's `status`: when it last called Updated(), whether it is healthy."""

    family: str
    last_updated: str  # kube-proxy's own RFC 3339 text: only compared with the previous answer, never parsed
    healthy: bool


@dataclass(frozen=True)
class KubeProxyHealth:
    """kube-proxy's /healthz alone: the cheap look a waiting Probe polls instead of /metrics.

    kube-proxy offers no way to be told of a sync. Its /healthz (pkg/proxy/healthcheck/proxy_health.go, v1.37)
    is a small JSON object whose `status` holds, per IP family, the time the proxier last called Updated():
    at the start of its sync loop and after every successful sync. A change of it (or of the answer's health)
    is worth the full probe; the top-level `lastUpdated` is not, a healthy server answers "now" there.
    """

    status: int | None  # the HTTP status; None: no answer
    # Sorted by family. None: the answer has no per-family `status` (a kube-proxy from before it, one not yet in
    # its sync loop, which omits the empty map, or an answer that is not that JSON): no signal to watch.
    proxiers: tuple[ProxierSync, ...] | None
    node_eligible: bool | None = None
    error: str | None = None

    @property
    def mark(self) -> tuple[object, ...]:
        """What a new sync or a change of health alters; equal marks: nothing worth a full probe happened."""
        return self.status, self.proxiers, self.node_eligible


def read_health(health_address: str = DEFAULT_HEALTH_ADDRESS, *, timeout: float = DEFAULT_TIMEOUT) -> KubeProxyHealth:
    """GET /healthz, bounded like every read here, and what it says of the proxiers' syncs."""
    return health_from_answer(http_get(health_address, "/healthz", timeout=timeout, max_bytes=HEALTHZ_MAX_BYTES))


def health_from_answer(answer: HttpAnswer) -> KubeProxyHealth:
    """A /healthz answer as KubeProxyHealth; anything but kube-proxy's JSON has no proxiers, never raises."""
    if answer.error is not None or answer.status is None:
        return KubeProxyHealth(answer.status, None, error=answer.error)
    try:
        doc = json.loads(answer.body)
    except (ValueError, RecursionError):  # the body is capped, but its nesting is the server's
        return KubeProxyHealth(answer.status, None)
    if not isinstance(doc, dict):
        return KubeProxyHealth(answer.status, None)
    eligible = doc.get("nodeEligible")
    return KubeProxyHealth(answer.status, _proxiers(doc.get("status")),
                           node_eligible=eligible if isinstance(eligible, bool) else None)


def _proxiers(status: object) -> tuple[ProxierSync, ...] | None:
    if not isinstance(status, dict) or not status:
        return None
    found: list[ProxierSync] = []
    for family, entry in status.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("lastUpdated"), str):
            return None  # not the shape kube-proxy writes: no signal rather than half of one
        found.append(ProxierSync(str(family)[:16], entry["lastUpdated"][:64], entry.get("healthy") is True))
    return tuple(sorted(found, key=lambda s: s.family))


def facts_from_probe(result: ProbeResult, now: datetime | None = None) -> KubeProxyFacts:
    """KubeProxyFacts for the status; `error` says what could not be read."""
    errors: list[str] = []
    facts = KubeProxyFacts()
    # An answer that arrived but cannot be trusted (metrics_invalid) is told apart from one that did not
    # arrive (error only): the gate fails on the first and waits on the second.
    invalid: str | None = None
    if result.metrics.error:
        errors.append(result.metrics.error)
        if result.metrics.too_large:
            invalid = result.metrics.error
    elif result.metrics.status != 200:
        errors.append(f"GET {result.metrics.url}: HTTP {result.metrics.status}")
    else:
        try:
            facts = parse_kube_proxy_metrics(result.metrics.body)
        except MetricsError as exc:
            errors.append(f"{result.metrics.url}: {exc}")
            invalid = f"{result.metrics.url}: {exc}"
    mode = None
    if result.proxy_mode.error:
        errors.append(result.proxy_mode.error)
    elif result.proxy_mode.status == 200:
        mode = result.proxy_mode.body.strip()[:32] or None
    else:
        errors.append(f"GET {result.proxy_mode.url}: HTTP {result.proxy_mode.status}")
    when = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return facts.model_copy(update={
        "proxy_mode": mode,
        # /healthz answers 503 with a body when unhealthy: that is a status, not a probe error.
        "healthz_status": result.healthz.status,
        "error": "; ".join(errors)[:1024] or None,
        "metrics_invalid": invalid[:512] if invalid else None,
        "probed_at": when,
    })


def tcp_connect(targets: Iterable[str], *, timeout: float = 2.0) -> dict[str, bool | str]:
    """target "ip:port" -> True, or why the connect failed. Each target has its own timeout."""
    results: dict[str, bool | str] = {}
    for target in targets:
        try:
            host, port = split_address(target)
            ipaddress.ip_address(host)  # only literal ClusterIPs: no DNS from the agent
        except ValueError as exc:
            results[target] = f"invalid target: {exc}"
            continue
        try:
            with socket.create_connection((host, port), timeout=timeout):
                results[target] = True
        except TimeoutError:
            results[target] = f"timed out after {timeout:g}s"
        except OSError as exc:
            results[target] = exc.strerror or str(exc)
    return results
