"""A Cilium agent's REST API on a unix socket, for the tests of the proxyshift agent's client of it
(agent/cilium_api.py) and of the agent loop that reads it through that client."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

HEALTHY = {"cilium": {"state": "Ok", "msg": ""}, "kube-proxy-replacement": {"mode": "True", "devices": []},
           "cluster": {"ciliumHealth": {"state": "Ok"}}, "controllers": []}


def service(ip: str, port: int, kind: str = "ClusterIP", protocol: str = "TCP") -> dict[str, Any]:
    return {"spec": {"id": port, "frontend-address": {"ip": ip, "port": port, "protocol": protocol,
                                                      "scope": "external"},
                     "backend-addresses": [{"ip": "198.18.1.1", "port": 8080, "state": "active"}],
                     "flags": {"type": kind, "name": f"svc-{port}", "namespace": "default"}},
            "status": {"realized": {}}}


def endpoint(ident: int, labels: list[str], state: str = "ready") -> dict[str, Any]:
    return {"id": 100 + ident, "spec": {}, "status": {"state": state, "identity": {"id": ident, "labels": labels},
                                                      "health": {"bpf": "OK"}}}


HOST = endpoint(1, ["reserved:host", "reserved:kube-apiserver"])
POD = endpoint(4242, ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"])

TABLE = [service("198.19.0.10", 80), service("198.19.0.11", 53, protocol="UDP"), service("198.19.0.12", 8443,
         protocol="ANY"), service("198.18.0.11", 30080, kind="NodePort")]

Route = Callable[[http.server.BaseHTTPRequestHandler], None]


def answer(status: int, body: bytes | str | Any) -> Route:
    data = body if isinstance(body, bytes) else (body.encode() if isinstance(body, str) else json.dumps(body).encode())

    def send(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return send


class FakeCilium:
    """A Cilium agent's API on a unix socket: each path answers as its route says; the requests are kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.routes: dict[str, Route] = {"/v1/healthz": answer(200, HEALTHY), "/v1/service": answer(200, TABLE),
                                         "/v1/endpoint": answer(200, [POD, HOST])}
        self.requests: list[str] = []
        self.stop = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append(self.path)
                fake.routes.get(self.path, answer(404, {"message": "no such path"}))(self)

            def log_message(self, format: str, *args: Any) -> None:
                return  # a unix socket's client has no address to log

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
