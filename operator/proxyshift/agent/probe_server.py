"""The pod-network probe server: `proxyshift probe-server --listen 0.0.0.0:9810`.

Runs in an unprivileged pod on every node (DaemonSet proxyshift-probe, config/agent/probe-daemonset.yaml),
so its connections leave a real pod and cross the node's PREROUTING chain as pod traffic does; the agent
on the host network only ever takes the OUTPUT path. The agent POSTs the dial jobs it wants from the pod
and merges the answers into its matrix (agent/behaviour.py run_behaviour).

    POST /probe  {"jobs": [{"address", "port", "protocol", "attempts"}], "attemptTimeoutSeconds", "budgetSeconds"}
              -> {"results": [[{"outcome", "detail", "payload", "source"}]], "truncated": bool}
    GET /healthz -> 200 "ok" (the readiness probe)

Requests are bounded (size, number of jobs, attempts, budget); the server dials only what it is asked,
answers only JSON, and keeps nothing between requests.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from proxyshift.agent.behaviour import Dialer, DialJob, dial, run_jobs
from proxyshift.api.behaviour import MAX_ATTEMPTS, MAX_CELLS

log = logging.getLogger("proxyshift.probe_server")

DEFAULT_LISTEN = "0.0.0.0:9810"
MAX_REQUEST_BYTES = 64 * 1024
MAX_BUDGET_SECONDS = 10.0
MAX_ATTEMPT_TIMEOUT_SECONDS = 5.0
# One probe at a time: two agents' probes in parallel would only make each other's budgets miss.
_PROBE_LOCK = threading.Lock()


class BadRequest(ValueError):
    """The request is not a probe request this server takes."""


def parse_request(body: bytes) -> tuple[list[DialJob], float, float]:
    """Validate a probe request: (jobs, attempt timeout, budget). Raises BadRequest."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise BadRequest("want an object with a jobs list")
    raw_jobs = data["jobs"]
    if len(raw_jobs) > MAX_CELLS:
        raise BadRequest(f"at most {MAX_CELLS} jobs")
    jobs = []
    for raw in raw_jobs:
        if not isinstance(raw, dict):
            raise BadRequest("each job is an object")
        address, port, protocol, attempts = raw.get("address"), raw.get("port"), raw.get("protocol"), raw.get(
            "attempts", 1)
        if not isinstance(address, str) or len(address) > 45:
            raise BadRequest("job address must be an IP address")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise BadRequest("job port must be 1-65535")
        if protocol not in ("TCP", "UDP"):
            raise BadRequest("job protocol must be TCP or UDP")
        if not isinstance(attempts, int) or not 1 <= attempts <= MAX_ATTEMPTS:
            raise BadRequest(f"job attempts must be 1-{MAX_ATTEMPTS}")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise BadRequest(f"job address {address!r} is not an IP address") from None
        jobs.append(DialJob(address, port, protocol, attempts))
    try:
        timeout = float(data.get("attemptTimeoutSeconds", 0.25))
        budget = float(data.get("budgetSeconds", 1.0))
    except (TypeError, ValueError):
        raise BadRequest("attemptTimeoutSeconds and budgetSeconds are numbers") from None
    if not (0 < timeout <= MAX_ATTEMPT_TIMEOUT_SECONDS and 0 < budget <= MAX_BUDGET_SECONDS):
        raise BadRequest(f"0 < attemptTimeoutSeconds <= {MAX_ATTEMPT_TIMEOUT_SECONDS}, "
                         f"0 < budgetSeconds <= {MAX_BUDGET_SECONDS}")
    return jobs, timeout, budget


def answer(body: bytes, *, dialer: Dialer = dial) -> dict[str, Any]:
    jobs, timeout, budget = parse_request(body)
    with _PROBE_LOCK:
        results, truncated = run_jobs(jobs, attempt_timeout=timeout, deadline=time.monotonic() + budget,
                                      dialer=dialer)
    return {"results": [[a.to_json() for a in attempts] for attempts in results], "truncated": truncated}


class ProbeHandler(BaseHTTPRequestHandler):
    server_version = "proxyshift-probe"
    dialer: Dialer = staticmethod(dial)

    def _send(self, code: int, payload: dict[str, Any] | str) -> None:
        body = (json.dumps(payload) if isinstance(payload, dict) else payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if isinstance(payload, dict) else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, "ok")
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        if self.path != "/probe":
            self._send(404, {"error": "not found"})
            return
        try:
            length = int(self.headers.get("Content-Length") or "-1")
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_REQUEST_BYTES:
            self._send(413 if length > MAX_REQUEST_BYTES else 411,
                       {"error": f"a body of at most {MAX_REQUEST_BYTES} bytes with a Content-Length"})
            return
        try:
            result = answer(self.rfile.read(length), dialer=type(self).dialer)
        except BadRequest as exc:
            self._send(400, {"error": str(exc)})
            return
        self._send(200, result)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class ProbeServer(ThreadingHTTPServer):
    daemon_threads = True
    # A slow or silent client must not hold a thread for ever.
    timeout = 5.0

    def __init__(self, listen: tuple[str, int]) -> None:
        super().__init__(listen, ProbeHandler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        conn.settimeout(self.timeout)
        return conn, addr


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {text!r}: want ADDRESS:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="proxyshift probe-server",
                                description="dial Services from this pod for the node's behaviour probe")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"ADDRESS:PORT to serve on (default {DEFAULT_LISTEN})")
    args = p.parse_args(list(argv or []))
    try:
        listen = parse_listen(args.listen)
    except ValueError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = ProbeServer(listen)
    import signal

    def stop(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    log.info("probe server on %s:%d", *server.server_address[:2])
    server.serve_forever()
    server.server_close()
    return 0
