"""The agent's client of Cilium's REST API (agent/cilium_api.py) against a fake Cilium agent on a unix socket in
the test, and the gate that judges what it reads (planner/gate.py evaluate_replacement_gate)."""

from __future__ import annotations

import http.server
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cilium import HEALTHY, HOST, POD, TABLE, FakeCilium, Route, answer, endpoint, service
from hypothesis import given
from hypothesis import strategies as st

from proxyshift.agent.cilium_api import CiliumAPI, read_replacement
from proxyshift.api.policy import GateSettings, ServiceRef
from proxyshift.api.replacement import MAX_MISSING, CiliumService, ReplacementFacts, frontend_key
from proxyshift.planner.gate import evaluate_replacement_gate

pytestmark = pytest.mark.unit


@pytest.fixture
def cilium(tmp_path: Path) -> Iterator[FakeCilium]:
    fake = FakeCilium(tmp_path / "cilium.sock")
    yield fake
    fake.close()


def test_a_healthy_kpr_agent_and_its_service_table(cilium: FakeCilium) -> None:
    asked = ["198.19.0.10:80/TCP", "198.19.0.11:53/UDP", "198.19.0.12:8443/UDP", "198.19.0.99:80/TCP"]
    facts = read_replacement(CiliumAPI(cilium.path), asked)
    assert cilium.requests == ["/v1/healthz", "/v1/endpoint", "/v1/service"]
    assert (facts.agent_state, facts.kube_proxy_replacement, facts.enabled) == ("Ok", "True", True)
    assert facts.host_endpoint == "ready"
    assert facts.agent_message is None and facts.error is None and facts.probed_at
    # ClusterIP frontends only (the NodePort entry is not one); protocol ANY covers TCP and UDP.
    assert facts.cluster_ip_frontends == 4
    assert (facts.missing, facts.missing_count) == (["198.19.0.99:80/TCP"], 1)


def test_preflight_reads_the_health_alone(cilium: FakeCilium) -> None:
    facts = read_replacement(CiliumAPI(cilium.path), with_services=False)
    assert facts.enabled and facts.cluster_ip_frontends is None and cilium.requests == ["/v1/healthz"]


@pytest.mark.parametrize(("health", "reason"), [
    ({"cilium": {"state": "Warning", "msg": "starting"}, "kube-proxy-replacement": {"mode": "True"}},
     "ReplacementNotReady"),
    ({"cilium": {"state": "Failure"}, "kube-proxy-replacement": {"mode": "True"}}, "ReplacementNotReady"),
    ({"cilium": {"state": "Ok"}, "kube-proxy-replacement": {"mode": "False"}}, "ReplacementOff"),
    ({"cilium": {"state": "Ok"}}, "ReplacementOff"),
])
def test_an_agent_not_ok_or_not_replacing_kube_proxy_is_read_for_its_health_alone(
        cilium: FakeCilium, health: dict[str, Any], reason: str) -> None:
    cilium.routes["/v1/healthz"] = answer(200, health)
    facts = read_replacement(CiliumAPI(cilium.path), ["198.19.0.10:80/TCP"])
    # The gate judges such an agent on its health, before the endpoints and the table: neither is read.
    assert cilium.requests == ["/v1/healthz"]
    assert facts == read_replacement(CiliumAPI(cilium.path), with_services=False).model_copy(
        update={"probed_at": facts.probed_at})
    assert facts.host_endpoint is None and facts.cluster_ip_frontends is None and facts.error is None
    assert verdict(facts, expected=4) == ("wait", reason)


def test_each_read_goes_as_far_as_the_health_it_read_allows(cilium: FakeCilium) -> None:
    """A Probe's rounds while Cilium starts: one /v1/healthz each, the endpoints once it is Ok and replacing
    kube-proxy, the Service table once its host endpoint is ready."""
    rounds: list[list[str]] = []

    def read_round() -> ReplacementFacts:
        before = len(cilium.requests)
        facts = read_replacement(CiliumAPI(cilium.path), ["198.19.0.10:80/TCP"])
        rounds.append(cilium.requests[before:])
        return facts

    cilium.routes["/v1/healthz"] = answer(200, {**HEALTHY, "cilium": {"state": "Warning", "msg": "starting"}})
    assert verdict(read_round(), expected=4) == ("wait", "ReplacementNotReady")
    cilium.routes["/v1/healthz"] = answer(200, HEALTHY)
    cilium.routes["/v1/endpoint"] = answer(200, [POD, endpoint(1, ["reserved:host"], "regenerating")])
    assert verdict(read_round(), expected=4) == ("wait", "HostDatapathNotReady")
    cilium.routes["/v1/endpoint"] = answer(200, [POD, HOST])
    assert verdict(read_round(), expected=4) == ("pass", "GatePassed")
    assert rounds == [["/v1/healthz"], ["/v1/healthz", "/v1/endpoint"],
                      ["/v1/healthz", "/v1/endpoint", "/v1/service"]]


def test_an_agent_without_kpr_says_so(cilium: FakeCilium) -> None:
    cilium.routes["/v1/healthz"] = answer(200, {"cilium": {"state": "Warning", "msg": "1/40 controllers failing"},
                                                "kube-proxy-replacement": {"mode": "False"}})
    facts = read_replacement(CiliumAPI(cilium.path))
    assert (facts.agent_state, facts.agent_message, facts.enabled) == ("Warning", "1/40 controllers failing", False)


def test_no_agent_is_a_fact_not_a_crash(tmp_path: Path) -> None:
    facts = read_replacement(CiliumAPI(tmp_path / "absent.sock"))
    assert facts.agent_state is None and not facts.enabled
    assert facts.error is not None and "FileNotFoundError" in facts.error and "absent.sock" in facts.error


@pytest.mark.parametrize(("route", "said"), [
    (answer(500, {"message": "daemon not ready"}), "HTTP 500"),
    (answer(200, "{not json"), "/v1/healthz is not a Cilium status"),
    (answer(200, {"cilium": {"state": ["Ok"]}}), "/v1/healthz is not a Cilium status: cilium.state"),
    (answer(200, b"[" + b" " * (1024 * 1024) + b"]"), "answer larger than 1048576 bytes"),
])
def test_a_bad_health_answer_is_an_error_in_words(cilium: FakeCilium, route: Route, said: str) -> None:
    cilium.routes["/v1/healthz"] = route
    facts = read_replacement(CiliumAPI(cilium.path))
    assert facts.error is not None and said in facts.error and facts.agent_state is None


def test_a_service_table_that_cannot_be_read_keeps_the_health(cilium: FakeCilium) -> None:
    cilium.routes["/v1/service"] = answer(200, {"not": "a list"})
    facts = read_replacement(CiliumAPI(cilium.path))
    assert facts.enabled and facts.cluster_ip_frontends is None
    assert facts.error is not None and "/v1/service is not a Cilium Service list" in facts.error


@pytest.mark.parametrize(("endpoints", "state"), [
    ([POD, endpoint(1, ["reserved:host"], "regenerating")], "regenerating"),
    # Found by its label when the identity's number is not the reserved one, and by the number alone.
    ([endpoint(7, ["reserved:host"], "waiting-to-regenerate")], "waiting-to-regenerate"),
    ([endpoint(1, [], "not-ready")], "not-ready"),
    ([POD], "absent"),
    ([], "absent"),
])
def test_the_host_endpoints_state_is_read(cilium: FakeCilium, endpoints: list[Any], state: str) -> None:
    cilium.routes["/v1/endpoint"] = answer(200, endpoints)
    facts = read_replacement(CiliumAPI(cilium.path))
    assert facts.host_endpoint == state and facts.error is None
    # The gate waits on the host endpoint alone: the Service table is not read meanwhile.
    assert cilium.requests == ["/v1/healthz", "/v1/endpoint"] and facts.cluster_ip_frontends is None
    assert verdict(facts, expected=4) == ("wait", "HostDatapathNotReady")


def test_an_endpoint_list_that_cannot_be_read_keeps_the_service_table(cilium: FakeCilium) -> None:
    cilium.routes["/v1/endpoint"] = answer(200, [{"status": {"state": 3}}])
    facts = read_replacement(CiliumAPI(cilium.path))
    assert facts.cluster_ip_frontends == 4 and facts.host_endpoint is None
    assert facts.error is not None and "/v1/endpoint is not a Cilium endpoint list: 0.status.state" in facts.error
    assert verdict(facts, expected=4) == ("wait", "HostEndpointUnread")


def test_an_agent_trickling_its_answer_is_cut_at_the_deadline(cilium: FakeCilium) -> None:
    def trickle(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        handler.wfile.write(b"{")
        handler.wfile.flush()
        while not cilium.stop.wait(0.05):
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return

    cilium.routes["/v1/healthz"] = trickle
    facts = read_replacement(CiliumAPI(cilium.path, timeout=0.3))
    assert facts.error is not None and "no complete answer within 0.3s" in facts.error


def test_missing_frontends_are_bounded_and_counted(cilium: FakeCilium) -> None:
    asked = [frontend_key(f"198.19.1.{i}", 80, "TCP") for i in range(40)]
    facts = read_replacement(CiliumAPI(cilium.path), asked)
    assert facts.missing_count == 40 and len(facts.missing) == MAX_MISSING
    assert facts.missing == sorted(asked)[:MAX_MISSING]
    # The status model takes what the agent writes (its CRD bounds are the model's).
    assert ReplacementFacts.model_validate(facts.to_k8s()) == facts


def test_cilium_service_entries_name_their_frontends() -> None:
    entries = [CiliumService.model_validate(s) for s in TABLE]
    assert [e.cluster_ip_frontends for e in entries] == [
        ("198.19.0.10:80/TCP",), ("198.19.0.11:53/UDP",), ("198.19.0.12:8443/TCP", "198.19.0.12:8443/UDP"), ()]
    v6 = CiliumService.model_validate(service("fd00::a", 53, protocol="UDP"))
    assert v6.cluster_ip_frontends == ("[fd00::a]:53/UDP",)
    assert CiliumService.model_validate({"spec": {"flags": {"type": "ClusterIP"}}}).cluster_ip_frontends == ()


# ---- the gate on what was read ----

GOOD = ReplacementFacts(agent_state="Ok", kube_proxy_replacement="True", enabled=True, cluster_ip_frontends=12,
                        host_endpoint="ready")


def verdict(facts: ReplacementFacts | None, expected: int = 12) -> tuple[str, str]:
    found = evaluate_replacement_gate(facts, GateSettings(), "Cilium", expected, None)
    return found.result, found.reason


def test_the_replacement_gate_passes_only_a_healthy_kpr_with_the_clusters_services() -> None:
    assert verdict(GOOD) == ("pass", "GatePassed")
    assert verdict(None) == ("wait", "NoProbeYet")
    assert verdict(ReplacementFacts(error="FileNotFoundError")) == ("wait", "ReplacementUnreachable")
    assert verdict(GOOD.model_copy(update={"agent_state": "Failure"})) == ("wait", "ReplacementNotReady")
    assert verdict(GOOD.model_copy(update={"enabled": False, "kube_proxy_replacement": "False"})) == (
        "wait", "ReplacementOff")
    assert verdict(GOOD.model_copy(update={"cluster_ip_frontends": None, "error": "HTTP 500"})) == (
        "wait", "ServiceTableUnread")
    assert verdict(GOOD.model_copy(update={"missing": ["198.19.0.9:80/TCP"], "missing_count": 1})) == (
        "wait", "ServicesMissing")
    assert verdict(GOOD, expected=13) == ("wait", "ServicesMissing")
    assert verdict(GOOD.model_copy(update={"host_endpoint": "regenerating"})) == ("wait", "HostDatapathNotReady")
    assert verdict(GOOD.model_copy(update={"host_endpoint": "absent"})) == ("wait", "HostDatapathNotReady")
    # What the agent reports while it waits for the host endpoint: the table not read yet.
    assert verdict(GOOD.model_copy(update={"host_endpoint": "regenerating", "cluster_ip_frontends": None})) == (
        "wait", "HostDatapathNotReady")
    # An agent older than the field reports none: the rest still proves the replacement.
    assert verdict(GOOD.model_copy(update={"host_endpoint": None})) == ("pass", "GatePassed")


def test_the_replacement_gate_says_where_to_look_when_cilium_does_not_answer() -> None:
    found = evaluate_replacement_gate(ReplacementFacts(error="GET /v1/healthz on /var/run/cilium/cilium.sock: "
                                                             "FileNotFoundError"), GateSettings(), "Cilium", 1, None)
    assert found.message.startswith("Cilium's agent on the node does not answer (is its pod running and Ready")
    assert "FileNotFoundError" in found.message


def test_the_replacement_gate_connects_to_the_policys_services() -> None:
    gate = GateSettings(probe_services=[ServiceRef(name="web", port=80)])
    waiting = evaluate_replacement_gate(GOOD, gate, "Cilium", 12, None)
    assert (waiting.result, waiting.reason) == ("wait", "ProbePending")
    failed = evaluate_replacement_gate(GOOD, gate, "Cilium", 12, {"198.19.0.10:80": "connection refused"})
    assert (failed.result, failed.reason) == ("fail", "ServiceUnreachable")
    passed = evaluate_replacement_gate(GOOD, gate, "Cilium", 12, {"198.19.0.10:80": True})
    assert passed.passed and "1 service connects ok" in passed.message


@given(state=st.sampled_from([None, "Ok", "Warning", "Failure"]), enabled=st.booleans(),
       held=st.one_of(st.none(), st.integers(0, 50)), missing=st.integers(0, 3), expected=st.integers(0, 50),
       error=st.sampled_from([None, "boom"]),
       host=st.sampled_from([None, "ready", "regenerating", "absent"]))
def test_the_replacement_gate_never_passes_short_of_every_proof(state: str | None, enabled: bool, held: int | None,
                                                                missing: int, expected: int,
                                                                error: str | None, host: str | None) -> None:
    facts = ReplacementFacts(agent_state=state, enabled=enabled, cluster_ip_frontends=held,
                             missing=[f"198.19.0.{i}:80/TCP" for i in range(missing)], missing_count=missing,
                             error=error, host_endpoint=host)
    found = evaluate_replacement_gate(facts, GateSettings(), "Cilium", expected, None)
    proven = (state == "Ok" and enabled and held is not None and held >= expected and not missing
              and error is None and host in (None, "ready"))
    assert found.passed == proven
    # Nothing the replacement reports about itself is a reason to roll back at once: the timeout decides.
    assert found.result in ("pass", "wait")



@given(state=st.sampled_from([None, "Ok", "Warning"]), enabled=st.booleans(),
       held=st.one_of(st.none(), st.integers(0, 20)), missing=st.integers(0, 2), expected=st.integers(0, 20),
       error=st.sampled_from([None, "boom"]), host=st.sampled_from([None, "ready", "regenerating", "absent"]))
def test_what_the_agent_waits_for_is_what_the_gate_passes(state: str | None, enabled: bool, held: int | None,
                                                          missing: int, expected: int, error: str | None,
                                                          host: str | None) -> None:
    facts = ReplacementFacts(agent_state=state, enabled=enabled, cluster_ip_frontends=held,
                             missing=[f"198.19.0.{i}:80/TCP" for i in range(missing)], missing_count=missing,
                             error=error, host_endpoint=host)
    assert facts.proves(expected) == evaluate_replacement_gate(facts, GateSettings(), "Cilium", expected, None).passed
