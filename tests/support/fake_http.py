"""The HTTP side the test stand-ins for kube-apiserver share: JSON answers and chunked watch streams.

fake_apiserver.py (for a real kube-proxy), fake_proxynode_api.py (for the real
agent) and bench/harness/live_apiserver.py speak the API server's wire format
through this one base class, so a fix to the framing lands in all three.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log_prefix = "fake-http"

    def log_message(self, fmt: str, *args: Any) -> None:
        sys.stderr.write(f"{self.log_prefix}: " + fmt % args + "\n")

    def send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def not_found(self, what: str) -> None:
        self.send_json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                             "code": 404, "message": f"{what} not served by the fake"})

    def start_stream(self) -> None:
        """The headers of a watch: one JSON event per chunk follows."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def send_event(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def send_initial_events(self, items: list[dict[str, Any]], api_version: str, kind: str, rv: str) -> None:
        """client-go >= 1.35 lists through a watch (sendInitialEvents): the objects as ADDED events, then a
        bookmark marking the end of the initial state."""
        for obj in items:
            self.send_event({"type": "ADDED", "object": obj})
        self.send_event({"type": "BOOKMARK", "object": {
            "apiVersion": api_version, "kind": kind,
            "metadata": {"resourceVersion": rv, "annotations": {"k8s.io/initial-events-end": "true"}}}})

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
