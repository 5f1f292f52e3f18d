"""An HTTP server for test pods that answers every GET with the pod's name.

    proxyshift localcluster serve --listen 0.0.0.0:8080

The node simulator runs the proxyshift image only as the proxyshift CLI, so this is how
a test gets a pod (hostNetwork or not) that listens: readiness probes (`httpGet` on any
path) and clients see `200` and `$HOSTNAME\\n` (the pod's name for a pod without
hostNetwork, the node's for one with it).
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import threading
from typing import Any


def parse_listen(text: str) -> tuple[str, int]:
    """'0.0.0.0:8080' -> ('0.0.0.0', 8080)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad --listen {text!r}: want HOST:PORT")
    return host or "0.0.0.0", int(port)


def make_server(host: str, port: int, identity: str) -> http.server.ThreadingHTTPServer:
    answer = f"{identity}\n".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # a readiness probe every second would fill the container log

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(listen: str) -> None:
    host, port = parse_listen(listen)
    server = make_server(host, port, os.environ.get("HOSTNAME") or socket.gethostname())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="identity-server", daemon=True)
    thread.start()
    stop.wait()
    server.shutdown()
    server.server_close()
