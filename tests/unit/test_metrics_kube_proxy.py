"""kube-proxy /metrics parsing: recorded texts, dual-stack, hostile and malformed input."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from proxyshift.agent.probe import HttpAnswer, ProbeResult, facts_from_probe
from proxyshift.api.policy import GateSettings
from proxyshift.planner import metrics
from proxyshift.planner.gate import evaluate_gate
from proxyshift.planner.metrics import (
    MAX_LABELS,
    MAX_LINE_BYTES,
    MAX_LINES,
    MAX_SELECTED_LINES,
    MAX_TEXT_BYTES,
    MetricsError,
    histogram_quantile,
    parse_kube_proxy_metrics,
    select_lines,
)
from tests.support.hostile_metrics import INVALID, WANTED_BUCKET, WORST_CASES

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
URL_MODE, URL_METRICS, URL_HEALTHZ = ("http://127.0.0.1:10249/proxyMode", "http://127.0.0.1:10249/metrics",
                                      "http://127.0.0.1:10256/healthz")
BOUNDS = [0.001 * 2**i for i in range(15)]


def hist_text(counts_by_family: dict[str, list[int]], *,
              name: str = "kubeproxy_sync_proxy_rules_duration_seconds") -> str:
    lines = [f"# TYPE {name} histogram"]
    for fam, cum in counts_by_family.items():
        for bound, c in zip([*BOUNDS, math.inf], cum, strict=True):
            le = "+Inf" if math.isinf(bound) else f"{bound:g}"
            lines.append(f'{name}_bucket{{ip_family="{fam}",le="{le}"}} {c}')
        lines.append(f'{name}_sum{{ip_family="{fam}"}} 1.0')
        lines.append(f'{name}_count{{ip_family="{fam}"}} {cum[-1]}')
    return "\n".join(lines) + "\n"


def base(extra: str = "") -> str:
    return ("# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e+09\n" + extra)


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIX.glob("*.txt")))
def test_recorded_metrics_parse(fixture: str) -> None:
    """Real captures of kube-proxy v1.37.2 (tests/dataplane/capture_kube_proxy.py): dual-stack, first sync."""
    facts = parse_kube_proxy_metrics((FIX / fixture).read_text())
    assert facts.process_start_time and facts.process_start_time > 1.6e9
    assert facts.last_sync_timestamp and facts.last_sync_timestamp >= facts.process_start_time
    assert facts.sync_count and facts.sync_count > 0
    # kube-proxy exports its failure counters only once one is counted.
    assert facts.sync_failures in (None, 0)
    assert facts.sync_duration_p99_seconds is not None and 0 < facts.sync_duration_p99_seconds < 16.384


def test_dual_stack_takes_the_facts_that_hold_for_both_families() -> None:
    cum4 = [0] * 5 + [4] * 10 + [4]
    cum6 = [0] * 5 + [2] * 10 + [2]
    text = base(hist_text({"IPv4": cum4, "IPv6": cum6}) + (
        "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n"
        'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.70000002e+09\n'
        'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv6"} 1.70000001e+09\n'
        "# TYPE kubeproxy_sync_proxy_rules_iptables_restore_failures_total counter\n"
        'kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv4"} 1\n'
        'kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv6"} 2\n'
    ))
    facts = parse_kube_proxy_metrics(text)
    assert facts.sync_count == 2
    assert facts.last_sync_timestamp == 1.70000001e9
    assert facts.sync_failures == 3
    assert facts.sync_duration_p99_seconds is not None
    assert 0.016 < facts.sync_duration_p99_seconds <= 0.032


def test_unlabelled_metrics_of_older_kube_proxy_and_nftables_failures() -> None:
    text = base(
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n"
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.5"} 3\n'
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="+Inf"} 3\n'
        "kubeproxy_sync_proxy_rules_duration_seconds_sum 0.9\n"
        "kubeproxy_sync_proxy_rules_duration_seconds_count 3\n"
        "# TYPE kubeproxy_sync_proxy_rules_nftables_sync_failures_total counter\n"
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total 4\n"
    )
    facts = parse_kube_proxy_metrics(text)
    assert facts.sync_count == 3 and facts.sync_failures == 4
    assert facts.last_sync_timestamp is None


def test_p99_above_the_largest_bucket_is_infinite() -> None:
    cum = [0] * 15 + [5]
    facts = parse_kube_proxy_metrics(base(hist_text({"IPv4": cum})))
    assert facts.sync_duration_p99_seconds is not None
    assert math.isinf(facts.sync_duration_p99_seconds)


def test_no_syncs_yet_means_no_p99_and_zero_count() -> None:
    facts = parse_kube_proxy_metrics(base(hist_text({"IPv4": [0] * 16})))
    assert facts.sync_count == 0 and facts.sync_duration_p99_seconds is None


@pytest.mark.parametrize("text, message", [
    (base("# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n"
          "kubeproxy_sync_proxy_rules_last_timestamp_seconds NaN\n"), "NaN"),
    (base("# TYPE kubeproxy_sync_proxy_rules_iptables_restore_failures_total counter\n"
          "kubeproxy_sync_proxy_rules_iptables_restore_failures_total -1\n"), "negative"),
    (base("# TYPE kubeproxy_sync_proxy_rules_iptables_restore_failures_total counter\n"
          "kubeproxy_sync_proxy_rules_iptables_restore_failures_total 1e300\n"), "implausibly large"),
    ("process_start_time_seconds +Inf\n", "infinite"),
    ("process_start_time_seconds 9e99\n", "implausibly large"),
    ("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=IPv4} 1\n", "Prometheus text format"),
    ("this is { not metrics\n", "no kube-proxy metrics"),
    ("process_start_time_seconds{ 12\n", "Prometheus text format"),
    ("# TYPE go_goroutines gauge\ngo_goroutines 12\n", "no kube-proxy metrics"),
    (base(hist_text({"IPv4": [0] * 5 + [4] * 5 + [3] * 5 + [4]})), "not cumulative"),
])
def test_malformed_or_impossible_input_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_kube_proxy_metrics(text)


def test_count_that_disagrees_with_the_inf_bucket_is_refused() -> None:
    text = base(hist_text({"IPv4": [1] * 16}).replace('_count{ip_family="IPv4"} 1', '_count{ip_family="IPv4"} 9'))
    with pytest.raises(MetricsError, match="differs from _count"):
        parse_kube_proxy_metrics(text)


def test_huge_text_is_refused_before_parsing() -> None:
    with pytest.raises(MetricsError, match="limit"):
        parse_kube_proxy_metrics("x" * 100, max_bytes=10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=15, max_size=15),
       st.integers(min_value=0, max_value=1000), st.floats(min_value=0.01, max_value=0.999))
def test_quantile_lies_inside_the_bucket_holding_the_rank(increments: list[int], inf_extra: int, q: float) -> None:
    cum, total = [], 0
    for inc in increments:
        total += inc
        cum.append(total)
    points = [*zip(BOUNDS, map(float, cum), strict=True), (math.inf, float(total + inf_extra))]
    value = histogram_quantile(q, points)
    grand = total + inf_extra
    if grand == 0:
        assert value is None
        return
    rank = q * grand
    holding = next(b for b, c in points if c >= rank)
    assert value is not None
    if math.isinf(holding):
        assert math.isinf(value)
    else:
        idx = BOUNDS.index(holding)
        lower = BOUNDS[idx - 1] if idx else 0.0
        assert lower - 1e-12 <= value <= holding + 1e-12


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_never_crashes_with_anything_but_metrics_error(text: str) -> None:
    with contextlib.suppress(MetricsError):
        parse_kube_proxy_metrics(text)


@pytest.mark.parametrize(("build", "reason"), WORST_CASES.values(), ids=WORST_CASES.keys())
def test_hostile_worst_cases_get_their_verdict_with_bounded_work(build: Callable[[], str], reason: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ends in a MetricsError that the gate turns into InvalidMetrics (or, for the one case within every
    bound, in the gate's wait). Instead of the wall time (bench/bench_metrics_parse.py prints that), the work
    is asserted: the per-line loop turns at most MAX_LINES times, and prometheus_client's parser is handed at
    most MAX_SELECTED_LINES lines of at most MAX_LINE_BYTES with at most MAX_LABELS labels each. Without the
    bounds these assertions fail."""
    text = build()
    # 8 MiB (the agent's read cap), or about the 1 MiB that is the most the parser may be handed
    assert MAX_TEXT_BYTES // 9 < len(text) <= MAX_TEXT_BYTES
    loop_turns = 0
    handed: list[str] = []
    real_name = metrics._metric_name

    def counting_name(line: str) -> str:
        nonlocal loop_turns
        loop_turns += 1
        return real_name(line)

    def recording_parser(selected: str) -> Iterable[Metric]:
        handed.append(selected)
        return text_string_to_metric_families(selected)

    monkeypatch.setattr(metrics, "_metric_name", counting_name)
    monkeypatch.setattr(metrics, "text_string_to_metric_families", recording_parser)
    refusal = ""
    try:
        parse_kube_proxy_metrics(text)
    except MetricsError as exc:
        refusal = str(exc)
    assert bool(refusal) == (reason == INVALID)
    assert loop_turns <= MAX_LINES
    for selected in handed:
        lines = [line for line in selected.split("\n") if line]
        assert len(lines) <= MAX_SELECTED_LINES
        assert all(len(line) <= MAX_LINE_BYTES for line in lines)
        assert all(line.count("=") <= MAX_LABELS for line in lines if not line.startswith("#"))

    facts = facts_from_probe(ProbeResult(proxy_mode=HttpAnswer(URL_MODE, 200, "nftables"),
                                         metrics=HttpAnswer(URL_METRICS, 200, text),
                                         healthz=HttpAnswer(URL_HEALTHZ, 200, "ok")))
    verdict = evaluate_gate(facts, GateSettings(), "nftables", datetime.now(UTC), datetime.now(UTC))
    assert verdict.reason == reason, verdict
    assert refusal[:60] in verdict.message


@pytest.mark.parametrize(("text", "words"), [
    ("\n" * (MAX_LINES + 1), f"limit {MAX_LINES} lines"),
    ("x 1\n" * (MAX_LINES + 1), f"limit {MAX_LINES} lines"),
    ("# HELP process_start_time_seconds x\n" * (MAX_SELECTED_LINES + 1), f"more than {MAX_SELECTED_LINES} lines"),
    (WANTED_BUCKET + "{" + ",".join(f'l{i}="v"' for i in range(MAX_LABELS + 1)) + "} 1\n",
     f"more than {MAX_LABELS} labels"),
    ("kubeproxy_x " + "1" * MAX_LINE_BYTES + "\n", f"limit {MAX_LINE_BYTES} bytes a line"),
])
def test_each_bound_is_named_one_past_it(text: str, words: str) -> None:
    with pytest.raises(MetricsError, match=words):
        select_lines(text)


def test_text_at_every_bound_is_still_accepted() -> None:
    """The bounds refuse only what is past them: a real capture padded to MAX_LINES lines, with the
    largest line and the most labels allowed, parses to the same facts."""
    real = (FIX / "kube-proxy-iptables-v1.37.2.txt").read_text()
    longest = "kubeproxy_x " + "1" * (MAX_LINE_BYTES - len("kubeproxy_x ")) + "\n"
    labelled = ("kubeproxy_sync_proxy_rules_iptables_restore_failures_total{"
                + ",".join(f'l{i}="v"' for i in range(MAX_LABELS)) + "} 0\n")
    padding = "go_x 1\n" * (MAX_LINES - real.count("\n") - 2)
    text = real + longest + labelled + padding
    assert text.count("\n") == MAX_LINES
    facts = parse_kube_proxy_metrics(text)
    assert facts == parse_kube_proxy_metrics(real).model_copy(update={"sync_failures": 0})


@given(st.lists(st.text(max_size=200), max_size=50))
def test_the_selected_text_is_bounded_by_line_and_sample_count(lines: list[str]) -> None:
    text = "\n".join(lines)
    try:
        selected, _ = select_lines(text)
    except MetricsError as exc:  # refusing is one of the two allowed outcomes; say which line
        assert "line" in str(exc) or "samples" in str(exc)
    else:
        kept = selected.split("\n")
        assert len(kept) <= len(text.split("\n")) + 1 and all(len(line) <= MAX_LINE_BYTES for line in kept)
        assert sum(line != "" for line in kept) <= MAX_SELECTED_LINES
