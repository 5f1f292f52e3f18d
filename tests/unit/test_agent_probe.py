"""The kube-proxy probe against local HTTP servers: real answers, errors, hostile servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.probe import (
    HttpAnswer,
    ProxierSync,
    facts_from_probe,
    health_from_answer,
    http_get,
    probe,
    read_health,
    split_address,
    tcp_connect,
)

pytestmark = pytest.mark.unit

METRICS = (Path(__file__).resolve().parents[1] / "fixtures" / "metrics" / "kube-proxy-nftables-v1.37.2.txt").read_text()


class Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        route = self.routes.get(self.path)
        if route is None:
            self.send_error(404)
            return
        status, body = route
        if callable(body):
            body(self)
            return
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _huge(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()
    block = b"# " + b"x" * 65534 + b"\n"
    try:
        for _ in range(2000):  # 128 MiB if nobody stops reading
            handler.wfile.write(block)
    except OSError:
        pass


def _trickle(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()
    try:
        for _ in range(50):
            handler.wfile.write(b"#")
            handler.wfile.flush()
            time.sleep(0.1)
    except OSError:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, dict]]:
    routes: dict = {}
    handler = type("H", (Handler,), {"routes": routes})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}", routes
    finally:
        srv.shutdown()
        srv.server_close()


def test_probe_of_a_healthy_kube_proxy(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes.update({"/proxyMode": (200, "nftables"), "/metrics": (200, METRICS), "/healthz": (200, "{}")})
    facts = facts_from_probe(probe(addr, addr))
    assert facts.error is None
    assert facts.proxy_mode == "nftables" and facts.healthz_status == 200
    assert facts.probed_at is not None
    assert facts.sync_count == 1 and facts.sync_failures is None and facts.probed_at.endswith("Z")
    assert facts.process_start_time is not None and facts.last_sync_timestamp is not None
    assert facts.process_start_time < facts.last_sync_timestamp


def test_unhealthy_healthz_is_a_status_not_an_error(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes.update({"/proxyMode": (200, "iptables\n"), "/metrics": (200, METRICS), "/healthz": (503, "{}")})
    facts = facts_from_probe(probe(addr, addr))
    assert facts.healthz_status == 503 and facts.error is None and facts.proxy_mode == "iptables"


def test_nothing_listening_is_reported_as_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    facts = facts_from_probe(probe(f"127.0.0.1:{port}", f"127.0.0.1:{port}", timeout=1))
    assert facts.proxy_mode is None and facts.healthz_status is None
    assert facts.error is not None and "ConnectionRefused" in facts.error


def test_garbage_metrics_are_an_error_in_the_facts(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes.update({"/proxyMode": (200, "ipvs"), "/metrics": (200, "process_start_time_seconds{ 1"),
                   "/healthz": (200, "")})
    facts = facts_from_probe(probe(addr, addr))
    assert facts.proxy_mode == "ipvs" and facts.error is not None and "Prometheus text format" in facts.error


def test_a_huge_answer_is_cut_off_at_the_cap(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes["/metrics"] = (200, _huge)
    answer = http_get(addr, "/metrics", max_bytes=1024 * 1024, timeout=5)
    assert answer.error and "larger than" in answer.error and answer.body == ""


def test_a_trickling_server_cannot_hold_the_probe(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes["/metrics"] = (200, _trickle)
    started = time.monotonic()
    answer = http_get(addr, "/metrics", timeout=1.0)
    assert time.monotonic() - started < 2.5
    assert answer.error and ("within" in answer.error or "timed out" in answer.error)


def test_split_address() -> None:
    assert split_address("0.0.0.0:10256") == ("127.0.0.1", 10256)
    assert split_address("[::]:10256") == ("::1", 10256)
    assert split_address("[2001:2::1]:443") == ("2001:2::1", 443)
    assert split_address("198.19.0.1", default_port=443) == ("198.19.0.1", 443)
    with pytest.raises(ValueError):
        split_address("198.19.0.1:99999")


def test_tcp_connect(server: tuple[str, dict]) -> None:
    addr, _ = server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    results = tcp_connect([addr, closed, "kubernetes.default:443"], timeout=1)
    assert results[addr] is True
    refused, invalid = results[closed], results["kubernetes.default:443"]
    assert isinstance(refused, str) and "refused" in refused.lower()
    assert isinstance(invalid, str) and invalid.startswith("invalid target")


# kube-proxy 1.37's /healthz (pkg/proxy/healthcheck/proxy_health.go): written here from its field list.
HEALTHZ_SYNCED = ('{"lastUpdated":"2026-12-05T12:00:07.5Z","currentTime":"2026-12-05T12:00:07.5Z",'
                  '"nodeEligible":true,"healthy":true,'
                  '"status":{"IPv6":{"lastUpdated":"2026-12-05T12:00:03.25Z","healthy":true},'
                  '"IPv4":{"lastUpdated":"2026-12-05T12:00:03.125Z","healthy":true}}}')
# Before the proxier's sync loop starts its `status` map is empty, and empty maps are omitted.
HEALTHZ_STARTING = '{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2026-12-05T12:00:01Z","healthy":true}'


def test_read_health_gives_the_per_family_sync_times(server: tuple[str, dict]) -> None:
    addr, routes = server
    routes["/healthz"] = (200, HEALTHZ_SYNCED)
    health = read_health(addr)
    assert health.status == 200 and health.error is None and health.node_eligible is True
    assert health.proxiers == (ProxierSync("IPv4", "2026-12-05T12:00:03.125Z", True),
                               ProxierSync("IPv6", "2026-12-05T12:00:03.25Z", True))
    # The top-level times move with every answer; the mark does not.
    later = HEALTHZ_SYNCED.replace("12:00:07.5Z", "12:00:09Z")
    routes["/healthz"] = (200, later)
    assert read_health(addr).mark == health.mark
    routes["/healthz"] = (200, later.replace("03.25Z", "08.5Z"))
    assert read_health(addr).mark != health.mark
    routes["/healthz"] = (503, HEALTHZ_SYNCED.replace('"healthy":true}}}', '"healthy":false}}}'))
    unhealthy = read_health(addr)
    assert unhealthy.status == 503 and unhealthy.proxiers is not None and unhealthy.mark != health.mark


def test_a_healthz_without_sync_times_gives_no_signal(server: tuple[str, dict]) -> None:
    addr, routes = server
    for body in (HEALTHZ_STARTING, "{}", "", "ok", "[1]", '{"status": []}', '{"status": {"IPv4": 5}}',
                 '{"status": {"IPv4": {"healthy": true}}}', "[" * 50_000):
        routes["/healthz"] = (200, body)
        health = read_health(addr)
        assert health.status == 200 and health.proxiers is None and health.error is None, body[:40]
    routes["/healthz"] = (200, _huge)
    huge = read_health(addr)
    assert huge.proxiers is None and huge.error is not None and "larger than" in huge.error


def test_no_healthz_answer_is_an_error_without_a_signal() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = read_health(f"127.0.0.1:{port}", timeout=1)
    assert health.status is None and health.proxiers is None
    assert health.error is not None and "ConnectionRefused" in health.error
    assert health_from_answer(HttpAnswer("http://x/healthz", 200, error="GET: no complete answer")).proxiers is None
