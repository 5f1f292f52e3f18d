"""The behaviour probe's pure parts: parsers, the cell plan, cells from attempts, the budget."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, NoReturn
from xml.sax.saxutils import escape

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.agent import behaviour as bh
from proxyshift.agent import conntrack as ct
from proxyshift.agent import probe_server as ps
from proxyshift.api.behaviour import (
    MAX_CELLS,
    BehaviourCell,
    BehaviourParams,
    BehaviourTarget,
    ConntrackParams,
    Outcome,
    Protocol,
)
from proxyshift.commands import Result

pytestmark = pytest.mark.unit


def flow_xml(proto: str, src: str, dst: str, sport: int, dport: int, rsrc: str, rdst: str, rsport: int,
             rdport: int, state: str | None = None, unreplied: bool = False) -> str:
    num = {"tcp": 6, "udp": 17}[proto]

    def meta(direction: str, s: str, d: str, sp: int, dp: int) -> str:
        return (f'<meta direction="{direction}"><layer3 protonum="2" protoname="ipv4"><src>{s}</src>'
                f'<dst>{d}</dst></layer3><layer4 protonum="{num}" protoname="{proto}"><sport>{sp}</sport>'
                f"<dport>{dp}</dport></layer4></meta>")

    independent = (f"<state>{escape(state)}</state>" if state else "") + "<timeout>119</timeout><mark>0</mark>"
    independent += "<unreplied/>" if unreplied else ""
    return (f"<flow>{meta('original', src, dst, sport, dport)}{meta('reply', rsrc, rdst, rsport, rdport)}"
            f'<meta direction="independent">{independent}</meta></flow>')


def document(*flows: str) -> str:
    return '<?xml version="1.0" encoding="utf-8"?>\n<conntrack>\n' + "\n".join(flows) + "\n</conntrack>\n"


UNNATED = flow_xml("tcp", "198.18.1.2", "198.19.0.10", 40000, 80, "198.19.0.10", "198.18.1.2", 80, 40000,
                   "SYN_SENT", True)
NATED = flow_xml("tcp", "198.18.1.2", "198.19.0.10", 40001, 80, "198.18.5.5", "198.18.1.2", 8080, 40001,
                 "SYN_SENT", True)
OTHER = flow_xml("tcp", "198.18.1.2", "10.9.9.9", 40002, 80, "10.9.9.9", "198.18.1.2", 80, 40002, "SYN_SENT", True)
NODEPORT = flow_xml("tcp", "198.18.7.7", "198.18.1.2", 40003, 30080, "198.18.1.2", "198.18.7.7", 30080, 40003,
                    "SYN_SENT", True)
ESTABLISHED = flow_xml("tcp", "198.18.1.2", "198.19.0.11", 40004, 80, "198.19.0.11", "198.18.1.2", 80, 40004,
                       "ESTABLISHED")
UDP_UNREPLIED = flow_xml("udp", "198.18.1.2", "198.19.0.53", 5000, 53, "198.19.0.53", "198.18.1.2", 53, 5000,
                         unreplied=True)
UDP_ANSWERED = flow_xml("udp", "198.18.1.2", "198.19.0.53", 5001, 53, "198.19.0.53", "198.18.1.2", 53, 5001)


def test_conntrack_xml_is_parsed_into_flows() -> None:
    flows, truncated = ct.parse_flows(document(UNNATED, NATED, UDP_UNREPLIED))
    assert not truncated and len(flows) == 3
    assert flows[0] == ct.Flow("tcp", "198.18.1.2", "198.19.0.10", 40000, 80, "198.19.0.10", "198.18.1.2", 80,
                               40000, "SYN_SENT", True)
    assert not flows[0].nated and flows[1].nated and flows[1].reply_src == "198.18.5.5"
    assert flows[2].protocol == "udp" and flows[2].state is None and flows[2].unreplied
    assert ct.parse_flows("") == ([], False)


def test_the_step_picks_only_unnated_unanswered_flows_to_service_destinations() -> None:
    flows, _ = ct.parse_flows(document(UNNATED, NATED, OTHER, NODEPORT, ESTABLISHED, UDP_UNREPLIED, UDP_ANSWERED))
    services = ct.ServiceDestinations(ConntrackParams(service_cidrs=["198.19.0.0/16"], node_ports=[30080]),
                                      ["198.18.1.2"])
    assert [f.sport for f in ct.stale_flows(flows, services, "TCP")] == [40000, 40003]
    assert [f.sport for f in ct.stale_flows(flows, services, "UDP")] == [5000]
    # A NodePort counts only on the node's own addresses.
    elsewhere = ct.ServiceDestinations(ConntrackParams(node_ports=[30080]), ["198.18.9.9"])
    assert ct.stale_flows(flows, elsewhere, "TCP") == []


def test_the_step_deletes_each_entry_by_its_exact_tuple_and_reports_bounded() -> None:
    calls: list[list[str]] = []

    def runner(argv: Sequence[str], **kw: Any) -> Result:
        calls.append(list(argv))
        if argv[1] == "-L":
            return Result(list(argv), 0, document(UNNATED, NATED) if "tcp" in argv else document(UDP_UNREPLIED), "")
        return Result(list(argv), 0, "", "")

    report = ct.clean_unnated(ConntrackParams(service_cidrs=["198.19.0.0/16"]), ["198.18.1.2"], runner=runner)
    assert report.deleted_tcp == 1 and report.deleted_udp == 1 and report.scanned == 3 and not report.truncated
    deletes = [c for c in calls if c[1] == "-D"]
    # TCP: one call per destination, with the step's predicate as filters; UDP: each entry's own tuple.
    assert deletes[0] == ["conntrack", "-D", "-p", "tcp", "-d", "198.19.0.10", "--dport", "80", "-r",
                          "198.19.0.10", "--state", "SYN_SENT"]
    assert deletes[1][:4] == ["conntrack", "-D", "-p", "udp"] and "--sport" in deletes[1]
    assert calls[0][-2:] == ["--state", "SYN_SENT"]
    capped = ct.clean_unnated(ConntrackParams(service_cidrs=["198.19.0.0/16"], max_deletions=1),
                              ["198.18.1.2"], runner=runner)
    assert capped.deleted_tcp + capped.deleted_udp == 1 and capped.truncated


def test_the_batched_tcp_delete_counts_what_conntrack_says_it_deleted() -> None:
    unnated = [ct.Flow("tcp", "198.18.1.2", "198.19.0.10", 40000 + i, 80, "198.19.0.10", "198.18.1.2", 80,
                       40000 + i, "SYN_SENT", True) for i in range(5)]
    calls: list[list[str]] = []

    def runner(argv: Sequence[str], **kw: Any) -> Result:
        calls.append(list(argv))
        if argv[1] == "-L":
            return Result(list(argv), 0, "", "")
        # Two of the five answered meanwhile: conntrack deletes three and says so on stderr.
        return Result(list(argv), 0, "", "conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.\n")

    report = ct.ConntrackReport()
    left = ct._delete_tcp(unnated, 10, runner, report)
    assert (report.deleted_tcp, left, len(calls), len(report.entries)) == (3, 7, 1, 3)
    # Over the budget: entry by entry, never more than the budget.
    calls.clear()
    report = ct.ConntrackReport()
    assert ct._delete_tcp(unnated, 2, runner, report) == 0
    assert report.deleted_tcp == 2 and [c[c.index("--sport") + 1] for c in calls] == ["40000", "40001"]


def test_the_step_reports_a_tool_failure_instead_of_raising() -> None:
    from proxyshift.commands import ToolMissingError

    def runner(argv: Sequence[str], **kw: Any) -> NoReturn:
        raise ToolMissingError(argv, "not found on PATH")

    report = ct.clean_unnated(ConntrackParams(service_cidrs=["198.19.0.0/16"]), [], runner=runner)
    assert report.error and "not found" in report.error and report.deleted_tcp == 0


addresses = st.ip_addresses(v=4).map(str)
ports = st.integers(1, 65535)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tcp", "udp"]), addresses, addresses, ports, ports, addresses, ports,
                          st.sampled_from([None, "SYN_SENT", "ESTABLISHED"]), st.booleans()), max_size=30),
       st.integers(1, 40))
def test_parser_roundtrips_and_never_returns_more_than_asked(
        rows: list[tuple[str, str, str, int, int, str, int, str | None, bool]], max_flows: int) -> None:
    text = document(*(flow_xml(p, s, d, sp, dp, rs, s, rp, sp, state if p == "tcp" else None, un)
                      for p, s, d, sp, dp, rs, rp, state, un in rows))
    flows, truncated = ct.parse_flows(text, max_flows=max_flows)
    assert len(flows) == min(len(rows), max_flows) and truncated == (len(rows) > max_flows)
    for flow, (p, s, d, sp, dp, rs, _rp, _, un) in zip(flows, rows, strict=False):
        assert (flow.protocol, flow.src, flow.dst, flow.sport, flow.dport, flow.reply_src, flow.unreplied) == (
            p, s, d, sp, dp, rs, un)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 30), st.integers(200, 6000))
def test_parser_cuts_oversized_output_at_a_whole_flow(count: int, max_bytes: int) -> None:
    text = document(*([UNNATED] * count))
    flows, truncated = ct.parse_flows(text, max_bytes=max_bytes)
    assert len(flows) <= count and all(f == ct.parse_flows(document(UNNATED))[0][0] for f in flows)
    assert truncated == (len(text.encode()) > max_bytes)
    assert len(flows) * len(UNNATED) <= max_bytes


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=300))
def test_parser_takes_garbage_without_surprises(text: str) -> None:
    try:
        flows, _ = ct.parse_flows(text)
    except ct.ConntrackOutputError:
        return
    assert isinstance(flows, list)


IP_JSON = json.dumps([
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "scope": "host"}]},
    {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "198.18.1.2"},
                                     {"family": "inet6", "local": "fe80::1"},
                                     {"family": "inet", "local": "169.254.3.3"}]},
    {"ifname": "eth1", "addr_info": [{"family": "inet", "local": "198.18.9.1"}]},
    {"ifname": "kube-ipvs0", "addr_info": [{"family": "inet", "local": "198.19.0.10"}]},
])


def test_node_addresses_put_the_node_ips_first_and_skip_loopback_link_local_and_ipvs() -> None:
    assert bh.parse_ip_addr(IP_JSON) == [("198.18.1.2", "eth0"), ("198.18.9.1", "eth1"),
                                         ("198.19.0.10", "kube-ipvs0")]
    runner = lambda argv, **kw: Result(list(argv), 0, IP_JSON, "")  # noqa: E731
    assert bh.node_addresses(["198.18.9.1"], runner=runner) == ["198.18.9.1", "198.18.1.2"]
    with pytest.raises(ValueError):
        bh.parse_ip_addr("x" * 100, max_bytes=10)


def T(service: str, address: str | None, **kw: Any) -> BehaviourTarget:
    return BehaviourTarget(service=service, kind=kw.pop("kind", "ClusterIP"), port=kw.pop("port", 80),
                           address=address, **kw)


def test_plan_expands_nodeports_and_keeps_localhost_node_only() -> None:
    params = BehaviourParams(targets=[T("a/np", None, kind="NodePort", port=30080), T("a/c", "198.19.0.10")],
                             node_ips=["198.18.1.2"])
    planned, truncated = bh.plan_cells(params, ["198.18.1.2", "198.18.9.1"], pod_path=True)
    got = [(c.target.service, c.address, c.role, c.path) for c in planned]
    assert got == [("a/np", "198.18.1.2", "nodeIP", "node"), ("a/np", "198.18.9.1", "otherAddress", "node"),
                   ("a/np", "127.0.0.1", "localhost", "node"), ("a/np", "198.18.1.2", "nodeIP", "pod"),
                   ("a/np", "198.18.9.1", "otherAddress", "pod"), ("a/c", "198.19.0.10", "clusterIP", "node"),
                   ("a/c", "198.19.0.10", "clusterIP", "pod")]
    assert not truncated
    assert [c.path for c in bh.plan_cells(params, [], pod_path=False)[0]] == ["node", "node"]


def test_plan_keeps_to_max_cells() -> None:
    params = BehaviourParams(targets=[T(f"a/np{i}", None, kind="NodePort") for i in range(40)])
    planned, truncated = bh.plan_cells(params, ["198.18.1.2", "198.18.1.3"], pod_path=True)
    assert len(planned) == MAX_CELLS and truncated


def cell_for(target: BehaviourTarget, attempts: list[bh.Attempt], known: dict | None = None) -> BehaviourCell:
    planned = bh.PlannedCell(target, target.address or "198.18.1.2", "clusterIP", "node")
    return bh.build_cell(planned, attempts, known or {})


def answered(port: int, payload: str = "ep-a") -> bh.Attempt:
    return bh.Attempt("answered", payload=payload, source=("198.18.1.2", port))


def test_cells_judge_stickiness_and_locality_on_conntrack_addresses() -> None:
    t = T("a/aff", "198.19.0.10", attempts=3, local_endpoints=["198.18.3.3"])
    key = lambda port: ("TCP", "198.18.1.2", port, "198.19.0.10", 80)  # noqa: E731
    same = cell_for(t, [answered(1), answered(2), answered(3)], {key(p): "198.18.3.3" for p in (1, 2, 3)})
    assert same.sticky is True and same.local is True and same.endpoints == ["198.18.3.3"]
    mixed = cell_for(t, [answered(1), answered(2), answered(3)],
                     {key(1): "198.18.3.3", key(2): "198.18.4.4", key(3): "198.18.3.3"})
    assert mixed.sticky is False and mixed.local is False and mixed.endpoints == ["198.18.3.3", "198.18.4.4"]
    by_name = cell_for(t, [answered(1), answered(2), answered(3)])
    assert by_name.endpoints == ["ep-a"] and by_name.sticky is True and by_name.local is None


def test_an_answer_that_named_no_endpoint_leaves_stickiness_unjudged() -> None:
    t = T("a/aff", "198.19.0.10", attempts=3)
    cell = cell_for(t, [answered(1), answered(2, payload=""), answered(3)])
    assert cell.outcome == "answered" and cell.sticky is None and "1 of 3 answers named no endpoint" in cell.detail


def test_a_tcp_dial_waits_for_the_first_line_only_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint that waits for the client to speak (TLS, HTTP) answers the connect; the dial does not
    then wait out the whole attempt timeout for a line that never comes."""
    waits: list[tuple[bool, float]] = []

    def record(sock: socket.socket, *, write: bool, timeout: float) -> bool:
        waits.append((write, timeout))
        return write  # connected; no first line

    monkeypatch.setattr(bh, "_wait", record)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        attempt = bh.dial_tcp("127.0.0.1", server.getsockname()[1], 5.0)
    assert attempt.outcome == "answered" and attempt.payload is None
    (connect_write, connect_wait), (line_write, line_wait) = waits
    assert connect_write and connect_wait > 4.0
    assert not line_write and line_wait <= bh.FIRST_LINE_WAIT_SECONDS


def test_under_kube_proxy_a_dial_waits_for_the_line_a_tenth_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under kube-proxy conntrack names the endpoints, so the first line is only a fallback: a TLS endpoint
    costs each dial FIRST_LINE_WAIT_UNDER_KUBE_PROXY_SECONDS. Without kube-proxy (mode None: Cilium's KPR)
    the line is the endpoint's name and the wait stays."""
    waits: list[float] = []

    def record(sock: socket.socket, *, write: bool, timeout: float) -> bool:
        if not write:
            waits.append(timeout)
        return write

    monkeypatch.setattr(bh, "_wait", record)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        assert bh.dial_under_kube_proxy("127.0.0.1", port, "TCP", 5.0).outcome == "answered"
        assert bh.dial("127.0.0.1", port, "TCP", 5.0).outcome == "answered"
    assert waits == [bh.FIRST_LINE_WAIT_UNDER_KUBE_PROXY_SECONDS, bh.FIRST_LINE_WAIT_SECONDS]


@pytest.mark.parametrize(("mode", "chosen"), [("nftables", "dial_under_kube_proxy"),
                                              ("iptables", "dial_under_kube_proxy"),
                                              ("ipvs", "dial_under_kube_proxy"), (None, "dial")])
def test_the_matrix_dials_by_the_nodes_mode(monkeypatch: pytest.MonkeyPatch, mode: str | None, chosen: str) -> None:
    used: list[str] = []

    def jobs(_: Any, *, dialer: Any, **__: Any) -> tuple[list[list[bh.Attempt]], bool]:
        used.append(dialer.__name__)
        return [], False

    monkeypatch.setattr(bh, "run_jobs", jobs)
    params = BehaviourParams.model_validate({"targets": [], "budgetSeconds": 0.5})
    bh.run_behaviour(params, mode=mode, runner=lambda *a, **k: Result(list(a), 0, "", ""))
    assert used == [chosen]


def test_cells_report_the_first_failure_and_partial_answers() -> None:
    t = T("a/c", "198.19.0.10", attempts=2)
    cell = cell_for(t, [answered(1), bh.Attempt("refused", "connection refused")])
    assert cell.outcome == "refused" and cell.detail.startswith("1/2 attempts answered") and cell.sticky is None
    assert cell_for(t, []).outcome == "timeout" and "budget" in cell_for(t, []).detail


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.t

    def dialer(self, outcome: Outcome) -> Callable[[str, int, str, float], bh.Attempt]:
        def dial(address: str, port: int, protocol: str, timeout: float) -> bh.Attempt:
            with self.lock:
                self.t += timeout if outcome == "timeout" else 0.001
            return bh.Attempt(outcome)
        return dial


def test_jobs_stop_at_the_deadline_and_say_so() -> None:
    clock = FakeTime()
    jobs = [bh.DialJob("198.19.0.10", 80, "TCP", 8) for _ in range(3)]
    results, cut = bh.run_jobs(jobs, attempt_timeout=0.25, deadline=101.0, dialer=clock.dialer("timeout"),
                               clock=clock, workers=1)
    assert cut and sum(len(r) for r in results) == 4 and clock.t <= 101.0


def test_no_retry_by_default() -> None:
    tries: list[str] = []

    def dial(address: str, port: int, protocol: str, timeout: float) -> bh.Attempt:
        tries.append(address)
        return bh.Attempt("timeout")

    bh.run_jobs([bh.DialJob("198.19.0.1", 80, "TCP", 1)], attempt_timeout=0.25, deadline=110.0, dialer=dial,
                clock=FakeTime(), workers=1)
    assert tries == ["198.19.0.1"]


def test_with_retries_on_a_lone_timeout_is_tried_once_more_and_a_refusal_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bh, "RETRY_TIMEOUTS", True)
    clock = FakeTime()
    tries: list[str] = []

    def dial(address: str, port: int, protocol: str, timeout: float) -> bh.Attempt:
        tries.append(address)
        return bh.Attempt("timeout" if address == "198.19.0.1" else "refused")

    results, cut = bh.run_jobs([bh.DialJob("198.19.0.1", 80, "TCP", 1), bh.DialJob("198.19.0.2", 80, "TCP", 1)],
                               attempt_timeout=0.25, deadline=110.0, dialer=dial, clock=clock, workers=1)
    assert tries == ["198.19.0.1", "198.19.0.1", "198.19.0.2"] and not cut
    assert [len(r) for r in results] == [1, 1]


def test_printable_line_is_bounded() -> None:
    assert bh.printable_line(b"ep-a\nrest") == "ep-a"
    assert bh.printable_line(b"\x00\x01\xff") is None
    assert len(bh.printable_line(b"x" * 500) or "") == 64


def test_the_probe_server_refuses_bad_requests() -> None:
    for body, why in [(b"{", "not JSON"), (b"[]", "jobs list"),
                      (json.dumps({"jobs": [{"address": "x", "port": 80, "protocol": "TCP"}]}).encode(), "IP"),
                      (json.dumps({"jobs": [{"address": "198.19.0.1", "port": 0, "protocol": "TCP"}]}).encode(),
                       "port"),
                      (json.dumps({"jobs": [], "budgetSeconds": 100}).encode(), "budgetSeconds"),
                      (json.dumps({"jobs": [{"address": "198.19.0.1", "port": 1, "protocol": "TCP"}] * 200}).encode(),
                       "at most")]:
        with pytest.raises(ps.BadRequest, match=why):
            ps.parse_request(body)


def test_the_probe_server_answers_over_http_and_the_agent_reads_it() -> None:
    server = ps.ProbeServer(("127.0.0.1", 0))
    ps.ProbeHandler.dialer = staticmethod(lambda a, p, proto, t: bh.Attempt(
        "answered", payload="ep-z", source=("198.18.2.5", 41000)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        where = f"127.0.0.1:{server.server_address[1]}"
        answer = bh.ask_pod(where, [bh.DialJob("198.19.0.10", 80, "TCP", 2)], attempt_timeout=0.2, budget=0.5)
        assert answer.results == [[bh.Attempt("answered", "", "ep-z", ("198.18.2.5", 41000))] * 2]
        with urllib.request.urlopen(f"http://{where}/healthz", timeout=2) as r:
            assert r.status == 200
        big = urllib.request.Request(f"http://{where}/probe", data=b"x" * (ps.MAX_REQUEST_BYTES + 1), method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(big, timeout=2)
        assert err.value.code == 413
    finally:
        ps.ProbeHandler.dialer = staticmethod(bh.dial)
        server.shutdown()
        server.server_close()


JOBS = [bh.DialJob("198.19.0.10", 80, "TCP", 2), bh.DialJob("198.19.0.11", 53, "UDP", 1)]
attempt_json = st.fixed_dictionaries({"outcome": st.sampled_from(["answered", "refused", "timeout"]),
                                      "detail": st.text(max_size=300), "payload": st.none() | st.text(max_size=100),
                                      "source": st.none() | st.text(max_size=70)})


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(attempt_json, max_size=5), min_size=2, max_size=2), st.sampled_from([True, False, "yes"]))
def test_a_pod_answer_is_bounded_and_checked(results: list[list[dict[str, Any]]], truncated: bool | str) -> None:
    answer = bh.parse_pod_answer(json.dumps({"results": results, "truncated": truncated}).encode(), JOBS)
    assert [len(r) for r in answer.results] == [min(len(results[0]), 2), min(len(results[1]), 1)]
    assert answer.truncated is (truncated is True)
    for attempts in answer.results:
        for a in attempts:
            assert len(a.detail) <= 200 and (a.payload is None or len(a.payload) <= 64)
            assert a.source is None or (len(a.source[0]) <= 45 and 0 < a.source[1] < 65536)


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=200))
def test_a_garbage_pod_answer_is_a_value_error(data: bytes) -> None:
    try:
        bh.parse_pod_answer(data, JOBS)
    except ValueError:
        return


def test_a_pod_answer_of_the_wrong_shape_is_refused() -> None:
    for bad in [b"[]", b'{"results": [[]]}', b"[" * 100_000, b'{"results": [[{"outcome": "maybe"}], []]}',
                b"x" * (bh.MAX_POD_ANSWER_BYTES + 1)]:
        with pytest.raises(ValueError):
            bh.parse_pod_answer(bad, JOBS)


def test_the_step_lists_each_ip_family_the_service_destinations_are_in() -> None:
    calls: list[list[str]] = []

    def runner(argv: Sequence[str], **kw: Any) -> Result:
        calls.append(list(argv))
        return Result(list(argv), 0, "", "")

    ct.clean_unnated(ConntrackParams(service_cidrs=["198.19.0.0/16", "fd00:19::/108"], protocols=["TCP"]),
                     ["198.18.1.2"], runner=runner)
    assert [("-f" in c and c[c.index("-f") + 1]) for c in calls] == [False, "ipv6"]
    v6 = ct.Flow("tcp", "fd00:18::2", "fd00:19::a", 40000, 80, "fd00:19::a", "fd00:18::2", 80, 40000, "SYN_SENT", True)
    assert ct.delete_argv(v6)[:4] == ["conntrack", "-D", "-f", "ipv6"]
    ct.clean_unnated(ConntrackParams(node_ports=[30080], protocols=["UDP"]), [], runner=runner)
    assert calls[-1][-2:] == ["-o", "xml"]  # NodePorts with no known address: IPv4 (loopback)


class ConntrackTable:
    """`conntrack -L -p P [-s SRC]` over a fixed table, filtering as the kernel does; records calls."""

    def __init__(self, *flows: str) -> None:
        self.flows = [(x, ct.parse_flows(document(x))[0][0]) for x in flows]
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float, **kw: Any) -> Result:
        self.calls.append(list(argv))
        opts = dict(zip(argv[2::2], argv[3::2], strict=False))
        chosen = [x for x, f in self.flows
                  if f.protocol == opts["-p"] and ("-s" not in opts or f.src == opts["-s"])]
        return Result(list(argv), 0, document(*chosen), "")


IDENTITY_TABLE = (
    # the node's probe from its own address, from 127.0.0.1 (a NodePort) and the pod's, all NATed
    flow_xml("tcp", "198.18.1.2", "198.19.0.10", 41000, 80, "198.18.5.5", "198.18.1.2", 8080, 41000, "TIME_WAIT"),
    flow_xml("tcp", "127.0.0.1", "127.0.0.1", 41001, 30080, "198.18.5.6", "198.18.1.2", 8080, 41001, "TIME_WAIT"),
    flow_xml("tcp", "10.244.1.9", "198.19.0.10", 41002, 80, "198.18.5.7", "10.244.1.9", 8080, 41002, "TIME_WAIT"),
    flow_xml("udp", "198.18.1.2", "198.19.0.53", 41003, 53, "198.18.5.8", "198.18.1.2", 5353, 41003),
    # someone else's flow from the same source and to the same Service: never an identity
    flow_xml("tcp", "198.18.1.2", "198.19.0.10", 41999, 80, "198.18.9.9", "198.18.1.2", 8080, 41999, "TIME_WAIT"),
)
IDENTITY_KEYS: set[bh.FlowKey] = {
    ("TCP", "198.18.1.2", 41000, "198.19.0.10", 80), ("TCP", "127.0.0.1", 41001, "127.0.0.1", 30080),
    ("TCP", "10.244.1.9", 41002, "198.19.0.10", 80), ("UDP", "198.18.1.2", 41003, "198.19.0.53", 53),
    ("TCP", "198.18.1.2", 41004, "198.19.0.10", 80)}  # the last one has no entry
IDENTITIES = {("TCP", "198.18.1.2", 41000, "198.19.0.10", 80): "198.18.5.5",
              ("TCP", "127.0.0.1", 41001, "127.0.0.1", 30080): "198.18.5.6",
              ("TCP", "10.244.1.9", 41002, "198.19.0.10", 80): "198.18.5.7",
              ("UDP", "198.18.1.2", 41003, "198.19.0.53", 53): "198.18.5.8"}


def test_identities_come_from_one_dump_per_protocol_matched_on_the_whole_tuple() -> None:
    table = ConntrackTable(*IDENTITY_TABLE)
    found = bh.conntrack_identities(IDENTITY_KEYS, runner=table, deadline=time.monotonic() + 5,
                                    table_size=lambda: 40)
    assert found == IDENTITIES
    # Three sources and two protocols were four `-s SRC` look-ups; now two dumps.
    assert sorted(table.calls) == [["conntrack", "-L", "-p", p, "-o", "xml"] for p in ("tcp", "udp")]


def test_a_dump_cut_at_its_bound_is_looked_up_again_per_source(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = ct.list_flows

    def tcp_dump_cut(protocol: Protocol, **kw: Any) -> tuple[list[ct.Flow], bool]:
        flows, cut = whole(protocol, **kw)
        return flows, cut or (protocol == "TCP" and kw.get("source") is None)  # as past MAX_XML_BYTES

    monkeypatch.setattr(ct, "list_flows", tcp_dump_cut)
    table = ConntrackTable(*IDENTITY_TABLE)
    found = bh.conntrack_identities(IDENTITY_KEYS, runner=table, deadline=time.monotonic() + 5,
                                    table_size=lambda: 40)
    assert found == IDENTITIES
    sources = sorted(c[c.index("-s") + 1] for c in table.calls if "-s" in c)
    assert sources == ["10.244.1.9", "127.0.0.1", "198.18.1.2"]  # TCP only: the UDP dump was whole


def test_a_large_table_is_never_dumped_the_kernel_filters_per_source() -> None:
    table = ConntrackTable(*IDENTITY_TABLE)
    found = bh.conntrack_identities(IDENTITY_KEYS, runner=table, deadline=time.monotonic() + 5,
                                    table_size=lambda: ct.DUMP_MAX_ENTRIES + 1)
    assert found == IDENTITIES
    assert all("-s" in c for c in table.calls) and len(table.calls) == 4  # (TCP, 3 sources) + (UDP, 1)


def test_a_full_dump_is_parsed_without_building_its_whole_tree() -> None:
    """A 2,000-flow dump (the most the agent dumps whole) peaks at a few MiB, not a tree of every flow:
    fed whole it was ~12 MiB per dump, which fragmented the agent's heap migration after migration."""
    import tracemalloc

    text = document(*(NATED.replace("198.18", f"198.{18 + i % 2}") for i in range(2_000)))
    tracemalloc.start()
    try:
        flows, truncated = ct.parse_flows(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(flows) == 2_000 and not truncated
    assert peak < 2 * len(text) + 2 * 1024 * 1024, f"peak {peak} bytes for {len(text)} bytes of XML"
