"""The operator's metrics on a live rollout: the series the alerts (config/prometheus/alerts) read
carry what the API objects say, from a halt through a retry to the policy's deletion."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.operator_harness import Harness, migration, policy

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]
GREEN = ["ps-node-3"]
READY_TIMEOUT = 420


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(h: Harness) -> Samples:
    url = f"http://127.0.0.1:{h.operator.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def scrape_until(h: Harness, name: str, want: float, **labels: str) -> Samples:
    """The operator's metrics once the gauge shows `want` (the gauges follow the operator's next step)."""
    def check() -> Samples | None:
        samples = scrape(h)
        return samples if value(samples, name, **labels) == want else None

    result: Samples = h.wait_for(check, 30, f"{name} {labels} == {want}")
    return result


def series(samples: Samples, name: str) -> list[dict[str, Any]]:
    return [dict(labels, value=v) for (n, labels), v in samples.items() if n == name]


def test_alert_series_follow_a_halt_a_retry_and_the_deletion(harness: Harness) -> None:
    h = harness
    started = time.time()
    # No kube-proxy syncs in a microsecond: the gate fails on the first node, which rolls back.
    h.apply(policy("blue-metrics", "nftables", deletionPolicy="Revert",
                   gate={"timeout": "60s", "minSyncs": 1, "maxSyncDurationSeconds": 0.000001}))
    h.wait_condition("blue-metrics", "Degraded", 300)
    h.wait_for(lambda: migration(h.proxynodes()[BLUE[0]]).get("phase") in ("RolledBack", "Failed"), 120,
               f"{BLUE[0]}'s rollback to end")
    m = scrape_until(h, "proxyshift_policy_condition", 1, policy="blue-metrics", condition="Degraded")
    assert value(m, "proxyshift_policy_ready", policy="blue-metrics") == 0
    assert value(m, "proxyshift_policy_revert_halted", policy="blue-metrics") == 0
    assert (value(m, "proxyshift_rollbacks_total", policy="blue-metrics") or 0) >= 1
    reasons = [s for s in series(m, "proxyshift_gate_failures_total") if s["policy"] == "blue-metrics"]
    assert reasons and all(s["reason"] for s in reasons), reasons
    progress = value(m, "proxyshift_policy_last_progress_timestamp_seconds", policy="blue-metrics")
    assert progress is not None and started - 5 <= progress <= time.time() + 5

    # fix the spec and ask for a retry
    h.patch("blue-metrics", {"metadata": {"annotations": {"proxyshift.io/retry": "1"}},
                             "spec": {"gate": {"maxSyncDurationSeconds": None}}})
    h.wait_condition("blue-metrics", "Ready", READY_TIMEOUT)
    m = scrape_until(h, "proxyshift_policy_ready", 1, policy="blue-metrics")
    assert value(m, "proxyshift_policy_condition", policy="blue-metrics", condition="Degraded") == 0
    assert value(m, "proxyshift_nodes", policy="blue-metrics", phase="Done") == len(BLUE)
    now = time.time()
    for node in BLUE + GREEN:
        beat = value(m, "proxyshift_proxynode_heartbeat_timestamp_seconds", node=node)
        assert beat is not None and now - beat < 180, (node, beat, now)
    modes = {s["node"]: s for s in series(m, "proxyshift_proxynode_mode_mismatch")}
    for node, want in [*((n, "nftables") for n in BLUE), *((n, "iptables") for n in GREEN)]:
        assert modes[node]["target_mode"] == want and modes[node]["observed_mode"] == want, modes[node]
        assert modes[node]["value"] == 0

    h.delete("blue-metrics", wait=READY_TIMEOUT)
    m = scrape(h)
    gone = [k for k in m if dict(k[1]).get("policy") == "blue-metrics" and k[0] in (
        "proxyshift_policy_ready", "proxyshift_policy_condition", "proxyshift_policy_revert_halted",
        "proxyshift_policy_last_progress_timestamp_seconds", "proxyshift_nodes")]
    assert not gone, f"gauges of a deleted policy still exported: {gone}"
    modes = {s["node"]: s for s in series(m, "proxyshift_proxynode_mode_mismatch")}
    assert all(modes[n]["target_mode"] == "iptables" and modes[n]["value"] == 0 for n in BLUE), modes
