"""The node side of `proxyshift diagnose`: kernel counters parsed from real tool output, bounded."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agent_loop import FakeNode as FakeAgentNode

from proxyshift.agent import conntrack as conntrack_mod
from proxyshift.agent import diagnostics as diag
from proxyshift.agent.loop import Agent, AgentConfig
from proxyshift.api.diagnostics import DiagnosePort, DiagnoseRequest, DiagnoseService
from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.commands import CommandError, Result

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent.parent / "fixtures"
KUBE_PROXY_SAVE = (FIXTURES / "iptables" / "kube-proxy-v1.37.2-iptables-30-services.save.txt").read_text()
IPVS_STATS = (FIXTURES / "ipvsadm" / "ipvs-node-with-keepalived.stats.txt").read_text()
IPVS_SAVE = (FIXTURES / "ipvsadm" / "ipvs-node-with-keepalived.Sn.txt").read_text()


def with_counters(text: str, packets: dict[str, int]) -> str:
    """The real kube-proxy dump as `iptables-save -c` prints it: `[packets:bytes]` before each rule.

    A DNAT rule to an endpoint in `packets` gets that count, every other rule 0.
    """
    lines = []
    for line in text.splitlines():
        if line.startswith("-A "):
            dnat = re.search(r"--to-destination (\S+)", line)
            n = packets.get(dnat.group(1), 0) if dnat else 0
            line = f"[{n}:{n * 60}] {line}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_iptables_counters_of_a_real_kube_proxy_dump_are_the_dnat_rules_packets() -> None:
    text = with_counters(KUBE_PROXY_SAVE, {"198.18.16.25:8080": 70, "198.18.16.26:8080": 30, "198.18.16.4:8080": 9})
    counted = diag.parse_iptables_counters(text, "ns2/svc12")
    assert counted.flows == {"198.18.16.25:8080": 70, "198.18.16.26:8080": 30}
    # The Service's own chains: its SVC chain (masquerade + two endpoint jumps), EXT chain, two SEP chains.
    assert counted.chains == {"KUBE-SVC-HAAXGVVJ3FYQTALW": 3, "KUBE-EXT-HAAXGVVJ3FYQTALW": 1,
                              "KUBE-SEP-DATOQU4GOKQ3JWJD": 2, "KUBE-SEP-BQVF2Y5464GH74YC": 2}
    assert not counted.chains_cut


def test_a_service_whose_name_is_a_prefix_of_another_gets_only_its_own_rules() -> None:
    text = with_counters(KUBE_PROXY_SAVE, {"198.18.16.4:8080": 5})
    assert diag.parse_iptables_counters(text, "ns1/svc1").flows == {"198.18.16.3:8080": 0, "198.18.16.4:8080": 5}
    assert diag.parse_iptables_counters(text, "ns1/svc").flows == {}


def test_ipvs_stats_and_save_give_conns_weights_scheduler_and_persistence() -> None:
    services = diag.parse_ipvs_stats(IPVS_STATS)
    diag.merge_ipvs_save(services, IPVS_SAVE)
    dns = services[("UDP", "10.96.0.10:53")]
    assert {a: (s.conns, s.weight) for a, s in dns.real_servers.items()} == {
        "10.244.0.3:53": (4551, 1), "10.244.0.4:53": (4569, 1)}
    assert services[("TCP", "10.96.143.7:80")].persistence_seconds == 10800
    keepalived = services[("TCP", "192.168.10.50:443")]
    assert keepalived.scheduler == "wlc" and keepalived.real_servers["192.168.10.11:443"].in_packets == 6_465_000
    assert services[("TCP", "[fd00:10:96::1]:443")].real_servers["[fc00:f853:ccd:e793::2]:6443"].conns == 2
    assert services[("FWM", "77")].real_servers["192.168.10.13:0"].conns == 3


@pytest.mark.parametrize("text", ["TCP 10.96.0.1:443 x 1 2 3 4\n", "garbage line\n", "  -> 1.2.3.4:80 1 2\n"])
def test_ipvs_stats_it_does_not_understand_is_an_error_not_a_guess(text: str) -> None:
    with pytest.raises(diag.DiagnosticsOutputError):
        diag.parse_ipvs_stats(text)


CONNTRACK_TCP = (FIXTURES / "conntrack" / "service-tcp.xml").read_text()
CONNTRACK_UDP = (FIXTURES / "conntrack" / "service-udp.xml").read_text()


def test_conntrack_entries_are_counted_by_the_endpoint_they_were_natted_to() -> None:
    counts = diag.count_flows(conntrack_mod.parse_flows(CONNTRACK_TCP)[0])
    # Five connections: three closed (TIME_WAIT), two kept open (ESTABLISHED).
    assert counts.entries == {"198.18.200.1:8080": 3, "198.18.200.2:8080": 2}
    assert sum(counts.established.values()) == 2
    diag.count_flows(conntrack_mod.parse_flows(CONNTRACK_UDP)[0], counts)
    assert counts.entries["198.18.200.2:5353"] == 1 and counts.established["198.18.200.2:5353"] == 1


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=200))
def test_the_chains_listed_for_one_service_are_bounded_and_every_flow_counted(chains: int) -> None:
    text = "".join(f'[1:60] -A KUBE-SEP-{i:016d} -p tcp -m comment --comment "ns/svc:http" -m tcp '
                   f"-j DNAT --to-destination 198.18.{i // 250}.{i % 250}:8080\n" for i in range(chains))
    counted = diag.parse_iptables_counters(text, "ns/svc")
    assert len(counted.chains) == min(chains, diag.MAX_RULES)
    assert counted.chains_cut == (chains > diag.MAX_RULES)
    assert len(counted.flows) == chains and sum(counted.flows.values()) == chains  # every endpoint counted


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=400))
def test_no_text_makes_the_parsers_raise_anything_but_their_own_error(text: str) -> None:
    diag.parse_iptables_counters(text, "ns/svc")
    for parse in (diag.parse_ipvs_stats, lambda t: diag.merge_ipvs_save({}, t)):
        with contextlib.suppress(diag.DiagnosticsOutputError):
            parse(text)


EMPTY_CONNTRACK = '<?xml version="1.0" encoding="utf-8"?>\n<conntrack>\n</conntrack>\n'
SVC12 = DiagnoseService(namespace="ns2", name="svc12", clusterIPs=["198.19.0.22"],
                        ports=[DiagnosePort(name="http", port=80, node_port=30012)],
                        endpoints=["198.18.16.25", "198.18.16.26", "198.18.16.27"])


class FakeNode:
    """Tool output by program name; records what was run."""

    def __init__(self, outputs: dict[str, str], proc_root: Path | None = None) -> None:
        self.outputs = outputs
        self.calls: list[list[str]] = []
        self.readers = diag.Readers(runner=self, proc_root=proc_root or Path("/nonexistent"))

    def __call__(self, argv: list[str], timeout: float) -> Result:
        assert timeout <= diag.TOOL_TIMEOUT_SECONDS
        self.calls.append(argv)
        if argv[0] not in self.outputs:
            raise CommandError(argv, "exited 1: boom", returncode=1)
        return Result(argv, 0, self.outputs[argv[0]], "")


def test_read_service_in_iptables_mode_has_rule_flows_and_conntrack_for_every_listed_endpoint() -> None:
    node = FakeNode({"iptables-save": with_counters(KUBE_PROXY_SAVE, {"198.18.16.25:8080": 7}),
                     "conntrack": EMPTY_CONNTRACK})
    counters = diag.read_service(SVC12, "iptables", node.readers)
    assert counters.source == "iptables" and not counters.errors
    rows = {e.address: (e.flows, e.conntrack_entries) for e in counters.endpoints}
    assert rows == {"198.18.16.25": (7, 0), "198.18.16.26": (0, 0), "198.18.16.27": (0, 0)}
    assert ["iptables-save", "-c", "-t", "nat"] in node.calls
    # The ClusterIP port and the NodePort come out of one dump of the table's IPv4 TCP flows.
    assert [c for c in node.calls if c[0] == "conntrack"] == [["conntrack", "-L", "-f", "ipv4", "-p", "tcp", "-o",
                                                                "xml"]]


WEB = DiagnoseService(namespace="ps-diag", name="web", clusterIPs=["198.19.200.10"],
                      ports=[DiagnosePort(name="http", port=80)], endpoints=["198.18.200.1", "198.18.200.2"])


def test_read_service_in_nftables_mode_uses_conntrack_alone() -> None:
    counters = diag.read_service(WEB, "nftables", FakeNode({"conntrack": CONNTRACK_TCP}).readers)
    assert counters.source == "conntrack" and not counters.errors
    assert {e.address: (e.flows, e.conntrack_entries) for e in counters.endpoints} == {
        "198.18.200.1": (None, 3), "198.18.200.2": (None, 2)}


def test_conntrack_output_that_is_not_its_xml_is_an_error_in_the_answer() -> None:
    counters = diag.read_service(WEB, "nftables", FakeNode({"conntrack": "tcp 6 117 TIME_WAIT src=..."}).readers)
    assert counters.errors and counters.errors[0].startswith("conntrack:")


def test_read_service_in_ipvs_mode_without_ipvs_in_the_kernel_says_so_and_never_runs_ipvsadm() -> None:
    node = FakeNode({"conntrack": ""})
    counters = diag.read_service(SVC12, "ipvs", node.readers)
    assert "no IPVS" in counters.errors[0]
    assert not any(c[0] == "ipvsadm" for c in node.calls)


def test_read_service_in_ipvs_mode_reads_the_virtual_servers_of_the_service(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")
    service = DiagnoseService(namespace="kube-system", name="kube-dns", clusterIPs=["10.96.0.10"],
                              ports=[DiagnosePort(name="dns", port=53, protocol="UDP")],
                              endpoints=["10.244.0.3", "10.244.0.4"])
    outputs = {("ipvsadm", "-Ln"): IPVS_STATS, ("ipvsadm", "-Sn"): IPVS_SAVE}

    def runner(argv: list[str], timeout: float) -> Result:
        if argv[0] == "conntrack":
            return Result(argv, 0, "", "")
        return Result(argv, 0, outputs[(argv[0], argv[1])], "")

    counters = diag.read_service(service, "ipvs", diag.Readers(runner=runner, proc_root=tmp_path))
    assert counters.source == "ipvs" and counters.scheduler == "rr" and counters.rules == ["UDP 10.96.0.10:53 rr"]
    assert {e.address: (e.flows, e.weight) for e in counters.endpoints} == {
        "10.244.0.3": (4551, 1), "10.244.0.4": (4569, 1)}


def test_a_failing_tool_is_an_error_in_the_answer_not_an_exception() -> None:
    counters = diag.read_service(SVC12, "iptables", FakeNode({}).readers)
    assert counters.source == "none"
    assert [e.split(":")[0] for e in counters.errors] == ["iptables-save", "conntrack"]


def test_oversized_output_is_cut_at_the_bound_and_marked_truncated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diag, "MAX_SAVE_BYTES", 1000)
    node = FakeNode({"iptables-save": with_counters(KUBE_PROXY_SAVE, {}), "conntrack": ""})
    assert diag.read_service(SVC12, "iptables", node.readers).truncated


def test_pending_request_is_served_once_per_id() -> None:
    body = {"spec": {"diagnose": {"id": "d1", "services": [SVC12.to_k8s()]}}}
    assert diag.pending_request(body, None) == body["spec"]["diagnose"]
    assert diag.pending_request(body, "d1") is None
    assert diag.pending_request({**body, "status": {"diagnostics": {"id": "d1"}}}, None) is None
    assert diag.pending_request({"spec": {}}, None) is None


def test_answer_patch_carries_the_id_and_every_service() -> None:
    node = FakeNode({"conntrack": CONNTRACK_TCP})
    patch = diag.answer_patch(DiagnoseRequest(id="d2", services=[SVC12]).to_k8s(), "nftables",
                              partial(diag.serve, readers=node.readers))
    assert patch["diagnostics"]["id"] == "d2" and patch["diagnostics"]["mode"] == "nftables"
    assert patch["diagnostics"]["services"][0]["service"] == "ns2/svc12"


def test_one_request_runs_each_tool_once_and_the_next_request_again() -> None:
    node = FakeNode({"iptables-save": with_counters(KUBE_PROXY_SAVE, {}), "conntrack": ""})
    other = SVC12.model_copy(update={"name": "svc29"})
    for _ in range(2):
        diag.serve(DiagnoseRequest(id="d", services=[SVC12, other]), "iptables", node.readers)
    assert [c[0] for c in node.calls].count("iptables-save") == 2


def test_a_recorded_request_goes_to_the_distribution_and_counts_as_answered() -> None:
    request = DiagnoseRequest(id="n1-before", record="before", services=[SVC12]).to_k8s()
    readers = FakeNode({"iptables-save": "", "conntrack": ""}).readers
    patch = diag.answer_patch(request, "iptables", partial(diag.serve, readers=readers))
    assert set(patch) == {"distribution"} and patch["distribution"]["before"]["id"] == "n1-before"
    assert diag.pending_request({"spec": {"diagnose": request}, "status": patch}, None) is None


def test_a_request_the_models_refuse_is_answered_with_the_reason() -> None:
    patch = diag.answer_patch({"id": "d3", "services": "not a list"}, "iptables")
    assert patch["diagnostics"]["id"] == "d3" and "ValidationError" in patch["diagnostics"]["error"]


class StatusAPI:
    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj
        self.patches: list[dict[str, Any]] = []

    def get(self, name: str) -> dict[str, Any]:
        return self.obj

    def watch(self, name: str, rv: str | None, timeout: int) -> Iterator[tuple[str, dict]]:
        return iter(())

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.patches.append(status)
        self.obj = {**self.obj, "status": {**self.obj.get("status", {}), **status}}
        return self.obj


def test_the_agent_answers_spec_diagnose_once_beside_its_operations() -> None:
    obj = {"metadata": {"name": "n1"}, "spec": {"diagnose": {"id": "d1", "services": [SVC12.to_k8s()]}}}
    api = StatusAPI(obj)
    node = FakeNode({"iptables-save": with_counters(KUBE_PROXY_SAVE, {"198.18.16.26:8080": 4}), "conntrack": ""})
    agent = Agent(AgentConfig(node="n1"), api,
                  FakeAgentNode(facts=KubeProxyFacts(proxy_mode="iptables"), readers=node.readers))
    agent.handle(obj)
    agent.handle(api.obj)  # the same id again (the watch echoes our own write): no second answer
    answers = [p["diagnostics"] for p in api.patches if "diagnostics" in p]
    assert len(answers) == 1 and answers[0]["mode"] == "iptables"
    flows = {e["address"]: e["flows"] for e in answers[0]["services"][0]["endpoints"]}
    assert flows == {"198.18.16.25": 0, "198.18.16.26": 4, "198.18.16.27": 0}


def flow_xml(proto: str, src: str, dst: str, sport: int, dport: int, reply_src: str, reply_sport: int,
             state: str | None = None, unreplied: bool = False) -> str:
    """One flow as `conntrack -L -o xml` prints it (the fixtures' shape)."""
    family = "ipv6" if ":" in dst else "ipv4"
    l3 = '<layer3 protonum="{n}" protoname="{f}"><src>{s}</src><dst>{d}</dst></layer3>'
    l4 = '<layer4 protonum="0" protoname="{p}"><sport>{sp}</sport><dport>{dp}</dport></layer4>'
    orig = l3.format(n=2, f=family, s=src, d=dst) + l4.format(p=proto, sp=sport, dp=dport)
    reply = l3.format(n=2, f=family, s=reply_src, d=src) + l4.format(p=proto, sp=reply_sport, dp=sport)
    independent = (f"<state>{state}</state>" if state else "") + ("<unreplied/>" if unreplied else "")
    return (f'<flow><meta direction="original">{orig}</meta><meta direction="reply">{reply}</meta>'
            f'<meta direction="independent">{independent}</meta></flow>')


def table_xml(flows: list[str]) -> str:
    return '<?xml version="1.0" encoding="utf-8"?>\n<conntrack>\n' + "\n".join(flows) + "\n</conntrack>\n"


NODE_IP = "198.18.0.2"
WEB_TCP = DiagnoseService(namespace="a", name="web", clusterIPs=["198.19.0.10"],
                          ports=[DiagnosePort(name="http", port=80, node_port=30080)],
                          endpoints=["198.18.1.1", "198.18.1.2"])
DNS_UDP = DiagnoseService(namespace="a", name="dns", clusterIPs=["198.19.0.53"],
                          ports=[DiagnosePort(name="dns", port=53, protocol="UDP")],
                          endpoints=["198.18.1.3", "198.18.1.4"])
API_TCP = DiagnoseService(namespace="b", name="api", clusterIPs=["198.19.0.11"],
                          ports=[DiagnosePort(name="https", port=443), DiagnosePort(name="http", port=80)],
                          endpoints=["198.18.1.5"])
SERVICES = [WEB_TCP, DNS_UDP, API_TCP]
TABLE = [
    *(flow_xml("tcp", "198.18.0.9", "198.19.0.10", 40000 + i, 80, "198.18.1.1", 8080, "TIME_WAIT")
      for i in range(3)),
    flow_xml("tcp", "198.18.0.9", "198.19.0.10", 40100, 80, "198.18.1.2", 8080, "ESTABLISHED"),
    # web's NodePort, on the node address and on loopback
    flow_xml("tcp", "198.18.0.7", NODE_IP, 41000, 30080, "198.18.1.2", 8080, "ESTABLISHED"),
    flow_xml("tcp", "127.0.0.1", "127.0.0.1", 41001, 30080, "198.18.1.1", 8080, "TIME_WAIT"),
    # api: same port 80 as web on another ClusterIP, and 443
    flow_xml("tcp", "198.18.0.9", "198.19.0.11", 42000, 80, "198.18.1.5", 8080, "ESTABLISHED"),
    flow_xml("tcp", "198.18.0.9", "198.19.0.11", 42001, 443, "198.18.1.5", 8443, "TIME_WAIT"),
    # dns over UDP, one answered, one not
    flow_xml("udp", "198.18.0.9", "198.19.0.53", 43000, 53, "198.18.1.3", 5353),
    flow_xml("udp", "198.18.0.9", "198.19.0.53", 43001, 53, "198.18.1.4", 5353, unreplied=True),
    # nobody's: another Service's port, a UDP flow to web's TCP port, an IPv6 flow to the NodePort
    flow_xml("tcp", "198.18.0.9", "198.19.0.99", 44000, 80, "198.18.1.9", 8080, "ESTABLISHED"),
    flow_xml("udp", "198.18.0.9", "198.19.0.10", 44001, 80, "198.19.0.10", 80, unreplied=True),
    flow_xml("tcp", "fd00::9", "fd00::2", 44002, 30080, "fd00::1:1", 8080, "ESTABLISHED"),
]


class KernelConntrack:
    """`conntrack -L` over TABLE with the kernel's filters (-f, -p, --orig-dst, --orig-port-dst); records calls."""

    def __init__(self, table: list[str]) -> None:
        self.flows = [(x, conntrack_mod.parse_flows(table_xml([x]))[0][0]) for x in table]
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float) -> Result:
        assert timeout <= diag.TOOL_TIMEOUT_SECONDS and argv[:2] == ["conntrack", "-L"]
        self.calls.append(argv)
        opts = dict(zip(argv[2::2], argv[3::2], strict=False))
        chosen = [x for x, f in self.flows
                  if f.protocol == opts["-p"]
                  and (":" in f.dst) == (opts.get("-f", "ipv4") == "ipv6")
                  and ("--orig-dst" not in opts or f.dst == opts["--orig-dst"])
                  and ("--orig-port-dst" not in opts or str(f.dport) == opts["--orig-port-dst"])]
        return Result(argv, 0, table_xml(chosen), "")


def conntrack_rows(answer: Any) -> dict[str, dict[str, tuple[int, int]]]:
    return {s.service: {e.address: (e.conntrack_entries, e.conntrack_established) for e in s.endpoints}
            for s in answer.services}


def test_one_dump_per_protocol_is_bucketed_per_service_port_as_the_kernel_filter_would() -> None:
    kernel = KernelConntrack(TABLE)
    answer = diag.serve(DiagnoseRequest(id="d", services=SERVICES), "nftables",
                        diag.Readers(runner=kernel, proc_root=Path("/nonexistent")))
    assert sorted(kernel.calls) == [["conntrack", "-L", "-f", "ipv4", "-p", p, "-o", "xml"] for p in ("tcp", "udp")]
    assert conntrack_rows(answer) == {
        # three closed and one open to the ClusterIP; the NodePort's two (node address and loopback)
        "a/web": {"198.18.1.1": (4, 0), "198.18.1.2": (2, 2)},
        # a UDP flow that saw its answer counts as established; the unreplied one does not
        "a/dns": {"198.18.1.3": (1, 1), "198.18.1.4": (1, 0)},
        "b/api": {"198.18.1.5": (2, 1)},
    }
    assert not any(s.truncated or s.errors for s in answer.services)

    # The old path, one kernel-filtered `conntrack -L` per ClusterIP port and NodePort, counted the same.
    def per_query(service: DiagnoseService) -> diag.ConntrackCounts:
        counts = diag.ConntrackCounts()
        for query in diag.conntrack_queries(service):
            diag.count_flows(conntrack_mod.parse_flows(kernel(query.argv(), timeout=1).stdout)[0], counts)
        return counts
    for service, counted in zip(SERVICES, answer.services, strict=True):
        old = per_query(service)
        by_ip: dict[str, int] = {}
        for endpoint, n in old.entries.items():
            by_ip[endpoint.rsplit(":", 1)[0]] = by_ip.get(endpoint.rsplit(":", 1)[0], 0) + n
        assert {e.address: e.conntrack_entries for e in counted.endpoints} == by_ip
        assert sum(e.conntrack_established for e in counted.endpoints) == sum(old.established.values())


def test_a_dump_cut_at_its_bound_falls_back_to_the_kernels_filter_per_service_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole = diag.serve(DiagnoseRequest(id="d", services=SERVICES), "nftables",
                       diag.Readers(runner=KernelConntrack(TABLE), proc_root=Path("/nonexistent")))
    monkeypatch.setattr(diag, "MAX_CONNTRACK_FLOWS", 5)  # the TCP dump (10 flows) is cut, each query's is not
    kernel = KernelConntrack(TABLE)
    cut = diag.serve(DiagnoseRequest(id="d", services=SERVICES), "nftables",
                     diag.Readers(runner=kernel, proc_root=Path("/nonexistent")))
    assert conntrack_rows(cut) == conntrack_rows(whole)
    assert not any(s.truncated for s in cut.services)
    filtered = [c for c in kernel.calls if "--orig-port-dst" in c]
    assert {(c[c.index("--orig-port-dst") + 1], c[c.index("--orig-dst") + 1] if "--orig-dst" in c else None)
            for c in filtered} == {("80", "198.19.0.10"), ("30080", None), ("443", "198.19.0.11"),
                                   ("80", "198.19.0.11")}
    assert all("tcp" in c for c in filtered)  # the UDP dump was whole: no per-query read for it


def test_a_failing_dump_is_one_error_per_service_and_run_once() -> None:
    node = FakeNode({})
    answer = diag.serve(DiagnoseRequest(id="d", services=[WEB_TCP, API_TCP]), "nftables", node.readers)
    assert [e.split(":")[0] for s in answer.services for e in s.errors] == ["conntrack", "conntrack"]
    assert len(node.calls) == 1


def test_a_table_too_large_to_dump_is_filtered_by_the_kernel_per_service_port(tmp_path: Path) -> None:
    count = tmp_path / "sys" / "net" / "netfilter" / "nf_conntrack_count"
    count.parent.mkdir(parents=True)
    count.write_text(f"{conntrack_mod.DUMP_MAX_ENTRIES + 1}\n")
    whole = diag.serve(DiagnoseRequest(id="d", services=SERVICES), "nftables",
                       diag.Readers(runner=KernelConntrack(TABLE), proc_root=Path("/nonexistent")))
    kernel = KernelConntrack(TABLE)
    filtered = diag.serve(DiagnoseRequest(id="d", services=SERVICES), "nftables",
                          diag.Readers(runner=kernel, proc_root=tmp_path))
    assert conntrack_rows(filtered) == conntrack_rows(whole)
    assert all("--orig-port-dst" in c for c in kernel.calls) and len(kernel.calls) == 5  # 4 TCP + 1 UDP
