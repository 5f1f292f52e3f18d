"""A small, bounded client of the Cilium agent's REST API on its unix socket (what `cilium-dbg` reads).

Three reads: GET /v1/healthz (the agent's state and its kube-proxy replacement mode), GET /v1/service (its
Service table) and GET /v1/endpoint (whether its host endpoint is ready: Cilium's health turns Ok and its
Service table fills a few seconds before it has loaded the host datapath on the node's devices). Each is bounded
in time (one deadline for the whole answer, so an agent trickling bytes cannot hold the proxyshift agent) and in
size, and parsed into the typed models of api/replacement.py: never a dict past this module. Preflight asks
whether the agent is there and healthy; the gate whether the replacement is on, its table holds the cluster's
Services and its host endpoint is ready (`read_replacement`, which reads the two lists only for an agent that is
Ok and replacing kube-proxy).
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from pydantic import TypeAdapter, ValidationError

from proxyshift.agent.probe import BodyTimedOut, BodyTooLarge, read_body
from proxyshift.api.replacement import (
    HOST_ENDPOINT_READY,
    MAX_MISSING,
    REPLACEMENT_MESSAGE_LIMIT,
    REPLACEMENT_TEXT_LIMIT,
    CiliumEndpoint,
    CiliumHealth,
    CiliumService,
    ReplacementFacts,
    host_endpoint_state,
)

DEFAULT_TIMEOUT = 3.0
HEALTH_MAX_BYTES = 1024 * 1024
# A Service table of 10,000 frontends with a few backends each is a few MiB of JSON.
SERVICES_MAX_BYTES = 32 * 1024 * 1024
# A node's endpoints: its pods (about 110 at most by default) and the host, a few KiB of JSON each.
ENDPOINTS_MAX_BYTES = 16 * 1024 * 1024
T = TypeVar("T")
_HEALTH = TypeAdapter(CiliumHealth)
_SERVICES = TypeAdapter(list[CiliumService])
_ENDPOINTS = TypeAdapter(list[CiliumEndpoint])


class CiliumAPIError(Exception):
    """The agent's API could not be read, or answered something that is not what it documents."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class CiliumAPI:
    """GETs on one Cilium agent's socket, each within `timeout` seconds and its size cap."""

    def __init__(self, socket_path: str | Path, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout

    def get(self, path: str, *, max_bytes: int) -> bytes:
        where = f"GET {path} on {self.socket_path}"
        deadline = time.monotonic() + self.timeout
        conn = _UnixConnection(self.socket_path, self.timeout)
        try:
            conn.request("GET", path, headers={"Accept": "application/json", "User-Agent": "proxyshift-agent"})
            response = conn.getresponse()
            body = read_body(conn, response, deadline=deadline, max_bytes=max_bytes)
        except BodyTooLarge as exc:
            raise CiliumAPIError(f"{where}: answer larger than {max_bytes} bytes") from exc
        except (BodyTimedOut, TimeoutError) as exc:
            raise CiliumAPIError(f"{where}: no complete answer within {self.timeout:g}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise CiliumAPIError(f"{where}: {exc.__class__.__name__}: {exc}") from exc
        finally:
            conn.close()
        if response.status != 200:
            raise CiliumAPIError(f"{where}: HTTP {response.status} {body[:200].decode('utf-8', 'replace')!r}")
        return body

    def read(self, path: str, adapter: TypeAdapter[T], what: str, *, max_bytes: int) -> T:
        """GET `path` and parse it with `adapter`; an answer that is not `what` is a CiliumAPIError."""
        body = self.get(path, max_bytes=max_bytes)
        try:
            return adapter.validate_json(body)
        except ValidationError as exc:
            raise CiliumAPIError(f"{path} is not {what}: {_first_error(exc)}") from exc

    def healthz(self) -> CiliumHealth:
        return self.read("/v1/healthz", _HEALTH, "a Cilium status", max_bytes=HEALTH_MAX_BYTES)

    def services(self) -> list[CiliumService]:
        return self.read("/v1/service", _SERVICES, "a Cilium Service list", max_bytes=SERVICES_MAX_BYTES)

    def endpoints(self) -> list[CiliumEndpoint]:
        return self.read("/v1/endpoint", _ENDPOINTS, "a Cilium endpoint list", max_bytes=ENDPOINTS_MAX_BYTES)


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    return f"{where}: {first['msg']}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_replacement(api: CiliumAPI, frontends: Iterable[str] = (), *, with_services: bool = True) -> ReplacementFacts:
    """ReplacementFacts from the agent's health and (with_services, once that is Ok and replacing kube-proxy) its
    host endpoint's state and its Service table, measured against the frontends the operator named: one read of
    each, /v1/healthz first. What could not be read is in `error`: an absent agent is a fact, not a crash."""
    try:
        health = api.healthz()
    except CiliumAPIError as exc:
        return ReplacementFacts(error=str(exc)[:REPLACEMENT_MESSAGE_LIMIT], probed_at=_now())
    state = health.cilium
    facts = ReplacementFacts(
        agent_state=(state.state if state else None),
        agent_message=((state.msg or None) if state else None),
        kube_proxy_replacement=(health.kube_proxy_replacement.mode if health.kube_proxy_replacement else None),
        enabled=health.enabled,
        probed_at=_now(),
    )
    if facts.agent_message is not None:
        facts = facts.model_copy(update={"agent_message": facts.agent_message[:REPLACEMENT_MESSAGE_LIMIT]})
    # An agent that is not Ok, or not replacing kube-proxy, is judged on its health alone (planner/gate.py, before
    # the endpoints and the table): a Probe reads it every 0.1 s while it starts, and neither list would tell more.
    # Decided here on the health just read, so a round reads /v1/healthz once.
    if not with_services or facts.agent_state != "Ok" or not facts.enabled:
        return facts
    # The endpoints first: while the host endpoint is not ready the gate waits on it alone (planner/gate.py),
    # and the Service table (up to 32 MiB of JSON, read every 0.1 s while a probe waits) would be read for nothing.
    endpoint_error: str | None = None
    try:
        host = host_endpoint_state(api.endpoints())[:REPLACEMENT_TEXT_LIMIT]
        facts = facts.model_copy(update={"host_endpoint": host})
        if host != HOST_ENDPOINT_READY:
            return facts
    except CiliumAPIError as exc:  # the table still tells what it can; the gate waits on the endpoints
        endpoint_error = str(exc)[:REPLACEMENT_MESSAGE_LIMIT]
    try:
        table = api.services()
    except CiliumAPIError as exc:
        return facts.model_copy(update={"error": str(exc)[:REPLACEMENT_MESSAGE_LIMIT]})
    held = {key for service in table for key in service.cluster_ip_frontends}
    missing = sorted({f for f in frontends if f not in held})
    return facts.model_copy(update={"cluster_ip_frontends": len(held), "missing": missing[:MAX_MISSING],
                                    "missing_count": len(missing), "error": endpoint_error})
