"""Hostile /metrics text, end to end through the pure layers (issue 8, bad input).

From the raw answer the agent's probe got (huge, malformed, NaN, negative counters, ...) through
facts_from_probe (what the agent writes into ProxyNode.status), evaluate_gate (the verdict) and the
node state machine: the outcome is an immediate, named gate failure (InvalidMetrics) that rolls the
node back, never a pass and never a silent wait until the gate timeout.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from proxyshift.agent.probe import HttpAnswer, ProbeResult, facts_from_probe
from proxyshift.api.policy import GateSettings
from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.planner.gate import GateVerdict, evaluate_gate

pytestmark = pytest.mark.unit

SWITCH = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
NOW = SWITCH + timedelta(seconds=20)
START = SWITCH.timestamp() + 1
URL = "http://127.0.0.1:10249/metrics"


def healthy(**override: str) -> str:
    """A new kube-proxy's metrics with one line per fact; `override` swaps a sample's value text."""
    values = {"process_start_time_seconds": repr(START),
              "kubeproxy_sync_proxy_rules_last_timestamp_seconds": repr(START + 2),
              "kubeproxy_sync_proxy_rules_nftables_sync_failures_total": "0",
              "count": "3", "bucket_1": "3", "bucket_inf": "3"} | override
    return "\n".join([
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {values['process_start_time_seconds']}",
        "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds "
        f"{values['kubeproxy_sync_proxy_rules_last_timestamp_seconds']}",
        "# TYPE kubeproxy_sync_proxy_rules_nftables_sync_failures_total counter",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total "
        f"{values['kubeproxy_sync_proxy_rules_nftables_sync_failures_total']}",
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
        f'kubeproxy_sync_proxy_rules_duration_seconds_bucket{{le="1"}} {values["bucket_1"]}',
        f'kubeproxy_sync_proxy_rules_duration_seconds_bucket{{le="+Inf"}} {values["bucket_inf"]}',
        f"kubeproxy_sync_proxy_rules_duration_seconds_count {values['count']}",
        "kubeproxy_sync_proxy_rules_duration_seconds_sum 0.3",
        "",
    ])


def answers(metrics: HttpAnswer) -> ProbeResult:
    return ProbeResult(proxy_mode=HttpAnswer("http://127.0.0.1:10249/proxyMode", 200, "nftables\n"),
                       metrics=metrics, healthz=HttpAnswer("http://127.0.0.1:10256/healthz", 200, "ok"))


def verdict_for(metrics: HttpAnswer) -> tuple[KubeProxyFacts, GateVerdict]:
    facts = facts_from_probe(answers(metrics), now=NOW)
    return facts, evaluate_gate(facts, GateSettings(min_syncs=1), "nftables", SWITCH, NOW)


def test_the_healthy_text_passes() -> None:
    facts, verdict = verdict_for(HttpAnswer(URL, 200, healthy()))
    assert facts.metrics_invalid is None and verdict.result == "pass", verdict


HOSTILE = {
    "nan-start-time": (healthy(process_start_time_seconds="NaN"), "process_start_time_seconds is NaN"),
    "nan-counter": (healthy(kubeproxy_sync_proxy_rules_nftables_sync_failures_total="NaN"), "is NaN"),
    "negative-counter": (healthy(kubeproxy_sync_proxy_rules_nftables_sync_failures_total="-3"), "is negative"),
    "negative-sync-count": (healthy(count="-1", bucket_1="-1", bucket_inf="-1"), "is negative"),
    "infinite-last-sync": (healthy(kubeproxy_sync_proxy_rules_last_timestamp_seconds="+Inf"), "is infinite"),
    "counter-beyond-2^53": (healthy(kubeproxy_sync_proxy_rules_nftables_sync_failures_total="1e300"),
                            "implausibly large"),
    "start-time-in-year-3000": (healthy(process_start_time_seconds="32503680000"), "implausibly large"),
    "buckets-not-cumulative": (healthy(bucket_1="5", bucket_inf="3", count="3"), "not cumulative"),
    "inf-bucket-not-count": (healthy(count="7"), "differs from _count"),
    # Only the metrics the gate reads are parsed (linear time): text without them is "no kube-proxy metrics".
    "not-prometheus-text": ("<html><body>502 Bad Gateway</body></html>", "no kube-proxy metrics"),
    "binary-garbage": ("\x00\xff\x01 {{{ }}} \ufffd" * 100, "no kube-proxy metrics"),
    "binary-garbage-long-line": ("\x00\xff\x01 {{{ }}} \ufffd" * 1000, "not kube-proxy's"),
    "no-kube-proxy-metrics": ("# TYPE go_goroutines gauge\ngo_goroutines 12\n", "no kube-proxy metrics"),
    "label-injection": (healthy() + 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="1" 3\n',
                        "not in the Prometheus text format"),
}


@pytest.mark.parametrize(("text", "words"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_text_is_a_named_gate_failure(text: str, words: str) -> None:
    facts, verdict = verdict_for(HttpAnswer(URL, 200, text))
    assert (verdict.result, verdict.reason) == ("fail", "InvalidMetrics"), verdict
    assert words in verdict.message and URL in verdict.message, verdict.message
    assert facts.metrics_invalid and len(facts.metrics_invalid) <= 512  # bounded in the ProxyNode status


def test_an_oversized_answer_is_a_named_gate_failure() -> None:
    # What probe.http_get returns when kube-proxy (or whatever listens there) sends more than the cap.
    cut = HttpAnswer(URL, 200, error=f"GET {URL}: answer larger than 8388608 bytes", too_large=True)
    _, verdict = verdict_for(cut)
    assert (verdict.result, verdict.reason) == ("fail", "InvalidMetrics"), verdict
    assert "larger than 8388608 bytes" in verdict.message


def test_a_huge_text_past_the_parser_limit_is_refused_without_parsing() -> None:
    text = healthy() + "# padding\n" * (1024 * 1024)  # ~11 MiB of comments
    _, verdict = verdict_for(HttpAnswer(URL, 200, text))
    assert (verdict.result, verdict.reason) == ("fail", "InvalidMetrics") and "limit" in verdict.message


@pytest.mark.parametrize("answer", [HttpAnswer(URL, error=f"GET {URL}: ConnectionRefusedError: refused"),
                                    HttpAnswer(URL, 503, "")], ids=["refused", "http-503"])
def test_no_answer_is_not_invalid_metrics_it_waits(answer: HttpAnswer) -> None:
    # kube-proxy not (yet) answering is the ordinary start-up case: the gate waits, the timeout decides.
    facts, verdict = verdict_for(answer)
    assert facts.metrics_invalid is None
    assert (verdict.result, verdict.reason) == ("wait", "KubeProxyUnreachable"), verdict
