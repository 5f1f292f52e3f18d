"""The agent's own metrics and health (agent/metrics.py), recorded by the loop against the fakes of
test_agent_loop.py, and the DaemonSet and PodMonitor that use them."""

from __future__ import annotations

import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from test_agent_loop import Clock, FakeAPI, make_agent, node_obj

from proxyshift.agent import metrics
from proxyshift.agent.flush.base import FlushReport
from proxyshift.agent.hold import HoldReport
from proxyshift.agent.loop import parse_args
from proxyshift.agent.preflight import Missing, PreflightReport, ToolVersions
from proxyshift.api.proxynode import KubeProxyFacts, Mode

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "config"
CLEANUP = {"id": "m1.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Counted:
    """Deltas of the process-wide series across one test (the registry is shared by every test)."""

    SERIES = (("proxyshift_agent_operations_total", ("type", "result")),
              ("proxyshift_agent_operation_duration_seconds_count", ("type",)),
              ("proxyshift_agent_operation_duration_seconds_sum", ("type",)),
              ("proxyshift_agent_errors_total", ("where",)))

    def __init__(self) -> None:
        self.before = self._read()

    @staticmethod
    def _read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in REGISTRY.collect():
            for s in family.samples:
                if s.name.startswith("proxyshift_agent_"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def delta(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self._read().get(key, 0.0) - self.before.get(key, 0.0)


def test_an_operation_is_counted_by_type_and_result_with_its_duration_and_the_flush_s() -> None:
    api = FakeAPI(node_obj(CLEANUP))
    agent = make_agent(api)
    clock = agent.clock
    inner = agent.effects.cleanup
    assert isinstance(clock, Clock)

    def slow_flush(remove: list[str], target: str | None) -> tuple[FlushReport, HoldReport]:
        clock.t += 2.0  # the flush takes two seconds of the agent's clock
        return inner(remove, target)

    agent.effects.cleanup = slow_flush  # type: ignore[method-assign]  # the test swaps this seam
    counted = Counted()
    flushes = sample("proxyshift_agent_flush_duration_seconds_count")
    flush_sum = sample("proxyshift_agent_flush_duration_seconds_sum")
    agent.handle(api.get("n1"))
    agent.handle(api.get("n1"))  # our own write coming back: no second operation, no second count
    assert counted.delta("proxyshift_agent_operations_total", type="Cleanup", result="succeeded") == 1
    assert counted.delta("proxyshift_agent_operations_total", type="Cleanup", result="failed") == 0
    assert counted.delta("proxyshift_agent_operation_duration_seconds_count", type="Cleanup") == 1
    assert counted.delta("proxyshift_agent_operation_duration_seconds_sum", type="Cleanup") == pytest.approx(2.0)
    assert sample("proxyshift_agent_flush_duration_seconds_count") - flushes == 1
    assert sample("proxyshift_agent_flush_duration_seconds_sum") - flush_sum == pytest.approx(2.0)


def test_a_failed_preflight_and_an_operation_that_raises_are_counted_failed() -> None:
    def refuse(mode: Mode, scheduler: str | None, **kw: Any) -> PreflightReport:
        return PreflightReport(mode=mode, scheduler=scheduler, kernel_release="6.8.0", modules={},
                               tools=ToolVersions(), missing=[Missing("kernel module ip_vs", "needed", "modprobe")])

    counted = Counted()
    api = FakeAPI(node_obj({"id": "m2.Preflight.0", "type": "Preflight", "params": {"mode": "ipvs"}}))
    make_agent(api, preflight=refuse).handle(api.get("n1"))
    bad = FakeAPI(node_obj({"id": "m2.Cleanup.0", "type": "Cleanup", "params": {"removeModes": "iptables"}}))
    make_agent(bad).handle(bad.get("n1"))  # params.removeModes must be a list: the operation raises
    assert counted.delta("proxyshift_agent_operations_total", type="Preflight", result="failed") == 1
    assert counted.delta("proxyshift_agent_operations_total", type="Cleanup", result="failed") == 1
    assert counted.delta("proxyshift_agent_operations_total", type="Preflight", result="succeeded") == 0
    assert counted.delta("proxyshift_agent_errors_total", where="operation") == 1


class FlakyAPI(FakeAPI):
    """Refuses the status writes whose numbers (from 0) are in `refuse`."""

    def __init__(self, obj: dict[str, Any], refuse: set[int]):
        super().__init__(obj)
        self.refuse, self.calls = refuse, 0

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if self.calls - 1 in self.refuse:
            raise ConnectionError("apiserver away")
        return super().patch_status(name, status)


def test_a_result_the_api_server_refused_is_counted_once_and_its_write_error_too() -> None:
    api = FlakyAPI(node_obj(CLEANUP), refuse={1})  # write 0 is Running, write 1 the result
    agent = make_agent(api)
    counted = Counted()
    with pytest.raises(ConnectionError):
        agent.handle(api.get("n1"))
    assert counted.delta("proxyshift_agent_errors_total", where="status_write") == 1
    agent.tick()  # the unsent result goes out first
    assert api.obj["status"]["lastOperation"]["state"] == "Succeeded"
    assert counted.delta("proxyshift_agent_operations_total", type="Cleanup", result="succeeded") == 1


def test_heartbeat_age_and_last_write_follow_the_status_writes() -> None:
    api = FakeAPI(node_obj())
    agent = make_agent(api)
    clock, health = agent.clock, agent.health
    assert isinstance(clock, Clock)
    metrics.track_heartbeat(health)
    clock.t += 30
    assert sample("proxyshift_agent_heartbeat_age_seconds") == 30  # no write yet: since the start
    agent.handle(api.get("n1"))
    agent.tick()  # first tick: probe and heartbeat
    assert api.patches and "heartbeat" in api.patches[-1]
    assert sample("proxyshift_agent_heartbeat_age_seconds") == 0
    assert sample("proxyshift_agent_last_status_write_timestamp_seconds") == clock.t
    clock.t += 45
    assert sample("proxyshift_agent_heartbeat_age_seconds") == 45


def test_every_kube_proxy_probe_is_timed_and_a_failed_one_counted() -> None:
    api = FakeAPI(node_obj())
    agent = make_agent(api, facts=KubeProxyFacts(error="GET http://127.0.0.1:10249/metrics: connection refused"))
    clock = agent.clock
    assert isinstance(clock, Clock)
    inner = agent.effects.probe

    def slow_probe() -> KubeProxyFacts:
        clock.t += 0.25
        return inner()

    agent.effects.probe = slow_probe  # type: ignore[method-assign]  # the test swaps this seam
    counted = Counted()
    probes = sample("proxyshift_agent_kube_proxy_probe_duration_seconds_count")
    probe_sum = sample("proxyshift_agent_kube_proxy_probe_duration_seconds_sum")
    agent.handle(api.get("n1"))
    agent.tick()
    assert sample("proxyshift_agent_kube_proxy_probe_duration_seconds_count") - probes == 1
    assert sample("proxyshift_agent_kube_proxy_probe_duration_seconds_sum") - probe_sum == pytest.approx(0.25)
    assert counted.delta("proxyshift_agent_errors_total", where="kube_proxy_probe") == 1


def test_the_watch_loop_marks_api_contact_and_counts_its_errors() -> None:
    stop = threading.Event()

    class BrokenWatch(FakeAPI):
        def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            stop.set()
            raise ConnectionError("watch cut")

    api = BrokenWatch(node_obj())
    agent = make_agent(api)
    assert agent.health.last_contact is None
    counted = Counted()
    agent._watch_loop(queue.Queue(), stop)
    assert agent.health.last_contact == agent.clock()  # the GET answered
    assert counted.delta("proxyshift_agent_errors_total", where="watch") == 1


def test_every_error_place_is_exported_at_zero() -> None:
    for where in metrics.ERROR_PLACES:
        assert REGISTRY.get_sample_value("proxyshift_agent_errors_total", {"where": where}) is not None


# ---- health ----


def test_healthz_holds_through_startup_and_readyz_waits_for_the_api_server() -> None:
    clock = Clock()
    health = metrics.Health(clock, stale_after=600)
    assert health.live() == (True, "ok")
    assert health.ready() == (False, "the API server has not answered yet")
    health.loop_turned()
    health.contact()
    assert health.ready() == (True, "ok")


def test_healthz_fails_when_the_api_server_stopped_answering_or_the_loop_stalled() -> None:
    clock = Clock()
    health = metrics.Health(clock, stale_after=600)
    health.contact()
    clock.t += 601
    health.loop_turned()
    ok, why = health.live()
    assert not ok and "no successful API call" in why and "601s" in why
    assert health.ready()[0] is False
    health.wrote()  # a status write is an API answer too
    assert health.live() == (True, "ok")
    clock.t += 601
    health.contact()
    ok, why = health.live()
    assert not ok and "loop has not turned for 601s" in why


def test_respond_serves_metrics_health_and_nothing_else() -> None:
    clock = Clock()
    health = metrics.Health(clock, stale_after=10)
    status, content_type, body = metrics.respond("/metrics", health)
    assert status == 200 and content_type.startswith("text/plain") and b"proxyshift_agent_operations_total" in body
    assert metrics.respond("/healthz", health)[0] == 200
    assert metrics.respond("/readyz", health)[0] == 503
    clock.t += 11
    status, _, body = metrics.respond("/healthz?verbose", health)
    assert status == 503 and b"loop has not turned for 11s" in body
    assert metrics.respond("/", health)[0] == 404


def test_the_server_answers_on_its_port() -> None:
    health = metrics.Health(stale_after=60)
    health.contact()
    server = metrics.serve("127.0.0.1:0", health)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(base + "/readyz", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            assert b"proxyshift_agent_heartbeat_age_seconds" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/nothing", timeout=5)
        assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_listen_flag_default_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_args(["--node", "n1"])
    assert cfg.listen == "0.0.0.0:9811" and cfg.stale_seconds == 600
    assert metrics.parse_listen(cfg.listen) == ("0.0.0.0", 9811)
    assert metrics.parse_listen("[::]:9811") == ("::", 9811)
    assert parse_args(["--node", "n1", "--listen", ""]).listen == ""
    with pytest.raises(SystemExit):
        parse_args(["--node", "n1", "--listen", "9811"])
    assert "HOST:PORT" in capsys.readouterr().err


# ---- manifests ----


def _agent_daemonset() -> dict[str, Any]:
    (ds,) = [d for d in yaml.safe_load_all((CONFIG / "agent" / "daemonset.yaml").read_text())
             if d and d["kind"] == "DaemonSet"]
    return ds


def test_the_daemonset_probes_the_agent_on_the_port_it_listens_on() -> None:
    ds = _agent_daemonset()
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    listen = agent["args"][agent["args"].index("--listen") + 1]
    assert metrics.parse_listen(listen)[1] == ports["metrics"] == 9811
    assert ports["metrics"] not in (10249, 10256, 9810)  # kube-proxy's and the probe server's
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # Liveness must not restart an agent over less than what /healthz itself calls stale.
    live = agent["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


def test_the_podmonitor_selects_the_agent_pods_and_port() -> None:
    monitor = yaml.safe_load((CONFIG / "prometheus" / "podmonitor.yaml").read_text())
    ds = _agent_daemonset()
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    kustomization = yaml.safe_load((CONFIG / "prometheus" / "kustomization.yaml").read_text())
    assert "podmonitor.yaml" in kustomization["resources"]
