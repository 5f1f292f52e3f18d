"""Install as a platform team would (config/default) and check the permissions it grants (issue 6)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from localcluster import paths

pytestmark = pytest.mark.e2e

OPERATOR = "system:serviceaccount:proxyshift-system:proxyshift-operator"
AGENT = "system:serviceaccount:proxyshift-system:proxyshift-agent"

# (who, verb, resource, namespace or None, allowed) — the documented minimal set, both ways.
PERMISSIONS: list[tuple[str, str, str, str | None, bool]] = [
    (OPERATOR, "list", "proxypolicies.proxyshift.io", None, True),
    (OPERATOR, "patch", "proxypolicies.proxyshift.io/status", None, True),
    (OPERATOR, "update", "proxypolicies.proxyshift.io", None, False),
    (OPERATOR, "create", "proxypolicies.proxyshift.io", None, False),
    (OPERATOR, "delete", "proxypolicies.proxyshift.io", None, False),
    (OPERATOR, "create", "proxynodes.proxyshift.io", None, True),
    (OPERATOR, "patch", "nodes", None, True),
    (OPERATOR, "delete", "nodes", None, False),
    (OPERATOR, "create", "pods/eviction", "default", True),
    (OPERATOR, "delete", "pods", "default", False),
    (OPERATOR, "create", "daemonsets.apps", "kube-system", True),
    (OPERATOR, "delete", "daemonsets.apps", "kube-system", True),
    (OPERATOR, "create", "daemonsets.apps", "default", False),
    (OPERATOR, "delete", "configmaps", "default", False),
    (OPERATOR, "get", "secrets", "kube-system", False),
    (OPERATOR, "list", "secrets", None, False),
    (OPERATOR, "create", "clusterrolebindings.rbac.authorization.k8s.io", None, False),
    (AGENT, "watch", "proxynodes.proxyshift.io", None, True),
    (AGENT, "patch", "proxynodes.proxyshift.io/status", None, True),
    (AGENT, "patch", "proxynodes.proxyshift.io", None, False),
    (AGENT, "delete", "proxynodes.proxyshift.io", None, False),
    (AGENT, "list", "proxypolicies.proxyshift.io", None, False),
    (AGENT, "get", "secrets", "kube-system", False),
    (AGENT, "list", "pods", None, False),
    (AGENT, "patch", "nodes", None, False),
]


def kubectl(cluster: Any, *args: str, check: bool = True, timeout: float = 120) -> Any:
    return cluster.kubectl(*args, check=check, timeout=timeout)


def test_servicemonitor_selects_the_operator_metrics_service() -> None:
    import yaml

    root = paths.repo_root() / "config"
    monitor = yaml.safe_load((root / "prometheus" / "servicemonitor.yaml").read_text())
    service = next(d for d in yaml.safe_load_all((root / "manager" / "deployment.yaml").read_text())
                   if d["kind"] == "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_config_default_passes_server_side_dry_run(cluster: Any, proxyshift_installed: Path) -> None:
    out = kubectl(cluster, "apply", "-k", str(paths.repo_root() / "config" / "default"), "--dry-run=server",
                  "--server-side", "--force-conflicts", "--field-manager=proxyshift-install").stdout
    for kind in ("customresourcedefinition.apiextensions.k8s.io/proxypolicies.proxyshift.io",
                 "deployment.apps/proxyshift-operator", "daemonset.apps/proxyshift-agent",
                 "validatingadmissionpolicy.admissionregistration.k8s.io/proxyshift-agent-own-node"):
        assert kind in out, out


@pytest.mark.parametrize(("who", "verb", "resource", "namespace", "allowed"), PERMISSIONS,
                         ids=[f"{p[0].rsplit(':', 1)[1]}-{p[1]}-{p[2]}-{p[3] or 'cluster'}" for p in PERMISSIONS])
def test_roles_grant_exactly_the_documented_permissions(cluster: Any, proxyshift_installed: Path, who: str,
                                                        verb: str, resource: str, namespace: str | None,
                                                        allowed: bool) -> None:
    resource, _, subresource = resource.partition("/")
    args = ["auth", "can-i", verb, resource, f"--as={who}"]
    args += [f"--subresource={subresource}"] if subresource else []
    args += ["-n", namespace] if namespace else ["--all-namespaces"] if resource in ("pods", "secrets") else []
    result = kubectl(cluster, *args, check=False)
    answer = result.stdout.strip()
    assert answer == ("yes" if allowed else "no"), f"{who} {verb} {resource} {namespace}: {answer} {result.stderr}"


def _agent_pod(cluster: Any, node: str) -> str:
    pods = json.loads(kubectl(cluster, "-n", "proxyshift-system", "get", "pods", "-o", "json",
                              "--field-selector", f"spec.nodeName={node}").stdout)["items"]
    names = [p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith("proxyshift-agent-")]
    assert names, f"no agent pod on {node}"
    return names[0]


def _as_token(cluster: Any, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """kubectl with nothing but a bearer token: what an agent pod holds."""
    from localcluster import controlplane

    info = controlplane.load_info(cluster.state_dir)
    assert info is not None
    argv = [str(cluster.bin_dir / "kubectl"), "--kubeconfig", "/dev/null", f"--server={info.api_url}",
            f"--certificate-authority={info.ca_cert}", f"--token={token}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_an_agent_token_may_write_only_its_own_nodes_proxynode_status(cluster: Any, proxyshift_installed: Path,
                                                                     harness: Any) -> None:
    # ProxyNodes exist once a policy selected the nodes; a paused policy creates them and changes nothing.
    from tests.support.operator_harness import policy

    harness.apply(policy("blue-paused-admission", "nftables", rollout={"paused": True}))
    harness.wait_for(lambda: {"ps-node-1", "ps-node-2"} <= set(harness.proxynodes()), 60, "ProxyNodes of blue")
    pod = _agent_pod(cluster, "ps-node-1")
    token = kubectl(cluster, "-n", "proxyshift-system", "create", "token", "proxyshift-agent",
                    "--bound-object-kind=Pod", f"--bound-object-name={pod}", "--duration=10m").stdout.strip()
    patch = json.dumps({"status": {"agentVersion": "forged"}})
    other = _as_token(cluster, token, "patch", "proxynode", "ps-node-2", "--subresource=status", "--type=merge",
                      "-p", patch)
    assert other.returncode != 0, other.stdout
    assert "may write only the ProxyNode of its own node" in other.stderr, other.stderr
    spec = _as_token(cluster, token, "patch", "proxynode", "ps-node-1", "--type=merge", "-p",
                     json.dumps({"spec": {"mode": "ipvs"}}))
    assert spec.returncode != 0 and "forbidden" in spec.stderr.lower(), spec.stderr
    own = _as_token(cluster, token, "patch", "proxynode", "ps-node-1", "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"agentVersion": "0.1.0"}}))
    assert own.returncode == 0, own.stderr


def test_restore_baseline_refuses_while_nodes_run_a_revision(cluster: Any, harness: Any) -> None:
    from tests.support.operator_harness import policy

    harness.apply(policy("blue-restore-guard", "nftables"))
    harness.wait_condition("blue-restore-guard", "Ready", 420)
    done = subprocess.run([sys.executable, "-m", "proxyshift.cli", "restore-baseline", "--kubeconfig",
                           str(cluster.kubeconfig)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "still run a proxyshift revision" in done.stderr, done.stderr

