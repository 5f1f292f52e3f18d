"""`proxyshift diagnose` on the local cluster: the real kube-proxy's counters, read by the real agents.

Two Services of the test's own (namespace ps-diagnose) over real listeners: `affinity` (sessionAffinity
ClientIP, three endpoints, one of them not ready in its EndpointSlice) and `balanced` (two ready
endpoints, no affinity). Traffic comes from ps-node-1 through kube-proxy's iptables rules; the CLI
asks every agent for its counters and must name both causes for the first and call the second balanced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

NAMESPACE = "ps-diagnose"
NODE = "ps-node-1"
CONNECTIONS = 120  # enough for "balanced" over two endpoints (27 is the floor, planner/diagnosis.py)


def _service(name: str, affinity: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "ClusterIP", "ports": [{"name": "tcp", "port": 80, "targetPort": 8080,
                                                            "protocol": "TCP"}]}
    if affinity:
        spec |= {"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


def _slice(name: str, endpoints: list[Any], not_ready: set[str]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-1", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by": "proxyshift-e2e"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [e.ip], "conditions": {"ready": e.name not in not_ready,
                                                               "serving": e.name not in not_ready,
                                                               "terminating": False}} for e in endpoints],
            "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}]}


@pytest.fixture(scope="module")
def services(cluster: Any, kube: Any, operator_process: Any, wait_for: Any) -> dict[str, dict[str, Any]]:
    from localcluster import workloads

    # The operator makes a ProxyNode for every Node; the CLI talks to the agents through them.
    wait_for(lambda: len(kube.get("/apis/proxyshift.io/v1alpha1/proxynodes")["items"]) == len(cluster.nodes), 60,
             "a ProxyNode for every node")
    state_dir = cluster.require_local("diagnose e2e")
    endpoints = workloads.create_endpoints(state_dir, 3)
    workloads.ensure_namespace(kube, NAMESPACE)
    made: dict[str, dict[str, Any]] = {}
    for name, eps, not_ready, affinity in (("affinity", endpoints, {endpoints[2].name}, True),
                                           ("balanced", endpoints[:2], set(), False)):
        made[name] = kube.post(f"/api/v1/namespaces/{NAMESPACE}/services", _service(name, affinity))
        kube.post(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", _slice(name, eps, not_ready))
    return made


def diagnose_cli(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "operator")}
    return subprocess.run([sys.executable, "-m", "proxyshift.cli", "diagnose", "service", *args, "--kubeconfig",
                           str(kubeconfig), "--timeout", "30"], capture_output=True, text=True, timeout=90,
                          env=env, check=False)


def _traffic(tcp_probe: Any, wait_for: Any, service: dict[str, Any], expect_ok: int) -> Any:
    ip = service["spec"]["clusterIP"]
    # kube-proxy programs a new Service within its minSyncPeriod; wait for the first answer.
    wait_for(lambda: tcp_probe(NODE, ip, 80, 1, timeout=1.0).ok == 1, 60, f"kube-proxy on {NODE} serves {ip}")
    result = tcp_probe(NODE, ip, 80, expect_ok, timeout=2.0)
    assert result.failed == 0, result.errors
    return result


def test_diagnose_names_affinity_and_the_not_ready_endpoint(services: dict[str, dict[str, Any]], tcp_probe: Any,
                                                            wait_for: Any, kubeconfig: Path) -> None:
    result = _traffic(tcp_probe, wait_for, services["affinity"], CONNECTIONS)
    assert len(result.served_by) == 1, f"ClientIP affinity: one client, one endpoint; got {result.served_by}"
    out = diagnose_cli(kubeconfig, f"{NAMESPACE}/affinity")
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    node_part = out.stdout.split(f"node {NODE}:", 1)[1].split("\nnode ", 1)[0]
    assert "mode iptables, counters from iptables" in node_part
    assert "verdict: uneven" in node_part
    assert "cause ClientIPAffinity" in node_part and "timeout 600s" in node_part
    assert "cause EndpointNotReady" in node_part
    assert f"{CONNECTIONS + 1} new flows" in node_part  # every connection the client made, counted by the kernel
    assert "EndpointSlices: 2/3 endpoints ready" in out.stdout


def test_diagnose_calls_a_balanced_service_balanced(services: dict[str, dict[str, Any]], tcp_probe: Any,
                                                    wait_for: Any, kubeconfig: Path) -> None:
    result = _traffic(tcp_probe, wait_for, services["balanced"], CONNECTIONS)
    out = diagnose_cli(kubeconfig, f"{NAMESPACE}/balanced", "--node", NODE)
    print(f"client saw {dict(result.served_by)}\n{out.stdout}")
    assert out.returncode == 0, out.stderr
    assert "verdict: balanced" in out.stdout and "cause " not in out.stdout
    assert f"({CONNECTIONS + 1} new flows" in out.stdout  # the kernel counted what the client made
    assert len(result.served_by) == 2
