"""The verdict on uneven load (planner/diagnosis.py): statistics and named causes, pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.api.diagnostics import MAX_DIAGNOSE_SERVICES, EndpointCounters, NodeDiagnostics, ServiceCounters
from proxyshift.planner.diagnosis import (
    chi_square_p,
    combine,
    diagnose,
    distribution_change,
    distribution_lines,
    migration_request,
    request_service,
)
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView

pytestmark = pytest.mark.unit

NODE = "ps-node-1"


def service(**kw: object) -> ServiceView:
    base: dict[str, object] = {"namespace": "ns", "name": "web", "cluster_ips": ("198.19.0.20",),
                               "ports": (ServicePortView(name="http", protocol="TCP", port=80),)}
    return ServiceView(**(base | kw))  # type: ignore[arg-type]  # kw: ServiceView fields


def endpoints(n: int, *, not_ready: tuple[int, ...] = (), nodes: tuple[str | None, ...] = ()) -> list[EndpointView]:
    return [EndpointView(service="ns/web", address=f"198.18.1.{i + 1}", ready=i not in not_ready,
                         node_name=nodes[i] if i < len(nodes) else None) for i in range(n)]


def counters(flows: list[int], *, source: str = "iptables", established: list[int] | None = None,
             extra: dict[str, int] | None = None, **kw: object) -> ServiceCounters:
    rows = [EndpointCounters(address=f"198.18.1.{i + 1}", flows=f if source != "conntrack" else None,
                             conntrack_entries=(established[i] if established else 0) if source != "conntrack" else f,
                             conntrack_established=established[i] if established else 0)
            for i, f in enumerate(flows)]
    rows += [EndpointCounters(address=a, flows=n) for a, n in (extra or {}).items()]
    return ServiceCounters(service="ns/web", source=source, endpoints=rows, **kw)  # type: ignore[arg-type]  # kw: ServiceCounters fields


def names(d: object) -> set[str]:
    return {c.name for c in d.causes}  # type: ignore[attr-defined]  # a diagnosis of any kind


def test_chi_square_matches_known_quantiles() -> None:
    # 3.841 is the 95% quantile of chi-square with 1 degree of freedom, 11.070 with 5, 15.086 is 99% with 5.
    assert chi_square_p([60, 40], [0.5, 0.5]) == pytest.approx(0.0455, abs=1e-4)
    assert chi_square_p([0, 0], [0.5, 0.5]) == 1.0
    assert chi_square_p([5, 5], [1.0, 0.0]) == 0.0  # traffic where none was expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=2, max_value=20), st.integers(min_value=27, max_value=10_000))
def test_a_perfectly_even_distribution_over_enough_connections_is_always_balanced(k: int, each: int) -> None:
    d = diagnose(service(), endpoints(k), NODE, counters([each] * k))
    assert d.verdict == "balanced" and not d.causes
    assert all(s.share == pytest.approx(1 / k) for s in d.shares)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=2, max_value=16), st.integers(min_value=20, max_value=5000), st.data())
def test_everything_on_one_endpoint_with_affinity_on_names_affinity(k: int, total: int, data: st.DataObject) -> None:
    winner = data.draw(st.integers(min_value=0, max_value=k - 1))
    flows = [total if i == winner else 0 for i in range(k)]
    d = diagnose(service(session_affinity="ClientIP", affinity_timeout_seconds=60), endpoints(k), NODE,
                 counters(flows))
    assert d.verdict == "uneven"
    assert "ClientIPAffinity" in names(d)
    assert "timeout 60s" in next(c.message for c in d.causes if c.name == "ClientIPAffinity")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=3, max_value=12), st.integers(min_value=1, max_value=2000), st.data())
def test_a_not_ready_endpoint_is_named(k: int, each: int, data: st.DataObject) -> None:
    broken = data.draw(st.integers(min_value=0, max_value=k - 1))
    flows = [0 if i == broken else each for i in range(k)]
    d = diagnose(service(), endpoints(k, not_ready=(broken,)), NODE, counters(flows))
    assert d.verdict == "uneven"
    assert "EndpointNotReady" in names(d) and names(d) <= {"EndpointNotReady", "TooFewConnections"}
    assert f"198.18.1.{broken + 1} is not ready" in d.causes[0].message


def test_affinity_and_a_not_ready_endpoint_are_both_named() -> None:
    d = diagnose(service(session_affinity="ClientIP", affinity_timeout_seconds=10800),
                 endpoints(3, not_ready=(2,)), NODE, counters([40, 0, 0]))
    assert d.verdict == "uneven"
    assert names(d) == {"ClientIPAffinity", "EndpointNotReady"}


def test_random_choice_over_too_few_connections_is_named_not_called_uneven() -> None:
    d = diagnose(service(), endpoints(2), NODE, counters([7, 3]))
    assert d.verdict == "too-few"
    assert names(d) == {"TooFewConnections"}
    assert "10 new flows over 2 endpoints" in d.causes[0].message


def test_long_lived_connections_held_by_conntrack_are_named() -> None:
    # nftables: conntrack is the only source; three kept connections, all to one endpoint.
    d = diagnose(service(), endpoints(3), NODE, counters([3, 0, 0], source="conntrack", established=[3, 0, 0]))
    assert "LongLivedConnections" in names(d)
    assert "3 established connections" in next(c.message for c in d.causes if c.name == "LongLivedConnections")


def test_local_policy_on_a_node_without_a_local_endpoint() -> None:
    eps = endpoints(2, nodes=("ps-node-2", "ps-node-3"))
    d = diagnose(service(internal_traffic_policy="Local"), eps, NODE, counters([0, 0]))
    assert d.verdict == "no-traffic"
    assert names(d) == {"LocalPolicyNoLocalEndpoint"}
    assert "ps-node-1 has no ready endpoint of its own" in d.causes[0].message


def test_local_policy_sends_only_to_local_endpoints() -> None:
    eps = endpoints(3, nodes=(NODE, "ps-node-2", "ps-node-3"))
    d = diagnose(service(external_traffic_policy="Local", type="NodePort"), eps, NODE, counters([90, 0, 0]))
    assert d.verdict == "uneven" and names(d) == {"LocalPolicyLocalOnly"}


def test_ipvs_source_hashing_and_weights_are_named() -> None:
    sh = diagnose(service(), endpoints(2), NODE, counters([100, 0], source="ipvs", scheduler="sh"))
    assert names(sh) == {"IPVSScheduler"} and "hashes the client address" in sh.causes[0].message
    rows = [EndpointCounters(address="198.18.1.1", flows=300, weight=3),
            EndpointCounters(address="198.18.1.2", flows=100, weight=1)]
    weighted = ServiceCounters(service="ns/web", source="ipvs", scheduler="wrr", endpoints=rows)
    # 3:1 is what wrr with weights 3 and 1 gives: balanced against the weights.
    assert diagnose(service(), endpoints(2), NODE, weighted).verdict == "balanced"


def test_flows_to_an_address_no_slice_lists_are_named_stale() -> None:
    d = diagnose(service(), endpoints(2), NODE, counters([50, 50], extra={"198.18.1.99:8080": 40}))
    assert d.verdict == "uneven" and names(d) == {"StaleEndpoint"}


def test_no_endpoints_and_no_traffic() -> None:
    assert diagnose(service(), [], NODE, counters([])).verdict == "no-endpoints"
    assert diagnose(service(), endpoints(2), NODE, counters([0, 0])).verdict == "no-traffic"


def test_uneven_without_a_known_cause_says_unknown() -> None:
    d = diagnose(service(), endpoints(2), NODE, counters([900, 100]))
    assert d.verdict == "uneven" and names(d) == {"Unknown"}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=1000), min_size=3, max_size=3), min_size=1, max_size=6))
def test_combine_adds_every_nodes_flows_per_endpoint(per_node: list[list[int]]) -> None:
    merged = combine([counters(flows) for flows in per_node])
    assert [e.flows for e in merged.endpoints] == [sum(col) for col in zip(*per_node, strict=True)]


def test_request_service_names_what_the_node_needs() -> None:
    view = service(ports=(ServicePortView(name="http", protocol="TCP", port=80, node_port=30080),))
    request = request_service(view, endpoints(2) + endpoints(1))
    assert request.key == "ns/web" and request.endpoints == ["198.18.1.1", "198.18.1.2"]
    assert request.ports[0].node_port == 30080 and request.cluster_ips == ["198.19.0.20"]


def _svc(name: str, **kw: object) -> ServiceView:
    return service(name=name, **kw)


def test_migration_request_is_deterministic_named_first_and_bounded() -> None:
    views = [_svc(f"s{i}") for i in range(20)] + [_svc("headless", headless=True, cluster_ips=())]
    eps = {v.key: [EndpointView(service=v.key, address=f"198.18.1.{j}", ready=True) for j in (1, 2)] for v in views}
    eps["ns/s3"] = eps["ns/s3"][:1]  # one endpoint: nothing to share, not recorded
    request = migration_request(views, eps, "n1-before", "before", named=["ns/s7", "ns/s3"])
    assert request is not None and request.record == "before" and request.id == "n1-before"
    keys = [f"{s.namespace}/{s.name}" for s in request.services]
    assert keys[0] == "ns/s7" and "ns/s3" not in keys and "ns/headless" not in keys
    assert len(keys) == MAX_DIAGNOSE_SERVICES
    again = migration_request(list(reversed(views)), eps, "n2-before", "before", named=["ns/s7"])
    assert again is not None and [f"{s.namespace}/{s.name}" for s in again.services] == keys
    assert migration_request([], {}, "x", "after") is None


def test_distribution_change_judges_each_side_on_its_own_basis() -> None:
    view = service()
    eps = endpoints(2)
    before = NodeDiagnostics(id="b", mode="iptables", services=[counters([60, 61])])
    after = NodeDiagnostics(id="a", mode="nftables",
                            services=[counters([3, 0], source="conntrack", established=[3, 0])])
    line = distribution_change(view, eps, NODE, before, after)
    assert line == ("ns/web on ps-node-1: before balanced (50%/50% of 121 new flows, iptables) -> "
                    "after too-few (100%/0% of 3 conntrack entries, nftables)")
    assert distribution_change(view, eps, NODE, None, None) is None
    assert "before not recorded" in (distribution_change(view, eps, NODE, None, after) or "")


def test_distribution_lines_cover_every_recorded_service_that_still_exists() -> None:
    view, eps = service(), endpoints(2)
    gone = counters([1, 1]).model_copy(update={"service": "x/gone"})
    before = NodeDiagnostics(id="b", mode="iptables", services=[counters([60, 61]), gone])
    lines = distribution_lines(NODE, before, None, {"ns/web": view}, {"ns/web": eps})
    assert lines == ["ns/web on ps-node-1: before balanced (50%/50% of 121 new flows, iptables) -> after not recorded"]
