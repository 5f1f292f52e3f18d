"""The agents' own metrics and health on the local cluster (agent/metrics.py, config/agent/daemonset.yaml).

Every agent pod becomes Ready through its readiness probe on /readyz (the node simulator runs the
httpGet probes), and a Probe operation moves proxyshift_agent_operations_total as scraped from inside
the node, where a Prometheus target on the host network would find it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

NODE = "ps-node-1"
PORT = 9811  # --listen in config/agent/daemonset.yaml
PROXYNODES = "/apis/proxyshift.io/v1alpha1/proxynodes"
NAMESPACE = "proxyshift-system"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(node_http_get: Callable[..., tuple[int, str]], node: str) -> Samples:
    status, text = node_http_get(node, f"http://127.0.0.1:{PORT}/metrics", timeout=5.0)
    assert status == 200, text[:500]
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_every_agent_pod_is_ready_through_its_probes(cluster: Any, kube: Any, proxyshift_installed: Any,
                                                     node_http_get: Callable[..., tuple[int, str]]) -> None:
    pods = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods",
                    labelSelector="app.kubernetes.io/name=proxyshift-agent")["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(cluster.nodes)
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}.get("Ready")
        assert ready == "True", (pod["metadata"]["name"], pod["status"])
        node = pod["spec"]["nodeName"]
        for path in ("/healthz", "/readyz"):
            status, body = node_http_get(node, f"http://127.0.0.1:{PORT}{path}", timeout=5.0)
            assert (status, body) == (200, "ok\n"), (node, path, status, body)


def test_a_probe_operation_moves_the_agent_s_operation_counter(
        kube: Any, proxyshift_installed: Any, node_http_get: Callable[..., tuple[int, str]],
        wait_for: Callable[..., Any]) -> None:
    before = scrape(node_http_get, NODE)
    op_id = f"e2e-agent-metrics.Probe.{time.time_ns()}"
    operation = {"id": op_id, "type": "Probe", "params": {}}
    existing = kube.get_or_none(f"{PROXYNODES}/{NODE}")
    # The operator makes ProxyNodes; without one running, the test makes its own and removes it after.
    if existing is None:
        kube.post(PROXYNODES, {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode",
                               "metadata": {"name": NODE}, "spec": {"operation": operation}})
    else:
        kube.merge_patch(f"{PROXYNODES}/{NODE}", {"spec": {"operation": operation}})
    try:
        def done() -> dict[str, Any] | None:
            last = ((kube.get(f"{PROXYNODES}/{NODE}").get("status") or {}).get("lastOperation") or {})
            return last if last.get("id") == op_id and last.get("state") in ("Succeeded", "Failed") else None

        # An agent that found no ProxyNode looks again every 10 s.
        last = wait_for(done, 60, f"the agent on {NODE} to answer {op_id}")
        assert last["state"] == "Succeeded", last
        after = scrape(node_http_get, NODE)
    finally:
        if existing is None:
            kube.delete(f"{PROXYNODES}/{NODE}")
        else:
            kube.merge_patch(f"{PROXYNODES}/{NODE}",
                             {"spec": {"operation": (existing.get("spec") or {}).get("operation")}})
    counted = "proxyshift_agent_operations_total"
    assert value(after, counted, type="Probe", result="succeeded") == \
        value(before, counted, type="Probe", result="succeeded") + 1
    timed = "proxyshift_agent_operation_duration_seconds_count"
    assert value(after, timed, type="Probe") == value(before, timed, type="Probe") + 1
    probes = "proxyshift_agent_kube_proxy_probe_duration_seconds_count"
    assert value(after, probes) > value(before, probes)
    # The result was written just now: the heartbeat is fresh and on the agent's (here: our) clock.
    assert value(after, "proxyshift_agent_heartbeat_age_seconds") < 30
    assert abs(value(after, "proxyshift_agent_last_status_write_timestamp_seconds") - time.time()) < 60
