"""The simulated kubelet's log API (the slice `kubectl logs` uses), over TLS on the node's address."""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from localcluster.nodesim.config import SimConfig
from localcluster.nodesim.node import KUBELET_PORT

log = logging.getLogger("proxyshift.nodesim")



class LogServer:
    """The slice of the kubelet API that `kubectl logs` uses: GET /containerLogs/<ns>/<pod>/<container>.

    It listens on <node-ip>:10250 inside the node (the socket is made by a thread in
    the node's namespace, as the apiserver reaches nodes by InternalIP through the
    bridge), over TLS with a throwaway self-signed certificate: the apiserver does
    not verify kubelet serving certificates unless told to. Only the bridge reaches
    it, so it does not authenticate the caller.
    """

    def __init__(self, cfg: SimConfig, pod_running: Callable[[str, str], bool]) -> None:
        self.cfg = cfg
        # Whether a pod still runs here: a follow (`kubectl logs -f`) ends when it stops.
        self.pod_running = pod_running

    def _tls_context(self) -> ssl.SSLContext:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.cfg.node)])
        start = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start)
                .not_valid_after(start + dt.timedelta(days=365))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(self.cfg.node_ip)), x509.DNSName(self.cfg.node)]),
                    critical=False)
                .sign(key, hashes.SHA256()))
        folder = self.cfg.node_dir / "kubelet-serving"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file = folder / "tls.key"
        key_file.touch(mode=0o600)
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(folder / "tls.crt", key_file)
        return context

    def start(self) -> None:
        import http.server

        from localcluster.container import run_in_netns

        def listen() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.cfg.node_ip, KUBELET_PORT))
            sock.listen(64)
            return sock

        server_self = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
                if parts == ["healthz"]:
                    self._reply(200, b"ok")
                elif len(parts) == 4 and parts[0] == "containerLogs":
                    server_self.serve_logs(self, parts[1], parts[2], parts[3], urllib.parse.parse_qs(url.query))
                else:
                    self._reply(404, b"the proxyshift node simulator serves only /containerLogs and /healthz\n")

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = http.server.ThreadingHTTPServer((self.cfg.node_ip, KUBELET_PORT), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = self._tls_context().wrap_socket(run_in_netns(self.cfg.node, listen), server_side=True)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="kubelet-api", daemon=True).start()

    def serve_logs(self, handler: Any, namespace: str, pod: str, container: str, query: dict[str, list[str]]) -> None:
        path = self.cfg.node_dir / "logs" / f"{pod}_{container}.log"
        if not path.exists():
            handler._reply(404, f"no log for {namespace}/{pod}/{container} on {self.cfg.node}\n".encode())
            return
        data = path.read_bytes()
        tail = query.get("tailLines", [None])[0]
        if tail is not None and tail.isdigit():
            data = b"".join(data.splitlines(keepends=True)[-int(tail):]) if int(tail) else b""
        limit = query.get("limitBytes", [None])[0]
        if limit is not None and limit.isdigit():
            data = data[:int(limit)]
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.end_headers()
        handler.wfile.write(data)
        if query.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size
        while self.pod_running(namespace, pod):
            time.sleep(0.5)
            with contextlib.suppress(OSError), path.open("rb") as log:
                log.seek(offset)
                chunk = log.read()
                offset += len(chunk)
            if chunk:
                try:
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
                except OSError:
                    return
