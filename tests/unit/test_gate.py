"""Gate evaluation: pass / wait / fail with reasons, on real-looking and hostile facts."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from proxyshift.api.policy import GateSettings, ServiceRef
from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.planner.gate import CLOCK_SKEW_SECONDS, GateVerdict, evaluate_gate

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
SWITCH = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
NOW = SWITCH + timedelta(seconds=40)
T = SWITCH.timestamp()


def facts(**changes: object) -> KubeProxyFacts:
    """What the agent reads from a healthy nftables kube-proxy 30s after the switch."""
    base = {
        "proxy_mode": "nftables", "healthz_status": 200, "process_start_time": T + 3.2,
        "last_sync_timestamp": T + 9.7, "sync_count": 4, "sync_duration_p99_seconds": 0.12,
        "sync_failures": 0, "probed_at": "2026-11-30T12:00:30Z",
    }
    base.update(changes)
    return KubeProxyFacts.model_validate(base)


def judge(f: KubeProxyFacts | None, gate: GateSettings | None = None, mode: str = "nftables",
          **kw: Any) -> GateVerdict:
    return evaluate_gate(f, gate or GateSettings(), mode, SWITCH, NOW, **kw)


def test_healthy_new_process_passes() -> None:
    verdict = judge(facts(), GateSettings(max_sync_duration_seconds=1.0))
    assert verdict.result == "pass", verdict
    assert verdict.reason == "GatePassed"
    assert "nftables" in verdict.message and "p99" in verdict.message


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_facts_parsed_from_real_kube_proxy_metrics(mode: str) -> None:
    from proxyshift.planner.metrics import parse_kube_proxy_metrics

    captures = sorted(FIXTURES.glob(f"kube-proxy-{mode}-*.txt"))
    assert captures, f"no kube-proxy {mode} /metrics capture in {FIXTURES}"
    parsed = parse_kube_proxy_metrics(captures[-1].read_text())
    start = parsed.process_start_time
    assert start is not None
    switched = datetime.fromtimestamp(start - 2, tz=UTC)
    # /proxyMode and /healthz are separate endpoints: the agent adds them to the parsed metrics.
    f = parsed.model_copy(update={"proxy_mode": mode, "healthz_status": 200})
    now = switched + timedelta(minutes=1)
    verdict = evaluate_gate(f, GateSettings(), mode, switched, now)
    assert verdict.result == "pass", verdict
    # The same capture judged against a switch after the process started: that is the old process.
    later = datetime.fromtimestamp(start + 60, tz=UTC)
    assert evaluate_gate(f, GateSettings(), mode, later, now).reason == "OldProcess"
    # A fresh kube-proxy has done one sync: a gate asking for three waits.
    assert evaluate_gate(f, GateSettings(min_syncs=3), mode, switched, now).reason == "NotEnoughSyncs"
    # Its first full sync took ~0.13s: over a 0.1s bound.
    tight = GateSettings(max_sync_duration_seconds=0.1)
    assert evaluate_gate(f, tight, mode, switched, now).reason == "SyncTooSlow"
    other = "iptables" if mode == "nftables" else "nftables"
    assert evaluate_gate(f, GateSettings(), other, switched, now).reason == "WrongMode"


def test_old_process_waits_even_in_wrong_mode() -> None:
    verdict = judge(facts(process_start_time=T - 3600, proxy_mode="iptables"))
    assert (verdict.result, verdict.reason) == ("wait", "OldProcess")
    assert f"{CLOCK_SKEW_SECONDS:g}s of clock skew" in verdict.message


def test_clock_skew_tolerance() -> None:
    assert judge(facts(process_start_time=T - CLOCK_SKEW_SECONDS + 0.5, last_sync_timestamp=T + 1)).result == "pass"
    assert judge(facts(process_start_time=T - CLOCK_SKEW_SECONDS - 0.5)).reason == "OldProcess"


def test_wrong_mode_on_new_process_fails() -> None:
    verdict = judge(facts(proxy_mode="iptables"))
    assert (verdict.result, verdict.reason) == ("fail", "WrongMode")
    assert "'iptables'" in verdict.message and "'nftables'" in verdict.message


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"last_sync_timestamp": None}, "NotSynced"),
        ({"last_sync_timestamp": 0.0}, "NotSynced"),
        ({"last_sync_timestamp": T + 1.0}, "NotSynced"),  # before this process started: not its sync
        ({"sync_count": 0}, "NotEnoughSyncs"),
        ({"sync_count": None}, "MetricMissing"),
        ({"healthz_status": 503}, "Unhealthy"),
        ({"healthz_status": None}, "HealthzPending"),
        ({"proxy_mode": None}, "ModeUnknown"),
        ({"process_start_time": None}, "MetricMissing"),
        ({"error": "dial tcp 127.0.0.1:10249: connect: connection refused"}, "KubeProxyUnreachable"),
        ({"process_start_time": NOW.timestamp() + 3600}, "NodeClockAhead"),
    ],
)
def test_not_proven_yet_waits(changes: dict, reason: str) -> None:
    verdict = judge(facts(**changes))
    assert (verdict.result, verdict.reason) == ("wait", reason), verdict


def test_min_syncs() -> None:
    assert judge(facts(sync_count=4), GateSettings(min_syncs=5)).reason == "NotEnoughSyncs"
    assert judge(facts(sync_count=5), GateSettings(min_syncs=5)).result == "pass"


def test_no_facts_waits() -> None:
    assert judge(None).reason == "NoProbeYet"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"sync_failures": 2}, "SyncFailures"),
        ({"sync_failures": -1}, "InvalidMetrics"),
        ({"sync_count": -4}, "InvalidMetrics"),
        ({"last_sync_timestamp": math.nan}, "InvalidMetrics"),
        ({"sync_duration_p99_seconds": math.nan}, "InvalidMetrics"),
        ({"process_start_time": math.nan}, "InvalidMetrics"),
        ({"process_start_time": -5.0}, "InvalidMetrics"),
        ({"process_start_time": math.inf}, "InvalidMetrics"),
    ],
)
def test_proof_of_failure_fails(changes: dict, reason: str) -> None:
    verdict = judge(facts(**changes), GateSettings(max_sync_duration_seconds=1.0))
    assert (verdict.result, verdict.reason) == ("fail", reason), verdict


def test_sync_failures_win_over_waiting_for_healthz() -> None:
    assert judge(facts(sync_failures=1, healthz_status=503)).reason == "SyncFailures"


def test_p99_bound() -> None:
    gate = GateSettings(max_sync_duration_seconds=0.1)
    assert judge(facts(sync_duration_p99_seconds=0.12), gate).reason == "SyncTooSlow"
    slow = judge(facts(sync_duration_p99_seconds=math.inf), gate)
    assert slow.reason == "SyncTooSlow" and "largest histogram bucket" in slow.message
    assert judge(facts(sync_duration_p99_seconds=None), gate).reason == "MetricMissing"
    assert judge(facts(sync_duration_p99_seconds=None)).result == "pass"  # no bound, no need


def test_missing_failure_counter_is_not_a_failure() -> None:
    assert judge(facts(sync_failures=None)).result == "pass"


def test_healthz_can_be_skipped() -> None:
    assert judge(facts(healthz_status=503), GateSettings(healthz=False)).result == "pass"


def test_service_connects() -> None:
    gate = GateSettings(probe_services=[ServiceRef(name="kubernetes", port=443)])
    assert judge(facts(), gate).reason == "ProbePending"
    assert judge(facts(), gate, connect_results={"198.19.0.1:443": True}).result == "pass"
    failed = judge(facts(), gate, connect_results={"198.19.0.1:443": "connection refused"})
    assert (failed.result, failed.reason) == ("fail", "ServiceUnreachable")
    assert "198.19.0.1:443 (connection refused)" in failed.message
