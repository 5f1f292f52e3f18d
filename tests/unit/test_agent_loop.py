"""The agent loop against a fake ProxyNode API that applies real JSON merge patches."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from fake_cilium import HOST, POD, FakeCilium, answer, endpoint

from proxyshift.agent import diagnostics as diag
from proxyshift.agent.effects import KernelNodeEffects
from proxyshift.agent.flush.base import FlushReport, FlushStep
from proxyshift.agent.hold import HoldReport
from proxyshift.agent.inventory import ChainInventory, Inventory
from proxyshift.agent.iptables_save import Dump
from proxyshift.agent.loop import (
    P99_ABOVE_BUCKETS,
    PROBE_AWAIT_POLL_SECONDS,
    PROBE_FALLBACK_SECONDS,
    PROBE_HEALTH_POLL_SECONDS,
    Agent,
    AgentConfig,
    HoldRecord,
    ProxyNodeAPI,
    parse_args,
)
from proxyshift.agent.preflight import Missing, PreflightReport, ToolVersions
from proxyshift.agent.probe import KubeProxyHealth, ProxierSync
from proxyshift.api.behaviour import BehaviourMatrix, BehaviourParams, ConntrackParams, ConntrackReport
from proxyshift.api.diagnostics import DiagnoseRequest, NodeDiagnostics
from proxyshift.api.proxynode import (
    KubeProxyFacts,
    Mode,
    NodeMigration,
    PreflightResult,
    ProbeResult,
    ProxyNode,
    attempt_key,
)
from proxyshift.api.replacement import ReplacementFacts, ReplacementParams
from proxyshift.commands import Result

pytestmark = pytest.mark.unit


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


class FakeAPI:
    def __init__(self, obj: dict[str, Any]):
        self.obj = obj
        self.patches: list[dict[str, Any]] = []

    def get(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.obj)

    def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
        return iter(())

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.patches.append(copy.deepcopy(status))
        self.obj = merge(self.obj, {"status": status})
        return self.obj


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def node_obj(op: dict | None = None, status: dict | None = None,
             migration: dict | None = None) -> dict[str, Any]:
    return {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode",
            "metadata": {"name": "n1", "resourceVersion": "1"},
            "spec": {"mode": "nftables", **({"operation": op} if op else {}),
                     **({"migration": migration} if migration else {})}, "status": status or {}}


FACTS = KubeProxyFacts(proxy_mode="nftables", healthz_status=200, process_start_time=1.7e9,
                       last_sync_timestamp=1.7e9 + 5, sync_count=4, sync_duration_p99_seconds=0.2, sync_failures=0)
IPT_LEFT = Inventory(iptables=[ChainInventory("iptables (ipv4, nft backend)",
                                              [("nat", "KUBE-SVC-AAAAAAAAAAAAAAAA", frozenset({"iptables"}))])],
                     nft_tables=[("ip", "kube-proxy")])
CLEAN = Inventory(nft_tables=[("ip", "kube-proxy")])


# A flush's verifying save of one family (FlushReport.after), which the inventory after a Cleanup takes.
VERIFIED = Dump()


class FakeHold:
    """The node's rule hold as the agent's seams see it (agent/hold.py does the kernel side)."""

    def __init__(self, present: bool = False, fail: bool = False):
        self.present, self.fail = present, fail
        self.release_fails = False
        self.calls: list[str] = []

    def install(self, from_mode: str) -> HoldReport:
        self.calls.append(f"install {from_mode}")
        report = HoldReport("install")
        if self.fail:
            report.errors.append("iptables-restore: exit status 4")
        else:
            self.present = True
            report.done.append("iptables (ipv4, nft backend): 9 chains, 20 rules copied")
        return report

    def release(self) -> HoldReport:
        self.calls.append("release")
        report = HoldReport("release")
        if self.release_fails:
            report.errors.append("iptables-restore: exit status 4")
            return report
        if self.present:
            report.done.append("9 chains removed")
        self.present = False
        return report


class FakeNode:
    """The node behind the agent's NodeEffects protocol, from memory: records flushes, answers the rest."""

    # checks: test_agent_loop_behaviour's FakeChecks (its behaviour and conntrack), which imports this module.
    def __init__(self, *, inventory: Inventory = CLEAN, facts: KubeProxyFacts = FACTS,
                 flush_calls: list[Any] | None = None,
                 preflight: Callable[..., PreflightReport] | None = None, hold: FakeHold | None = None,
                 checks: Any = None, readers: diag.Readers | None = None) -> None:
        self.facts, self.inventory_now = facts, inventory
        self.readers = readers  # diagnose: the node's tools as text (diagnostics.Readers), None for the real ones
        self.flush_calls = flush_calls if flush_calls is not None else []
        self.preflight_fn = preflight
        self.held = hold if hold is not None else FakeHold()
        self.checks = checks  # behaviour and conntrack (test_agent_loop_behaviour's FakeChecks)
        # The node's kube-proxy replacement (Cilium) as its API answers; the reads asked of it.
        self.replaced = ReplacementFacts(error="GET /v1/healthz on /var/run/cilium/cilium.sock: FileNotFoundError")
        self.replacement_calls: list[tuple[str, bool]] = []
        self.inventory_fresh: list[dict[str, Dump]] = []  # what each inventory was given as just read
        # kube-proxy's /healthz alone; by default without per-family sync times (a kube-proxy from before them).
        self.healthz = KubeProxyHealth(200, None)

    def probe(self) -> KubeProxyFacts:
        return self.facts

    def health(self) -> KubeProxyHealth:
        return self.healthz

    def inventory(self, fresh: Mapping[str, Dump] | None = None) -> Inventory:
        self.inventory_fresh.append(dict(fresh or {}))
        return self.inventory_now

    def cleanup(self, remove: list[str], target: str | None) -> tuple[FlushReport, HoldReport]:
        self.flush_calls.append((remove, target))
        # The agent passes only the modes it validated.
        report = FlushReport(cast(list[Mode], sorted(remove)), cast(Mode | None, target))
        report.steps.append(FlushStep("iptables (ipv4, nft backend)", removed={"chains": 3}))
        report.after["iptables (ipv4, nft backend)"] = VERIFIED  # its verifying save
        return report, self.held.release()  # the hold leaves in the flush's round

    def preflight(self, mode: str, scheduler: str | None = None, **kw: Any) -> PreflightReport:
        if self.preflight_fn is not None:
            return self.preflight_fn(mode, scheduler, **kw)
        return PreflightReport(mode=cast(Mode, mode), scheduler=scheduler, kernel_release="6.1.0",
                               modules={"nf_conntrack": "present"},
                               tools=ToolVersions(nft="1.0.9", iptables="1.8.9", iptables_backend="nf_tables"))

    def connect(self, targets: list[str]) -> dict[str, bool | str]:
        return {t: (True if t.endswith(":443") else "connection refused") for t in targets}

    def replacement(self, params: ReplacementParams, *, with_services: bool) -> ReplacementFacts:
        self.replacement_calls.append((params.socket_path, with_services))
        return self.replaced

    def install_hold(self, from_mode: str) -> HoldReport:
        return self.held.install(from_mode)

    def release_hold(self) -> HoldReport:
        return self.held.release()

    def hold_present(self) -> bool:
        return self.held.present

    def behaviour(self, params: BehaviourParams, *, mode: str | None, operation_id: str) -> BehaviourMatrix:
        assert self.checks is not None, "this test gave the fake node no behaviour checks"
        return self.checks.behaviour(params, mode=mode, operation_id=operation_id)

    def conntrack(self, params: ConntrackParams) -> ConntrackReport:
        assert self.checks is not None, "this test gave the fake node no conntrack checks"
        return self.checks.conntrack(params)

    def diagnose(self, request: DiagnoseRequest, mode: str | None) -> NodeDiagnostics:
        return diag.serve(request, mode, self.readers)


def fake_node(agent: Agent) -> FakeNode:
    """The agent's node effects: make_agent's FakeNode."""
    assert isinstance(agent.effects, FakeNode)
    return agent.effects


def fake_clock(agent: Agent) -> Clock:
    """The agent's clock: make_agent's Clock."""
    assert isinstance(agent.clock, Clock)
    return agent.clock


def make_agent(api: ProxyNodeAPI, *, inventory: Inventory = CLEAN, facts: KubeProxyFacts = FACTS,
               flush_calls: list[Any] | None = None,
               preflight: Callable[..., PreflightReport] | None = None, hold: FakeHold | None = None) -> Agent:
    node = FakeNode(inventory=inventory, facts=facts, flush_calls=flush_calls, preflight=preflight, hold=hold)
    return Agent(AgentConfig(node="n1"), api, node, clock=Clock())


def test_cleanup_runs_once_and_records_running_before_the_flush() -> None:
    api = FakeAPI(node_obj({"id": "m1.Cleanup.0", "type": "Cleanup",
                            "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}))
    calls: list = []
    agent = make_agent(api, flush_calls=calls)
    agent.handle(api.get("n1"))
    agent.handle(api.get("n1"))          # the watch delivers our own status write back
    assert calls == [(["iptables"], "nftables")]
    assert api.patches[0]["lastOperation"]["state"] == "Running"
    node = ProxyNode.model_validate(api.obj)
    last = node.status.last_operation
    assert last is not None
    assert last.state == "Succeeded" and last.id == "m1.Cleanup.0"
    assert last.details["steps"][0]["removed"] == {"chains": 3}
    assert node.status.observed_mode == "nftables" and node.status.leftovers == []
    assert node.status.leftover_objects == 0  # written as a count, so kubectl shows 0, not <none>
    assert node.status.kube_proxy is not None
    assert node.status.heartbeat and node.status.kube_proxy.sync_count == 4


def test_the_inventory_after_a_cleanup_takes_the_flushs_verifying_reads_and_no_older_one() -> None:
    api = FakeAPI(node_obj({"id": "m1.Cleanup.0", "type": "Cleanup",
                            "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}))
    agent = make_agent(api)
    node = fake_node(agent)
    agent.handle(api.get("n1"))
    # The inventory right after the flush reads the rest itself; any later one reads everything again.
    assert node.inventory_fresh[-1] == {"iptables (ipv4, nft backend)": VERIFIED}
    agent.observe(inventory=True)
    assert node.inventory_fresh[-1] == {}


def test_a_cleanup_reports_kube_proxy_and_the_gate_services_as_seen_after_the_flush() -> None:
    api = FakeAPI(node_obj({"id": "m1.Cleanup.0", "type": "Cleanup",
                            "params": {"removeModes": ["iptables"], "targetMode": "nftables",
                                       "services": ["198.19.0.10:443", "198.19.0.11:80"]}}))
    order: list[str] = []
    agent = make_agent(api, flush_calls=order)
    def connect(targets: list[str]) -> dict[str, bool | str]:
        order.append("connect")
        return {t: t.endswith(":443") for t in targets}

    agent.effects.connect = connect  # type: ignore[method-assign]  # the test swaps this one seam
    agent.handle(api.get("n1"))
    assert order == [(["iptables"], "nftables"), "connect"]  # connects after the flush, not before
    node = ProxyNode.model_validate(api.obj)
    assert node.status.last_operation is not None
    assert node.status.last_operation.details["connects"] == {"198.19.0.10:443": True, "198.19.0.11:80": False}
    assert node.status.kube_proxy is not None
    assert node.status.kube_proxy.sync_count == 4
    plain = FakeAPI(node_obj({"id": "m2.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"]}}))
    make_agent(plain).handle(plain.get("n1"))
    plain_last = ProxyNode.model_validate(plain.obj).status.last_operation
    assert plain_last is not None
    assert "connects" not in plain_last.details


def test_a_restarted_agent_does_not_rerun_a_cleanup_and_reports_what_is_left() -> None:
    op = {"id": "m1.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}
    api = FakeAPI(node_obj(op, {"lastOperation": {"id": "m1.Cleanup.0", "type": "Cleanup", "state": "Running",
                                                  "startedAt": "2027-01-15T08:00:00Z"}}))
    calls: list = []
    make_agent(api, inventory=IPT_LEFT, flush_calls=calls).handle(api.get("n1"))
    assert calls == []
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Failed" and "did not re-run" in last.message and "1 iptables objects" in last.message
    assert last.details == {"recovered": True, "remaining": {"iptables": 1}}


def test_a_restarted_agent_reports_success_when_the_cleanup_had_completed() -> None:
    op = {"id": "m1.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}
    api = FakeAPI(node_obj(op, {"lastOperation": {"id": "m1.Cleanup.0", "type": "Cleanup", "state": "Running"}}))
    calls: list = []
    make_agent(api, inventory=CLEAN, flush_calls=calls).handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert calls == [] and last.state == "Succeeded" and last.details["recovered"] is True


def test_finished_operations_are_not_run_again_after_a_restart() -> None:
    op = {"id": "m1.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}
    api = FakeAPI(node_obj(op, {"lastOperation": {"id": "m1.Cleanup.0", "type": "Cleanup", "state": "Succeeded"}}))
    calls: list = []
    make_agent(api, flush_calls=calls).handle(api.get("n1"))
    assert calls == [] and api.patches == []


def test_failed_preflight_is_reported_with_what_is_missing() -> None:
    def refuse(mode: Mode, scheduler: str | None, **kw: Any) -> PreflightReport:
        assert kw["load_modules"] is True and kw["extra_modules"] == ["br_netfilter"]
        return PreflightReport(mode=mode, scheduler=scheduler, kernel_release="6.8.0", modules={},
                               tools=ToolVersions(),
                               missing=[Missing("kernel module ip_vs", "needed", "modprobe ip_vs")])

    api = FakeAPI(node_obj({"id": "m2.Preflight.0", "type": "Preflight",
                            "params": {"mode": "ipvs", "scheduler": "mh", "loadModules": True,
                                       "extraModules": ["br_netfilter"]}}))
    make_agent(api, preflight=refuse).handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Failed" and "kernel module ip_vs" in last.message
    assert last.details["missing"][0]["fix"] == "modprobe ip_vs"


def test_probe_reports_connects_in_the_shape_the_planner_reads() -> None:
    api = FakeAPI(node_obj({"id": "m3.Gate.0", "type": "Probe",
                            "params": {"services": ["198.19.0.1:443", "198.19.0.10:53"]}}))
    make_agent(api).handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Succeeded"
    assert last.details == {"connects": {"198.19.0.1:443": True, "198.19.0.10:53": "connection refused"}}
    assert "1/2 service connects ok" in last.message


def test_a_new_operation_replaces_every_detail_of_the_previous_one() -> None:
    api = FakeAPI(node_obj({"id": "a", "type": "Probe", "params": {"services": ["198.19.0.1:443"]}}))
    agent = make_agent(api)
    agent.handle(api.get("n1"))
    api.obj["spec"]["operation"] = {"id": "b", "type": "Probe", "params": {}}
    agent.handle(api.get("n1"))
    last = api.obj["status"]["lastOperation"]
    assert last["id"] == "b" and "details" not in last


def test_heartbeat_clears_an_old_error_and_writes_an_infinite_p99_as_a_finite_number() -> None:
    api = FakeAPI(node_obj(status={"kubeProxy": {"error": "connection refused", "proxyMode": None}}))
    slow = FACTS.model_copy(update={"sync_duration_p99_seconds": math.inf})
    agent = make_agent(api, facts=slow)
    agent.tick()
    assert api.patches == []                      # no ProxyNode seen yet: nothing to write to
    agent.handle(api.get("n1"))
    agent.tick()
    kp = api.obj["status"]["kubeProxy"]
    assert "error" not in kp and kp["syncDurationP99Seconds"] == P99_ABOVE_BUCKETS
    assert api.obj["status"]["kernelRelease"] == "6.1.0" and api.obj["status"]["tools"]["nft"] == "1.0.9"
    writes = len(api.patches)
    agent.tick()                                  # nothing due, nothing changed
    assert len(api.patches) == writes
    fake_clock(agent).t += 61                           # heartbeat due
    agent.tick()
    assert len(api.patches) == writes + 1


def test_unknown_modes_in_a_cleanup_fail_the_operation_not_the_agent() -> None:
    api = FakeAPI(node_obj({"id": "x", "type": "Cleanup", "params": {"removeModes": ["userspace"]}}))
    make_agent(api).handle(api.get("n1"))
    last = api.obj["status"]["lastOperation"]
    assert last["state"] == "Failed" and "unknown kube-proxy mode" in last["message"]


def test_cli_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "ps-node-1")
    cfg = parse_args(["--metrics-address", "127.0.0.1:10249", "--probe-interval", "5"])
    assert cfg.node == "ps-node-1" and cfg.probe_interval == 5
    monkeypatch.delenv("NODE_NAME")
    with pytest.raises(SystemExit):
        parse_args([])


@pytest.mark.parametrize(("argv", "said"), [
    (["--proc-root", "/nonexistent"], "--proc-root /nonexistent: not a proc filesystem"),
    (["--sys-root", "/etc"], "--sys-root /etc: not a sys filesystem"),
    (["--probe-interval", "0"], "--probe-interval must be a positive number"),
    (["--watch-timeout", "-5"], "--watch-timeout must be a positive number"),
])
def test_bad_agent_flags_are_one_line_and_exit_2(argv: list[str], said: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--node", "n1", *argv])
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_the_real_client_sends_a_merge_patch_to_the_status_subresource_and_a_field_selector() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    from proxyshift.agent.loop import KubeProxyNodeAPI

    seen: list[tuple[str, str, str | None, bytes]] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PATCH(self) -> None:
            payload = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("PATCH", self.path, self.headers.get("Content-Type"), payload))
            self._answer(node_obj())

        def do_GET(self) -> None:
            seen.append(("GET", self.path, None, b""))
            self._answer(node_obj())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        conf = client.Configuration()
        conf.host = f"http://127.0.0.1:{srv.server_address[1]}"
        api = KubeProxyNodeAPI(client.ApiClient(conf))
        api.get("n1")
        api.patch_status("n1", {"heartbeat": "2027-01-01T00:00:00Z", "kubeProxy": {"error": None}})
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen[0][:2] == ("GET", "/apis/proxyshift.io/v1alpha1/proxynodes/n1")
    method, path, ctype, payload = seen[1]
    assert (method, path, ctype) == ("PATCH", "/apis/proxyshift.io/v1alpha1/proxynodes/n1/status",
                                     "application/merge-patch+json")
    assert json.loads(payload) == {"status": {"heartbeat": "2027-01-01T00:00:00Z", "kubeProxy": {"error": None}}}


def _kubeconfig_for(tmp_path: Any, port: int) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n")
    return str(path)


def _counting_connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection urllib3 opens, still opened for real."""
    import urllib3.connection
    import urllib3.util.connection

    made: list[tuple[str, int]] = []
    real = urllib3.util.connection.create_connection

    def counted(address: tuple[str, int], *args: Any, **kwargs: Any) -> Any:
        made.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.connection.connection, "create_connection", counted)
    return made


def test_the_agents_client_makes_one_connection_attempt_to_an_api_server_that_is_away(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The watch's back-off is the only retry: urllib3's default made each of its tries four, at once."""
    import socket

    from proxyshift.agent.loop import KubeProxyNodeAPI

    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        made = _counting_connects(monkeypatch)
        api = KubeProxyNodeAPI(kubeconfig=_kubeconfig_for(tmp_path, port))
        with pytest.raises(Exception, match=r"(?i)refused|max retries"):
            api.get("n1")
    assert made == [("127.0.0.1", port)]
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_the_agents_client_tries_once_more_when_an_answer_breaks(tmp_path: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A keep-alive connection the server closed meanwhile is no outage: one retry on a new connection."""
    import contextlib
    import socket

    from proxyshift.agent.loop import KubeProxyNodeAPI

    accepted: list[int] = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.settimeout(5)

        def close_each() -> None:  # reads the request, closes without an answer
            with contextlib.suppress(OSError):
                while len(accepted) < 10:
                    conn, _ = srv.accept()
                    accepted.append(1)
                    conn.recv(65536)
                    conn.close()

        server = threading.Thread(target=close_each, daemon=True)
        server.start()
        made = _counting_connects(monkeypatch)
        api = KubeProxyNodeAPI(kubeconfig=_kubeconfig_for(tmp_path, srv.getsockname()[1]))
        with pytest.raises(Exception, match=r"(?i)disconnected|aborted|max retries"):
            api.get("n1")
    assert len(made) == 2


class FlakyAPI(FakeAPI):
    """Refuses the patches whose numbers (1-based) are listed."""

    def __init__(self, obj: dict[str, Any], fail_on: set[int]) -> None:
        super().__init__(obj)
        self.fail_on, self.calls = fail_on, 0

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if self.calls in self.fail_on:
            raise ConnectionError("API server away")
        return super().patch_status(name, status)


def test_an_unrecorded_start_runs_again_and_a_lost_result_is_sent_again() -> None:
    """A Cleanup runs while its Running record is written (a flush run twice finds nothing the second time):
    when that write fails its result is dropped and the next event runs it again; once recorded, a lost
    result goes out with the next status write and the operation is not run a third time."""
    op = {"id": "c1", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}
    api = FlakyAPI(node_obj(op), fail_on={1, 3})
    calls: list = []
    agent = make_agent(api, flush_calls=calls)
    flush = (["iptables"], "nftables")
    with pytest.raises(ConnectionError):
        agent.handle(api.get("n1"))          # flushed, but "Running" not recorded: the result is dropped
    assert calls == [flush]
    assert "lastOperation" not in (api.obj.get("status") or {})
    with pytest.raises(ConnectionError):
        agent.handle(api.get("n1"))          # recorded, flushed again, but the result write is lost
    assert calls == [flush, flush]
    assert api.obj["status"]["lastOperation"]["state"] == "Running"
    agent.handle(api.get("n1"))              # the watch redelivers: not run again
    agent.tick()                             # the result goes out with the next status write
    assert calls == [flush, flush]
    assert api.obj["status"]["lastOperation"]["state"] == "Succeeded"


class SlowAPI(FakeAPI):
    """The first patch (the Running record) returns only once the preflight has begun, or after 5 s."""

    def __init__(self, obj: dict[str, Any]) -> None:
        super().__init__(obj)
        self.preflight_began = threading.Event()
        self.overlapped: bool | None = None

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        if self.overlapped is None:
            self.overlapped = self.preflight_began.wait(5.0)
        return super().patch_status(name, status)


def test_a_read_only_operation_runs_while_its_running_record_is_written_and_reports_after_it() -> None:
    api = SlowAPI(node_obj({"id": "m1.Preflight.0", "type": "Preflight", "params": {"mode": "nftables"}}))

    def preflight(mode: str, scheduler: str | None, **kw: Any) -> PreflightReport:
        api.preflight_began.set()
        return FakeNode().preflight(mode, scheduler)

    agent = make_agent(api, preflight=preflight)
    agent.handle(api.get("n1"))
    assert api.overlapped is True
    assert [p["lastOperation"]["state"] for p in api.patches] == ["Running", "Succeeded"]


def test_a_read_only_operation_whose_running_record_failed_is_not_reported_and_runs_again() -> None:
    api = FlakyAPI(node_obj({"id": "m1.Preflight.0", "type": "Preflight", "params": {"mode": "nftables"}}),
                   fail_on={1})
    ran: list[str] = []

    def preflight(mode: str, scheduler: str | None, **kw: Any) -> PreflightReport:
        ran.append(mode)
        return FakeNode().preflight(mode, scheduler)

    agent = make_agent(api, preflight=preflight)
    with pytest.raises(ConnectionError):
        agent.handle(api.get("n1"))          # it ran beside the write, but counts as not started
    assert ran == ["nftables"] and api.patches == []
    agent.handle(api.get("n1"))              # the next event runs it again, as if it never had
    assert ran == ["nftables", "nftables"]
    assert [p["lastOperation"]["state"] for p in api.patches] == ["Running", "Succeeded"]


@pytest.mark.parametrize("rv", ["41", None])
def test_the_real_client_watches_with_bookmarks_and_from_now_without_a_version(rv: str | None) -> None:
    """The request the real client makes: bookmarks asked for, a resourceVersion only when the loop has one
    (None after a 410: the API server's current state), and a BOOKMARK event handed through to the loop."""
    import json
    import threading
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    from proxyshift.agent.loop import KubeProxyNodeAPI

    queries: list[dict[str, list[str]]] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:
            queries.append(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query))
            bookmark = {"kind": "ProxyNode", "apiVersion": "proxyshift.io/v1alpha1",
                        "metadata": {"resourceVersion": "900"}}
            line = json.dumps({"type": "BOOKMARK", "object": bookmark}) + "\n"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(line)))
            self.end_headers()
            self.wfile.write(line.encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        conf = client.Configuration()
        conf.host = f"http://127.0.0.1:{srv.server_address[1]}"
        events = list(KubeProxyNodeAPI(client.ApiClient(conf)).watch("n1", rv, 5))
    finally:
        srv.shutdown()
        srv.server_close()
    assert [(kind, obj["metadata"]["resourceVersion"]) for kind, obj in events] == [("BOOKMARK", "900")]
    (q,) = queries
    assert q["watch"] == ["true"] and q["allowWatchBookmarks"] == ["true"]
    assert q["fieldSelector"] == ["metadata.name=n1"]
    assert q.get("resourceVersion") == ([rv] if rv else None)


def test_the_watch_loop_gets_once_then_follows_resource_versions_and_starts_from_now_after_a_410() -> None:
    import queue
    import threading

    calls: list[tuple] = []
    stop = threading.Event()

    class WatchAPI(FakeAPI):
        def get(self, name: str) -> dict[str, Any]:
            calls.append(("get",))
            return super().get(name)

        def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            calls.append(("watch", rv))
            n = sum(1 for c in calls if c[0] == "watch")
            if n == 1:
                yield "MODIFIED", {**node_obj(), "metadata": {"name": "n1", "resourceVersion": "7"}}
            elif n == 2:
                yield "ERROR", {"kind": "Status", "code": 410}
            else:
                stop.set()

    events: queue.Queue = queue.Queue()
    agent = Agent(AgentConfig(node="n1", watch_timeout=1), WatchAPI(node_obj()), FakeNode())
    thread = threading.Thread(target=agent._watch_loop, args=(events, stop))
    thread.start()
    thread.join(timeout=20)
    # after the 410 the object's own version ("1") is not watched from again: the API server's current state
    assert calls == [("get",), ("watch", "1"), ("watch", "7"), ("watch", None)]
    assert events.qsize() == 2  # the GET's object and the MODIFIED one; no second GET


class Expired(Exception):
    """What the kubernetes client raises for a watch's 410 ERROR event (an ApiException with status 410)."""

    status = 410


@pytest.mark.parametrize("failure", ["exception", "event", "reset"])
def test_after_a_410_or_a_broken_watch_the_watch_starts_from_now_until_an_event_brings_a_version(
        failure: str) -> None:
    """An object unchanged since before an API server restart carries a version older than the new server's
    watch window: watching from it after a GET would answer 410 for ever. The next watch starts from the
    current state (its first event is the object), and follows that event's version afterwards. A watch that
    broke (the API server went away) does the same: one request where a GET, a 410 and the watch from now
    were three."""
    import queue
    import threading

    calls: list[tuple[str, str | None]] = []
    stop = threading.Event()

    class RestartedAPI(FakeAPI):
        def get(self, name: str) -> dict[str, Any]:
            calls.append(("get", None))
            return super().get(name)  # resourceVersion "1", from before the restart

        def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            calls.append(("watch", rv))
            if len(calls) > 8:  # the loop this test is about: end it, the assertion below says what went wrong
                stop.set()
            if rv == "1":
                if failure == "reset":
                    raise ConnectionResetError("the API server went away")
                if failure == "event":
                    yield "ERROR", {"kind": "Status", "code": 410, "reason": "Expired"}
                    return
                raise Expired("too old resource version: 1 (322)")
            if rv is None:
                yield "ADDED", {**node_obj(), "metadata": {"name": "n1", "resourceVersion": "330"}}
                return
            stop.set()
            yield from ()

    events: queue.Queue = queue.Queue()
    agent = Agent(AgentConfig(node="n1", watch_timeout=1), RestartedAPI(node_obj()), FakeNode(),
                  backoff_draw=lambda: 0.0)
    agent._watch_loop(events, stop)
    assert calls == [("get", None), ("watch", "1"), ("watch", None), ("watch", "330")]
    assert [events.get_nowait()["metadata"]["resourceVersion"] for _ in range(events.qsize())] == ["1", "330"]


def test_a_bookmark_moves_the_version_the_next_watch_resumes_from() -> None:
    """The object sits unchanged while the API server's window moves on: the renewal resumes from the
    bookmark's version, not from the object's own, and a bookmark is not an event to handle."""
    import queue
    import threading

    calls: list[str | None] = []
    stop = threading.Event()

    class IdleAPI(FakeAPI):
        def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            calls.append(rv)
            if len(calls) == 1:
                yield "BOOKMARK", {"kind": "ProxyNode", "metadata": {"resourceVersion": "900"}}
                return
            stop.set()
            yield from ()

    events: queue.Queue = queue.Queue()
    agent = Agent(AgentConfig(node="n1", watch_timeout=1), IdleAPI(node_obj()), FakeNode())
    agent._watch_loop(events, stop)
    assert calls == ["1", "900"]
    assert events.qsize() == 1  # the GET's object only


@pytest.mark.parametrize("draws, expected", [
    # draw 1: the ceilings themselves (no jitter). first outage: 1, 2, 4; the watch ran 60 s and broke: 1
    # again; then 2, 4 for the second outage
    ([1.0], [1.0, 2.0, 4.0, 1.0, 2.0, 4.0]),
    # other draws: each wait between the 0.5 s floor and that ceiling, where the draw says
    ([0.0, 0.5, 0.25, 1.0, 0.0, 0.5], [0.5, 1.25, 1.375, 1.0, 0.5, 2.25]),
])
def test_the_watch_back_off_starts_anew_after_a_watch_that_ran(monkeypatch: pytest.MonkeyPatch,
                                                               draws: list[float], expected: list[float]) -> None:
    """Two outages with a healthy watch between them: the second starts from the 1 s ceiling again, not where
    the first ended; each wait is drawn below its ceiling."""
    import queue
    import threading

    from proxyshift.agent import loop as loop_mod

    draw_iter = iter(draws * 6)
    clock = [0.0]
    monkeypatch.setattr(loop_mod.time, "monotonic", lambda: clock[0])
    script = ["down", "down", "down", "ok", "down", "down"]

    class Stop(threading.Event):
        waits: list[float] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.waits.append(timeout or 0.0)
            clock[0] += timeout or 0.0
            if not script:
                self.set()
            return self.is_set()

    gets: list[str] = []

    class FlakyAPI(FakeAPI):
        def get(self, name: str) -> dict[str, Any]:
            gets.append(name)
            if script and script[0] == "down":
                script.pop(0)
                raise ConnectionRefusedError("API server away")
            return super().get(name)

        def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            if script.pop(0) == "down":  # after an error the agent watches from now: no GET first
                raise ConnectionRefusedError("API server away")
            clock[0] += 60.0  # "ok": the watch runs 60 s, then the API server goes away again
            raise ConnectionResetError("API server restarting")
            yield  # a generator, like the real watch

    stop = Stop()
    agent = Agent(AgentConfig(node="n1", watch_timeout=300), FlakyAPI(node_obj()), FakeNode(),
                  backoff_draw=lambda: next(draw_iter))
    thread = threading.Thread(target=agent._watch_loop, args=(queue.Queue(), stop))
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert stop.waits[:6] == pytest.approx(expected), stop.waits
    assert gets == ["n1"]  # the first only


# ---- rule hold ----

# The migration a hold is made for: the agent keeps a hold only while its ProxyNode names it in flight.
SWITCHING = {"phase": "Switch", "toRevision": "p-1", "fromMode": "iptables", "toMode": "nftables", "attempt": 1,
             "startedAt": "2026-12-05T10:00:00Z"}
KEY = attempt_key(NodeMigration.model_validate(SWITCHING))


def hold_op(n: int = 0) -> dict[str, Any]:
    return {"id": f"{KEY}.Hold.{n}", "type": "Hold",
            "params": {"fromMode": "iptables", "toMode": "nftables", "ttlSeconds": 300}}


def hold_node(op: dict[str, Any] | None = None, **migration: Any) -> dict[str, Any]:
    """A ProxyNode whose migration (SWITCHING, changed by `migration`) asks for `op` (a Hold by default)."""
    return node_obj(op or hold_op(), migration={**SWITCHING, **migration})


OLD_PROXY = FACTS.model_copy(update={"proxy_mode": "iptables"})
NEW_STARTED = FACTS.model_copy(update={"process_start_time": 1.8e9, "last_sync_timestamp": 0.0})
NEW_SYNCED = FACTS.model_copy(update={"process_start_time": 1.8e9, "last_sync_timestamp": 1.8e9 + 1})
NO_KUBE_PROXY = KubeProxyFacts(error="GET http://127.0.0.1:10249/metrics: connection refused")


def test_hold_copies_the_old_rules_and_goes_once_a_new_kube_proxy_has_synced() -> None:
    api, hold = FakeAPI(hold_node()), FakeHold()
    seen = [OLD_PROXY]
    agent = make_agent(api, hold=hold)
    agent.effects.probe = lambda: seen[0]  # type: ignore[method-assign]  # the test swaps this seam
    agent.handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Succeeded" and "9 chains, 20 rules copied" in last.message
    assert hold.calls == ["install iptables"] and hold.present
    # The old kube-proxy syncing again is not a reason to let go: it is about to be replaced.
    agent.observe(inventory=False)
    seen[0] = NEW_STARTED           # the new one runs, has not synced yet
    agent.observe(inventory=False)
    assert hold.present and agent.hold is not None
    seen[0] = NEW_SYNCED
    agent.observe(inventory=False)
    assert not hold.present and agent.hold is None and hold.calls[-1] == "release"


OLD_RESTARTED_SYNCED = NEW_SYNCED.model_copy(update={"proxy_mode": "iptables"})


@pytest.mark.parametrize(("phase", "old_mode_sync_frees"), [
    ("Switch", False), ("Gate", False),  # the target's startup cleanup may still remove what the old one wrote
    ("RollingBack", True),               # the old mode is where the node goes back to
])
def test_while_switching_only_the_target_modes_sync_lets_the_hold_go(phase: str, old_mode_sync_frees: bool) -> None:
    """A Node deleted and registered again restarts the old kube-proxy (it exits when its Node's addresses
    change): its sync while the node switches proves nothing, the target kube-proxy's cleanup is still to come."""
    api, hold = FakeAPI(hold_node(phase=phase)), FakeHold()
    seen = [OLD_PROXY]
    agent = make_agent(api, hold=hold)
    agent.effects.probe = lambda: seen[0]  # type: ignore[method-assign]  # the test swaps this seam
    agent.handle(api.get("n1"))
    seen[0] = OLD_RESTARTED_SYNCED
    agent.observe(inventory=False)
    assert hold.present is not old_mode_sync_frees
    seen[0] = NEW_SYNCED
    agent.observe(inventory=False)
    assert not hold.present and hold.calls == ["install iptables", "release"]


def test_a_hold_a_restarted_agent_finds_while_the_node_switches_waits_for_the_targets_sync() -> None:
    """The agent killed after it made the hold: its successor cannot tell which kube-proxy the hold was made
    under, but the migration names the target, and the old kube-proxy's rules are what its cleanup removes."""
    hold = FakeHold(present=True)
    seen = [OLD_PROXY]
    api = FakeAPI(node_obj(migration={**SWITCHING, "phase": "Gate"}))
    agent = make_agent(api, hold=hold)
    agent.effects.probe = lambda: seen[0]  # type: ignore[method-assign]  # the test swaps this seam
    agent.handle(api.get("n1"))
    agent.observe(inventory=False)
    assert hold.present and agent.hold is not None
    seen[0] = NEW_SYNCED
    agent.observe(inventory=False)
    assert not hold.present and hold.calls == ["release"]


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_hold_never_outlives_its_time_to_live(abandoned: bool) -> None:
    """Abandoned too: one no kube-proxy serves without (none answers) stays only until its time runs out."""
    api, hold = FakeAPI(hold_node()), FakeHold()
    agent = make_agent(api, hold=hold, facts=OLD_PROXY)
    agent.handle(api.get("n1"))
    if abandoned:
        agent.effects.probe = lambda: NO_KUBE_PROXY  # type: ignore[method-assign]  # the test swaps this seam
        api.obj["spec"]["migration"] = None
        agent.handle(api.get("n1"))
    fake_clock(agent).t += 299
    agent.observe(inventory=False)
    assert hold.present
    fake_clock(agent).t += 2
    agent.observe(inventory=False)
    assert not hold.present and agent.hold is None


def test_a_failed_hold_is_reported_failed_and_nothing_is_recorded() -> None:
    api, hold = FakeAPI(node_obj(hold_op())), FakeHold(fail=True)
    agent = make_agent(api, hold=hold, facts=OLD_PROXY)
    agent.handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Failed" and "exit status 4" in last.message and agent.hold is None


def test_no_hold_between_modes_kube_proxy_does_not_clean_up() -> None:
    op = {"id": "m1.Hold.0", "type": "Hold", "params": {"fromMode": "iptables", "toMode": "ipvs"}}
    api, hold = FakeAPI(node_obj(op)), FakeHold()
    make_agent(api, hold=hold).handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Succeeded" and "no rule hold needed" in last.message and hold.calls == []


def test_cleanup_releases_the_hold_with_the_flush() -> None:
    api, hold = FakeAPI(node_obj({"id": "m1.Cleanup.0", "type": "Cleanup",
                                  "params": {"removeModes": ["iptables"], "targetMode": "nftables"}})),\
        FakeHold(present=True)
    agent = make_agent(api, hold=hold, facts=OLD_PROXY)
    agent._hold_checked = True  # the agent has not seen it: the cleanup removes it all the same
    agent.handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None
    assert last.state == "Succeeded" and "9 chains removed" in last.message and not hold.present


def test_a_hold_left_by_an_earlier_agent_goes_once_kube_proxy_has_synced() -> None:
    hold = FakeHold(present=True)
    agent = make_agent(FakeAPI(node_obj()), hold=hold, facts=NEW_STARTED)
    agent.observe(inventory=False)
    assert hold.present and agent.hold is not None  # found, kept while kube-proxy has not synced
    agent.effects.probe = lambda: NEW_SYNCED  # type: ignore[method-assign]  # the test swaps this seam
    agent.observe(inventory=False)
    assert not hold.present and hold.calls == ["release"]


# ---- a rule hold made with the preflight, and when it goes ----

def preflight_holding() -> dict[str, Any]:
    return {"id": f"{KEY}.Preflight.0", "type": "Preflight",
            "params": {"mode": "nftables", "scheduler": None,
                       "hold": {"fromMode": "iptables", "toMode": "nftables", "ttlSeconds": 300}}}


def held_with_the_preflight(hold: FakeHold, **migration: Any) -> tuple[FakeAPI, Agent]:
    """An agent that ran a passed preflight asking for the hold (waiting for its slot: phase Preflight)."""
    api = FakeAPI(hold_node(preflight_holding(), phase="Preflight", **migration))
    agent = make_agent(api, hold=hold, facts=OLD_PROXY)
    agent.handle(api.get("n1"))
    return api, agent


def test_a_passed_preflight_makes_the_hold_it_was_asked_for_and_says_so_in_the_status() -> None:
    hold = FakeHold()
    api, _ = held_with_the_preflight(hold)
    pn = ProxyNode.model_validate(api.obj)
    last = pn.status.last_operation
    assert last is not None and last.state == "Succeeded" and "9 chains, 20 rules copied" in last.message
    made = last.result_as(PreflightResult).hold
    assert made is not None and made.ok and "9 chains" in made.message
    assert hold.calls == ["install iptables"] and hold.present
    # One write carries the answer and the hold: the operator trusts a hold only while status.hold names it.
    assert pn.status.hold is not None and pn.status.hold.operation_id == f"{KEY}.Preflight.0"
    assert pn.status.hold.expires == "2027-01-15T08:05:00Z"  # the fake clock's start + ttlSeconds


def test_a_failed_preflight_makes_no_hold() -> None:
    def refuse(mode: str, scheduler: str | None, **kw: Any) -> PreflightReport:
        report = FakeNode().preflight(mode, scheduler)
        report.missing.append(Missing("nft", "not found", "install nftables"))
        return report

    api, hold = FakeAPI(hold_node(preflight_holding(), phase="Preflight")), FakeHold()
    agent = make_agent(api, hold=hold, facts=OLD_PROXY, preflight=refuse)
    agent.handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None and last.state == "Failed" and last.result_as(PreflightResult).hold is None
    assert hold.calls == [] and agent.hold is None


@pytest.mark.parametrize("now", [
    {"phase": "Pending", "reason": "PreflightExpired"},  # abandoned: expired, paused, halted, superseded
    {"phase": "Failed", "reason": "PreflightFailed"},
    {"phase": "Done"},
    {"phase": "Preflight", "attempt": 2},                # another attempt, its own preflight
    {"phase": "Preflight", "toRevision": "p-2"},         # another revision
    None,                                                # released: no migration at all
])
def test_a_hold_goes_as_soon_as_the_proxynode_no_longer_names_its_migration_in_flight(
        now: dict[str, Any] | None) -> None:
    hold = FakeHold()
    api, agent = held_with_the_preflight(hold)
    writes = len(api.patches)
    api.obj["spec"]["migration"] = None if now is None else {**SWITCHING, **now}
    if now is None:
        del api.obj["spec"]["operation"]
    agent.handle(api.get("n1"))
    assert not hold.present and hold.calls[-1] == "release" and agent.hold is None
    assert len(api.patches) > writes and ProxyNode.model_validate(api.obj).status.hold is None


@pytest.mark.parametrize("now", [{"phase": "Pending", "reason": "SwitchTimeout"}, None])
def test_an_abandoned_hold_stays_until_a_kube_proxy_serves_without_it(now: dict[str, Any] | None) -> None:
    """A Node deleted at Gate: its target kube-proxy exits before its first sync (kube-proxy leaves when its Node
    goes, and waits up to 30 s for a Node when it starts again), and the new Node's ProxyNode names no migration.
    The old rules went with the target's startup cleanup, so the hold is all that serves the node's Services:
    it stays through the abandon and goes at the first kube-proxy that has synced."""
    api, hold = FakeAPI(hold_node(phase="Switch")), FakeHold()
    seen = [OLD_PROXY]
    agent = make_agent(api, hold=hold)
    agent.effects.probe = lambda: seen[0]  # type: ignore[method-assign]  # the test swaps this seam
    agent.handle(api.get("n1"))
    assert hold.present
    agent.observe(inventory=False)   # the label moved: the target started, then exited with its Node
    seen[0] = NO_KUBE_PROXY
    api.obj["spec"]["migration"] = None if now is None else {**SWITCHING, **now}
    del api.obj["spec"]["operation"]
    agent.handle(api.get("n1"))      # the last probe saw the old kube-proxy: the abandon reads it again
    assert hold.present and agent.hold is not None
    for facts in (NO_KUBE_PROXY, NEW_STARTED):
        seen[0] = facts
        agent.observe(inventory=False)
        assert hold.present and agent.hold is not None
    seen[0] = NEW_SYNCED
    agent.observe(inventory=False)
    assert not hold.present and agent.hold is None and hold.calls == ["install iptables", "release"]


def test_a_release_that_fails_on_an_event_writes_nothing_and_is_tried_again_by_the_next_observe() -> None:
    hold = FakeHold()
    api, agent = held_with_the_preflight(hold)
    hold.release_fails = True
    api.obj["spec"]["migration"]["phase"] = "Pending"
    writes = len(api.patches)
    agent.handle(api.get("n1"))
    agent.handle(api.get("n1"))  # no write, so no watch event of its own to answer again: no write loop
    assert len(api.patches) == writes and hold.present and agent.hold is not None
    hold.release_fails = False
    agent.observe(inventory=False)
    assert not hold.present and agent.hold is None


@pytest.mark.parametrize("phase", ["Preflight", "Prepared", "Switch", "Gate", "RollingBack"])
def test_a_hold_stays_while_its_migration_may_still_switch_or_roll_back(phase: str) -> None:
    hold = FakeHold()
    api, agent = held_with_the_preflight(hold)
    api.obj["spec"]["migration"]["phase"] = phase
    agent.handle(api.get("n1"))
    agent.observe(inventory=False)
    assert hold.present and agent.hold is not None and hold.calls == ["install iptables"]


def test_a_hold_left_by_an_earlier_agent_with_no_migration_in_flight_goes_once_kube_proxy_serves() -> None:
    hold = FakeHold(present=True)
    api = FakeAPI(node_obj(migration={**SWITCHING, "phase": "Pending"}))
    agent = make_agent(api, hold=hold, facts=NEW_STARTED)
    agent.handle(api.get("n1"))
    agent.observe(inventory=False)  # the migration ended, but kube-proxy has not synced since it started
    assert hold.present and hold.calls == []
    agent.effects.probe = lambda: FACTS  # type: ignore[method-assign]  # the test swaps this seam
    agent.observe(inventory=False)
    assert not hold.present and hold.calls == ["release"]


def test_a_hold_that_went_with_a_restarted_kube_proxy_is_told_before_the_heartbeat_is_due() -> None:
    """The old kube-proxy restarting while the node waits for its slot ends the hold (a different process has
    synced): the status says so at once, so the switch asks for a new one instead of trusting the old answer."""
    hold = FakeHold()
    api, agent = held_with_the_preflight(hold)
    seen = [OLD_PROXY]
    fake_node(agent).probe = lambda: seen[0]  # type: ignore[method-assign]  # the test swaps this seam
    agent.tick()
    seen[0] = NEW_STARTED.model_copy(update={"proxy_mode": "iptables"})
    fake_clock(agent).t += 16
    agent.tick()                                     # a new process: written, the hold kept until it synced
    assert hold.present and ProxyNode.model_validate(api.obj).status.hold is not None
    writes = len(api.patches)
    seen[0] = NEW_SYNCED.model_copy(update={"proxy_mode": "iptables"})
    fake_clock(agent).t += 16
    agent.tick()                                     # nothing else changed, no heartbeat due
    assert not hold.present and len(api.patches) == writes + 1
    assert "hold" in api.patches[-1] and ProxyNode.model_validate(api.obj).status.hold is None


# ---- a probe waits on the node for the new kube-proxy's sync ----

def probe_op(**params: Any) -> dict[str, Any]:
    return {"id": "m1.Gate.0", "type": "Probe", "params": {"services": [], **params}}


T = TypeVar("T")


def _in_turn(answers: list[T]) -> Callable[[], T]:
    """Each call the next answer; the last one again once they are used up."""
    seen, last = iter(answers), [answers[0]]

    def answer() -> T:
        last[0] = next(seen, last[0])
        return last[0]

    return answer


def _recorded_sleeps(agent: Agent) -> list[float]:
    """The agent's sleeps, recorded; each moves its fake clock on instead of waiting."""
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        fake_clock(agent).t += seconds

    agent.sleep = sleep  # a swapped seam
    return sleeps


def _sequence_agent(api: FakeAPI, answers: list[KubeProxyFacts]) -> tuple[Agent, list[float]]:
    agent = make_agent(api)
    agent.effects.probe = _in_turn(answers)  # type: ignore[method-assign]  # a swapped seam
    return agent, _recorded_sleeps(agent)


STARTING = KubeProxyFacts(proxy_mode=None, error="connection refused")
UP_NOT_SYNCED = FACTS.model_copy(update={"last_sync_timestamp": 0.0, "sync_count": 0, "healthz_status": 503})


def test_a_probe_answers_once_the_new_kube_proxy_has_synced() -> None:
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=10)))
    agent, sleeps = _sequence_agent(api, [STARTING, STARTING, UP_NOT_SYNCED, FACTS])
    agent.handle(api.get("n1"))
    node = ProxyNode.model_validate(api.obj)
    assert node.status.last_operation is not None
    assert node.status.last_operation.state == "Succeeded"
    assert node.status.kube_proxy is not None
    assert node.status.kube_proxy.sync_count == 4 and len(sleeps) == 3  # answered at the first synced look
    # This /healthz has no per-family sync times: the full probe at every poll, as before they existed.
    assert sleeps == [PROBE_AWAIT_POLL_SECONDS] * 3


def test_a_probe_waits_no_longer_than_asked_and_then_reports_what_it_sees() -> None:
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=2)))
    agent, sleeps = _sequence_agent(api, [STARTING])
    agent.handle(api.get("n1"))
    node = ProxyNode.model_validate(api.obj)
    assert node.status.last_operation is not None
    assert node.status.kube_proxy is not None
    assert node.status.last_operation.state == "Succeeded" and node.status.kube_proxy.error
    assert 1.8 <= sum(sleeps) <= 2.2


def _health(last_updated: str, status: int = 200) -> KubeProxyHealth:
    """kube-proxy 1.37's /healthz: one IPv4 proxier, last Updated() at `last_updated`."""
    return KubeProxyHealth(status, (ProxierSync("IPv4", last_updated, True),), node_eligible=True)


BEFORE_SYNC, AFTER_SYNC = _health("2026-12-05T12:00:00.1Z"), _health("2026-12-05T12:00:00.2Z")


def _watching_agent(api: FakeAPI, answers: list[KubeProxyFacts],
                    healths: list[KubeProxyHealth]) -> tuple[Agent, list[float], list[str]]:
    """_sequence_agent with /healthz answered in turn too; the third list: the agent's reads, in order."""
    agent, sleeps = _sequence_agent(api, answers)
    reads: list[str] = []
    probe, health = agent.effects.probe, _in_turn(healths)

    def full() -> KubeProxyFacts:
        reads.append("probe")
        return probe()

    def cheap() -> KubeProxyHealth:
        reads.append("health")
        return health()

    agent.effects.probe, agent.effects.health = full, cheap  # type: ignore[method-assign]  # swapped seams
    return agent, sleeps, reads


def test_a_waiting_probe_reads_only_healthz_until_its_sync_time_moves() -> None:
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=10)))
    agent, sleeps, reads = _watching_agent(api, [UP_NOT_SYNCED, FACTS], [BEFORE_SYNC] * 5 + [AFTER_SYNC])
    agent.handle(api.get("n1"))
    # /healthz read before the first full probe, then alone at every short poll until it shows the sync.
    assert reads == ["health", "probe"] + ["health"] * 5 + ["probe"]
    assert sleeps == [PROBE_HEALTH_POLL_SECONDS] * 5
    kube_proxy = ProxyNode.model_validate(api.obj).status.kube_proxy
    assert kube_proxy is not None and kube_proxy.sync_count == 4


def test_a_waiting_probe_chases_metrics_that_lag_healthz() -> None:
    # /healthz shows the sync before /metrics counts it: the full probe again at the next short poll, not a
    # fallback interval later.
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=10)))
    agent, sleeps, reads = _watching_agent(api, [UP_NOT_SYNCED, UP_NOT_SYNCED, FACTS], [BEFORE_SYNC, AFTER_SYNC])
    agent.handle(api.get("n1"))
    assert reads == ["health", "probe", "health", "probe", "health", "probe"]
    assert sleeps == [PROBE_HEALTH_POLL_SECONDS] * 2


def test_a_waiting_probe_still_takes_the_full_probe_now_and_then() -> None:
    # A sync /healthz does not show (a missed change, an unhealthy answer turning healthy alone in /metrics)
    # is noticed within the fallback interval; the wait stays bounded and costs a full probe that often only.
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=10)))
    agent, sleeps, reads = _watching_agent(api, [UP_NOT_SYNCED, FACTS], [BEFORE_SYNC])
    agent.handle(api.get("n1"))
    assert reads.count("probe") == 2
    assert PROBE_FALLBACK_SECONDS <= sum(sleeps) <= PROBE_FALLBACK_SECONDS + 2 * PROBE_HEALTH_POLL_SECONDS
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=1)))
    agent, sleeps, reads = _watching_agent(api, [UP_NOT_SYNCED], [BEFORE_SYNC])
    agent.handle(api.get("n1"))
    assert 0.99 <= sum(sleeps) <= 1.01 + PROBE_HEALTH_POLL_SECONDS
    assert reads.count("probe") <= 1 + 1 / PROBE_FALLBACK_SECONDS and reads.count("health") >= 90


def test_a_waiting_probe_takes_the_full_probe_when_healthz_health_changes_alone() -> None:
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=10)))
    unhealthy = _health("2026-12-05T12:00:00.1Z", status=503)
    agent, sleeps, reads = _watching_agent(api, [UP_NOT_SYNCED, FACTS], [unhealthy, unhealthy, BEFORE_SYNC])
    agent.handle(api.get("n1"))
    assert reads == ["health", "probe", "health", "health", "probe"] and len(sleeps) == 2


IN_GATE_FLUSH = {"removeModes": ["iptables"], "targetMode": "nftables"}


def _probe_details(api: FakeAPI) -> tuple[str, ProbeResult]:
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None and last.state == "Succeeded"
    return last.message, last.result_as(ProbeResult)


def _gate_probe_counting_flushes(answers: list[KubeProxyFacts]) -> tuple[FakeAPI, Agent, list[str]]:
    """A gate Probe with the in-gate flush; the third list: how many flushes each connect came after. The
    flush takes a moment (real time), so a connect beside it sees none."""
    import time

    # The migration is in its gate: a hold the agent knows of is not abandoned (hold.abandoned) before the flush.
    api = FakeAPI(node_obj(probe_op(services=["198.19.0.10:443"], awaitMode="nftables", awaitSyncs=1,
                                    awaitSeconds=10, cleanup=IN_GATE_FLUSH), migration={**SWITCHING, "phase": "Gate"}))
    agent, _ = _sequence_agent(api, answers)
    node = fake_node(agent)
    order: list[str] = []
    connect, cleanup = node.connect, node.cleanup

    def counting_connect(targets: list[str]) -> dict[str, bool | str]:
        order.append(f"connect after {len(node.flush_calls)} flush(es)")
        return connect(targets)

    def slow_flush(remove: list[str], target: str | None) -> tuple[FlushReport, HoldReport]:
        time.sleep(0.05)
        return cleanup(remove, target)

    node.connect, node.cleanup = counting_connect, slow_flush  # type: ignore[method-assign]  # swapped seams
    return api, agent, order


def test_a_gate_probe_flushes_once_kube_proxy_has_synced() -> None:
    api, agent, order = _gate_probe_counting_flushes([STARTING, UP_NOT_SYNCED, FACTS])
    agent.handle(api.get("n1"))
    message, details = _probe_details(api)
    assert fake_node(agent).flush_calls == [(["iptables"], "nftables")] and len(order) == 1
    assert details.cleanup is not None and details.cleanup.ok is True
    assert details.cleanup.steps and details.cleanup.steps[0].removed == {"chains": 3}
    assert details.connects == {"198.19.0.10:443": True}
    assert "cleanup: " in message


def test_a_rule_hold_still_on_the_node_keeps_the_gate_s_connects_after_the_flush() -> None:
    # The hold's kube-proxy is the one running (as if its release had failed at the sync): the observe keeps
    # it, the in-gate flush releases it, and only then may the connects judge kube-proxy's own rules.
    api, agent, order = _gate_probe_counting_flushes([FACTS])
    node = fake_node(agent)
    node.held.present = True
    agent.hold = HoldRecord("iptables", "nftables", FACTS.process_start_time, fake_clock(agent).t + 600)
    agent.handle(api.get("n1"))
    assert order == ["connect after 1 flush(es)"] and node.held.calls == ["release"] and agent.hold is None
    assert _probe_details(api)[1].connects == {"198.19.0.10:443": True}


def test_a_gate_probe_flushes_nothing_while_kube_proxy_has_not_synced_in_its_mode() -> None:
    for answers in ([STARTING], [FACTS.model_copy(update={"proxy_mode": "iptables"})]):
        api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=1, cleanup=IN_GATE_FLUSH)))
        agent, _ = _sequence_agent(api, answers)
        agent.handle(api.get("n1"))
        node = agent.effects
        assert isinstance(node, FakeNode) and node.flush_calls == []
        assert _probe_details(api)[1].cleanup is None


def test_a_gate_probe_tells_a_flush_it_refused_without_failing_the_probe() -> None:
    refused = {"removeModes": ["userspace"], "targetMode": "nftables"}  # a mode the flush does not know
    api = FakeAPI(node_obj(probe_op(awaitMode="nftables", awaitSyncs=1, awaitSeconds=1, cleanup=refused)))
    agent, _ = _sequence_agent(api, [FACTS])
    agent.handle(api.get("n1"))
    message, details = _probe_details(api)
    assert details.cleanup is not None and details.cleanup.ok is False and details.cleanup.message
    assert "cleanup FAILED" in message


def test_a_probe_does_not_wait_on_a_kube_proxy_in_the_wrong_mode_or_when_not_asked() -> None:
    api = FakeAPI(node_obj(probe_op(awaitMode="iptables", awaitSyncs=1, awaitSeconds=10)))
    agent, sleeps = _sequence_agent(api, [FACTS])  # runs nftables: the gate fails it, no use waiting
    agent.handle(api.get("n1"))
    assert sleeps == []
    api = FakeAPI(node_obj(probe_op()))
    agent, sleeps = _sequence_agent(api, [STARTING])
    agent.handle(api.get("n1"))
    assert sleeps == []


class FakeDiagnoseTools:
    """The node's tools for a diagnose answer; `fail` makes the answer itself blow up."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], **kw: Any) -> Result:
        if self.fail:
            raise RuntimeError("the reader broke")
        self.calls.append(list(argv))
        return Result(list(argv), 0, "", "")


def _diagnose_request(request_id: str, record: str | None = "before") -> dict[str, Any]:
    return {"id": request_id, **({"record": record} if record else {}),
            "services": [{"namespace": "web", "name": "shop", "clusterIPs": ["198.19.0.10"],
                          "ports": [{"protocol": "TCP", "port": 80}], "endpoints": ["198.18.1.1:8080"]}]}


def _with_diagnose(agent: Agent, tools: FakeDiagnoseTools) -> Agent:
    from pathlib import Path

    fake_node(agent).readers = diag.Readers(runner=tools, proc_root=Path("/nonexistent"))
    return agent


def test_a_preflight_and_the_before_distribution_are_answered_in_one_write() -> None:
    op = {"id": "p.1.0.Preflight.0", "type": "Preflight", "params": {"mode": "nftables"}}
    obj = node_obj(op)
    obj["spec"]["diagnose"] = _diagnose_request("p.1.0.before")
    api = FakeAPI(obj)
    tools = FakeDiagnoseTools()
    agent = _with_diagnose(make_agent(api), tools)
    agent.handle(api.get("n1"))
    assert [p["lastOperation"]["state"] for p in api.patches] == ["Running", "Succeeded"]
    final = api.patches[-1]
    assert final["distribution"]["before"]["id"] == "p.1.0.before", final
    assert any(c[:2] == ["conntrack", "-L"] for c in tools.calls)
    # Answered once: a later event with the same request reads nothing again.
    tools.calls.clear()
    agent.handle(api.get("n1"))
    assert tools.calls == [] and len(api.patches) == 2


def test_a_broken_diagnose_beside_a_preflight_never_holds_back_the_preflight_s_report() -> None:
    op = {"id": "p.1.0.Preflight.0", "type": "Preflight", "params": {"mode": "nftables"}}
    obj = node_obj(op)
    obj["spec"]["diagnose"] = _diagnose_request("p.1.0.before")
    api = FakeAPI(obj)
    agent = _with_diagnose(make_agent(api), FakeDiagnoseTools(fail=True))
    agent._probe = lambda: (_ for _ in ()).throw(RuntimeError("metrics port gone"))  # type: ignore[method-assign]  # the test swaps this seam
    agent.handle(api.get("n1"))
    assert api.patches[-1]["lastOperation"]["state"] in ("Succeeded", "Failed")
    assert "distribution" not in api.patches[-1]


def test_a_diagnose_beside_a_cleanup_is_answered_first_on_its_own() -> None:
    op = {"id": "p.1.0.Cleanup.0", "type": "Cleanup", "params": {"removeModes": ["iptables"],
                                                                 "targetMode": "nftables"}}
    obj = node_obj(op)
    obj["spec"]["diagnose"] = _diagnose_request("d-1", record=None)
    api = FakeAPI(obj)
    agent = _with_diagnose(make_agent(api, inventory=IPT_LEFT), FakeDiagnoseTools())
    agent.handle(api.get("n1"))
    assert api.patches[0]["diagnostics"]["id"] == "d-1"
    assert api.patches[1]["lastOperation"]["state"] == "Running"


# A node on its way to (or on) Cilium's kube-proxy replacement: the agent reads Cilium's API (issue 19).

KPR_PARAMS = {"socketPath": "/var/run/cilium/cilium.sock", "frontends": ["198.19.0.1:443/TCP"],
              "expectedFrontends": 1}
CILIUM_OK = ReplacementFacts(agent_state="Ok", kube_proxy_replacement="True", enabled=True, cluster_ip_frontends=3,
                             probed_at="2026-11-30T12:00:00Z")


def test_a_probe_for_cilium_kpr_reports_cilium_in_the_status() -> None:
    api = FakeAPI(node_obj({"id": "k1.Gate.0", "type": "Probe",
                            "params": {"services": ["198.19.0.1:443"], "replacement": KPR_PARAMS}}))
    agent = make_agent(api)
    fake_node(agent).replaced = CILIUM_OK
    agent.handle(api.get("n1"))
    node = ProxyNode.model_validate(api.obj)
    # One read, as far as Cilium's health allows (test_cilium_api: the endpoints and the table once it is Ok).
    assert fake_node(agent).replacement_calls == [("/var/run/cilium/cilium.sock", True)]
    assert node.status.replacement == CILIUM_OK
    last = node.status.last_operation
    assert last is not None and last.state == "Succeeded"
    assert last.message.startswith("kube-proxy replacement True, agent Ok; 3 ClusterIP frontends, 0 of 1 asked "
                                   "missing; 1/1 service connects ok")



def test_a_replacement_read_error_is_cleared_once_its_api_answers() -> None:
    """The status is written as a merge patch: a field the new answer leaves out would stay. Seen on the local
    cluster: the first gate probe (Cilium not up yet) left `error`, and the gate waited on it forever."""
    api = FakeAPI(node_obj({"id": "k1.Gate.0", "type": "Probe", "params": {"replacement": KPR_PARAMS}}))
    agent = make_agent(api)
    agent.handle(api.get("n1"))  # Cilium's socket is not there yet
    unread = ProxyNode.model_validate(api.obj).status.replacement
    assert unread is not None and unread.error
    api.obj["spec"]["operation"] = {"id": "k1.Gate.1", "type": "Probe", "params": {"replacement": KPR_PARAMS}}
    fake_node(agent).replaced = CILIUM_OK
    agent.handle(api.get("n1"))
    assert ProxyNode.model_validate(api.obj).status.replacement == CILIUM_OK


def test_preflight_for_cilium_kpr_passes_without_cilium_and_refuses_a_sick_one() -> None:
    params = {"mode": "cilium-kpr", "scheduler": None, "replacement": KPR_PARAMS}
    api = FakeAPI(node_obj({"id": "k1.Preflight.0", "type": "Preflight", "params": params}))
    agent = make_agent(api)
    agent.handle(api.get("n1"))
    last = ProxyNode.model_validate(api.obj).status.last_operation
    assert last is not None and last.state == "Succeeded"
    assert "replacement agent is not on the node yet (it must start there with the node's label)" in last.message
    assert fake_node(agent).replacement_calls == [("/var/run/cilium/cilium.sock", False)]

    sick = FakeAPI(node_obj({"id": "k2.Preflight.0", "type": "Preflight", "params": params}))
    agent = make_agent(sick)
    fake_node(agent).replaced = ReplacementFacts(agent_state="Failure", agent_message="kvstore unreachable")
    agent.handle(sick.get("n1"))
    last = ProxyNode.model_validate(sick.obj).status.last_operation
    assert last is not None and last.state == "Failed"
    assert "a healthy kube-proxy replacement agent: it runs on the node but reports Failure (kvstore unreachable)" \
        in last.message
    assert last.result_as(PreflightResult).replacement == fake_node(agent).replaced


# ---- a replacement probe waits on the node until the replacement proves itself ----

def _replacement_sequence_agent(api: FakeAPI, answers: list[ReplacementFacts]) -> tuple[Agent, list[float]]:
    """Each round (one read: the client reads as far as the health allows) answers the next of `answers`."""
    agent = make_agent(api)
    answer = _in_turn(answers)

    def replacement(params: ReplacementParams, *, with_services: bool) -> ReplacementFacts:
        fake_node(agent).replacement_calls.append((params.socket_path, with_services))
        return answer()

    agent.effects.replacement = replacement  # type: ignore[method-assign]  # a swapped seam
    return agent, _recorded_sleeps(agent)


CILIUM_STARTING = ReplacementFacts(error="GET /v1/healthz on /var/run/cilium/cilium.sock: FileNotFoundError")
CILIUM_HOST_LOADING = CILIUM_OK.model_copy(update={"host_endpoint": "regenerating"})
CILIUM_READY = CILIUM_OK.model_copy(update={"host_endpoint": "ready"})


def test_a_replacement_probe_answers_once_the_replacement_proves_itself() -> None:
    api = FakeAPI(node_obj(probe_op(replacement=KPR_PARAMS, awaitSeconds=10)))
    agent, sleeps = _replacement_sequence_agent(api, [CILIUM_STARTING, CILIUM_HOST_LOADING, CILIUM_READY])
    agent.handle(api.get("n1"))
    node = ProxyNode.model_validate(api.obj)
    assert node.status.replacement == CILIUM_READY
    # One read a round; what it reads of Cilium is the client's choice (test_cilium_api).
    assert [full for _, full in fake_node(agent).replacement_calls] == [True, True, True]
    assert sleeps == [0.1, 0.1]
    assert node.status.last_operation is not None and node.status.last_operation.state == "Succeeded"


def test_a_replacement_probe_waits_no_longer_than_asked() -> None:
    api = FakeAPI(node_obj(probe_op(replacement=KPR_PARAMS, awaitSeconds=1)))
    agent, sleeps = _replacement_sequence_agent(api, [CILIUM_HOST_LOADING])
    agent.handle(api.get("n1"))
    # What it read last goes to the gate, which waits on it as before.
    assert ProxyNode.model_validate(api.obj).status.replacement == CILIUM_HOST_LOADING
    assert 9 <= len(sleeps) <= 11 and sum(sleeps) <= 1.1


def test_a_replacement_probe_waits_on_a_replacement_that_does_not_answer() -> None:
    api = FakeAPI(node_obj(probe_op(replacement=KPR_PARAMS, awaitSeconds=1)))
    agent, sleeps = _replacement_sequence_agent(api, [CILIUM_STARTING])
    agent.handle(api.get("n1"))
    calls = fake_node(agent).replacement_calls
    assert len(calls) == len(sleeps) + 1 and len(calls) >= 9 and sum(sleeps) <= 1.1
    assert ProxyNode.model_validate(api.obj).status.replacement == CILIUM_STARTING


def test_a_replacement_probe_without_a_wait_reads_once() -> None:
    api = FakeAPI(node_obj(probe_op(replacement=KPR_PARAMS)))
    agent, sleeps = _replacement_sequence_agent(api, [CILIUM_HOST_LOADING, CILIUM_READY])
    agent.handle(api.get("n1"))
    assert sleeps == [] and [full for _, full in fake_node(agent).replacement_calls] == [True]


def test_a_replacement_probe_reads_cilium_health_once_a_round(tmp_path: Path) -> None:
    """Through the agent's real client of Cilium's API: each round of the wait reads /v1/healthz once, then
    what that health allows (the endpoints, and the table once the host endpoint is ready)."""
    cilium = FakeCilium(tmp_path / "cilium.sock")
    try:
        hosts = _in_turn([endpoint(1, ["reserved:host"], "regenerating")] * 2 + [HOST])
        cilium.routes["/v1/endpoint"] = lambda handler: answer(200, [POD, hosts()])(handler)
        params = {"socketPath": str(cilium.path), "frontends": ["198.19.0.10:80/TCP"], "expectedFrontends": 4}
        api = FakeAPI(node_obj(probe_op(replacement=params, awaitSeconds=10)))
        agent = make_agent(api)
        agent.effects.replacement = KernelNodeEffects().replacement  # type: ignore[method-assign]  # the real read
        sleeps = _recorded_sleeps(agent)
        agent.handle(api.get("n1"))
    finally:
        cilium.close()
    replaced = ProxyNode.model_validate(api.obj).status.replacement
    assert replaced is not None and replaced.host_endpoint == "ready" and replaced.cluster_ip_frontends == 4
    assert sleeps == [0.1, 0.1]
    assert cilium.requests.count("/v1/healthz") == len(sleeps) + 1
    assert cilium.requests == ["/v1/healthz", "/v1/endpoint"] * 2 + ["/v1/healthz", "/v1/endpoint", "/v1/service"]
