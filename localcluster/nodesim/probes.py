"""Readiness, liveness and startup probes: one check (probe_once) and a probe's running state."""

from __future__ import annotations

import concurrent.futures
import http.client
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from localcluster.nodesim.podspec import resolve_port

PROBE_KEYS = ("startupProbe", "readinessProbe", "livenessProbe")


def scaled_probes(container: dict[str, Any], scale: float) -> dict[str, Any]:
    """The container spec with each probe's initialDelaySeconds and timeoutSeconds times `scale`.

    For a node whose programs run `scale` times slower than the probes were written for (the QEMU
    guest's emulation, localcluster.vmnodes): a liveness probe that gives the agent 45 s to serve
    /healthz restarts it forever where its start takes a minute. periodSeconds and the thresholds stay,
    so readiness is seen as soon as on any node. scale 1 returns the spec unchanged.
    """
    if scale == 1:
        return container
    if scale <= 0:
        raise ValueError(f"probe time scale must be positive, got {scale}")
    out = dict(container)
    for key in PROBE_KEYS:
        if out.get(key):
            probe = dict(out[key])
            probe["initialDelaySeconds"] = float(probe.get("initialDelaySeconds", 0)) * scale
            probe["timeoutSeconds"] = float(probe.get("timeoutSeconds", 1)) * scale
            out[key] = probe
    return out


def probe_once(probe: dict[str, Any], container: dict[str, Any], host: str) -> tuple[bool, str]:
    """Run one probe; called on a thread that lives in the node's network namespace."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            port = resolve_port(spec["port"], container)
            target = spec.get("host") or host
            if spec.get("scheme", "HTTP").upper() == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    target, port, timeout=timeout, context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(target, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
                conn.request("GET", spec.get("path", "/"), headers=headers)
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP {status}"
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            with socket.create_connection((spec.get("host") or host, resolve_port(spec["port"], container)),
                                          timeout=timeout):
                return True, "connected"
        return False, f"probe type not supported by the node simulator: {sorted(probe)}"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, str(exc)


@dataclass
class ProbeState:
    spec: dict[str, Any]
    kind: str  # readiness | liveness | startup
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool = False
    pending: concurrent.futures.Future[tuple[bool, str]] | None = None
    message: str = ""
