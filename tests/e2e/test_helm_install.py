"""charts/proxyshift against the real `kubectl kustomize`, and installed with helm on the local cluster.

The install test replaces the session's kustomize install (tests/support/operator_harness.py) with the
chart, runs the operator as the chart's in-cluster Deployment, migrates pool blue and reverts it, then
uninstalls the release and puts the kustomize install back for the modules after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import build, install
from proxyshift.commands import CommandError, run
from tests.support.chart_render import CHART, NAMESPACE, ROOT, differences, helm_env, helm_run, render
from tests.support.operator_harness import REVISION_LABEL, policy, service_account_kubeconfig

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]
RELEASE = "proxyshift"
# The objects config/default applies besides the CRDs and the Namespace, which the chart's install keeps.
KUSTOMIZE_OBJECTS = ("config/agent", "config/admission")
KUSTOMIZE_RBAC_FILES = ("config/rbac/operator.yaml", "config/rbac/agent.yaml")


def _kubectl_binary() -> Path:
    kubectl = build.bin_dir_for() / "kubectl"
    if not kubectl.is_file():
        pytest.fail(f"no kubectl in {kubectl.parent}: run `make binaries` (the pinned Kubernetes build)")
    return kubectl


def _one_break_per_blank_line(obj: dict[str, Any]) -> dict[str, Any]:
    """A ValidatingAdmissionPolicy's CEL with each blank line read as one line break.

    The multi-line CEL of config/admission/operator-kube-system.yaml is a `>-` block whose later
    lines are more indented than its first. What `kubectl kustomize` prints of it reads back with a
    blank line before such lines, where the file itself (PyYAML, and helm's reading of it) has one
    line break, as the YAML spec says. CEL ignores the whitespace; nothing else is changed.
    """
    if obj["kind"] != "ValidatingAdmissionPolicy":
        return obj
    for validation in obj["spec"].get("validations", []):
        while "\n\n" in validation["expression"]:
            validation["expression"] = validation["expression"].replace("\n\n", "\n")
    return obj


def test_default_values_render_what_kubectl_kustomize_builds() -> None:
    built = run([str(_kubectl_binary()), "kustomize", str(ROOT / "config" / "default")], timeout=120).stdout
    kustomized = [_one_break_per_blank_line(d) for d in yaml.safe_load_all(built) if d]
    assert differences(render(), kustomized) == []


def _helm(cluster: Any, home: Path, *args: str, timeout: float = 420) -> str:
    return helm_run(*args, "--kubeconfig", str(cluster.kubeconfig), timeout=timeout, env=helm_env(home))


def test_helm_install_runs_the_operator_in_cluster_and_migrates_a_pool(cluster: Any, harness: Any,
                                                                       tmp_path: Path) -> None:
    h = harness
    h.operator.stop()  # only the chart's in-cluster replicas may act now
    for target in KUSTOMIZE_OBJECTS:
        cluster.kubectl("delete", "-k", str(ROOT / target), "--ignore-not-found", "--wait=true", timeout=180)
    for path in KUSTOMIZE_RBAC_FILES:
        cluster.kubectl("delete", "-f", str(ROOT / path), "--ignore-not-found", "--wait=true", timeout=180)
    try:
        # --wait: every agent, probe server and operator replica Ready before helm says deployed.
        _helm(cluster, tmp_path, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--wait",
              "--timeout", "5m")
        releases = json.loads(_helm(cluster, tmp_path, "list", "--namespace", NAMESPACE, "-o", "json"))
        assert [(r["name"], r["status"]) for r in releases] == [(RELEASE, "deployed")]
        manifest = _helm(cluster, tmp_path, "get", "manifest", RELEASE, "--namespace", NAMESPACE)
        kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(manifest) if d}
        assert {("Deployment", "proxyshift-operator"), ("DaemonSet", "proxyshift-agent"),
                ("ValidatingAdmissionPolicy", "proxyshift-agent-own-node")} <= kinds
        h.wait_for(lambda: "proxyshift" in cluster.kubectl("get", "clusterkopfpeerings", "-o", "name").stdout,
                   60, "the operator's peering object")

        h.apply(policy("blue-helm", "nftables"))
        h.wait_condition("blue-helm", "Ready", 420)
        assert all(h.proxy_mode(n) == "nftables" for n in BLUE)
        assert all(h.node_labels(n).get(REVISION_LABEL, "").startswith("blue-helm-") for n in BLUE)
        assert h.proxy_mode("ps-node-3") == "iptables"  # pool green is not selected
        h.delete("blue-helm", wait=420)
        assert all(h.proxy_mode(n) == "iptables" for n in BLUE)

        _helm(cluster, tmp_path, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "3m")
        left = cluster.kubectl("-n", NAMESPACE, "get", "deployment,daemonset", "-o", "name").stdout
        assert left.strip() == "", left
        # Helm never deletes what crds/ installed: the policies and ProxyNodes of the cluster survive.
        cluster.kubectl("get", "crd", "proxypolicies.proxyshift.io", "proxynodes.proxyshift.io")
    finally:
        _helm_uninstall_quietly(cluster, tmp_path)
        install.install(cluster.bin_dir, cluster.kubeconfig)
        # The ServiceAccount was deleted and made again, which invalidates every token of the old one:
        # the session's operator logs in with a fresh token of the new one.
        if h.operator.kubeconfig != cluster.kubeconfig:
            service_account_kubeconfig(cluster, "proxyshift-operator", Path(h.operator.kubeconfig))
        h.operator.start()
        h.operator.wait_healthy()


def _helm_uninstall_quietly(cluster: Any, home: Path) -> None:
    """After a failure half-way: leave no release behind for the next module (none is not an error)."""
    try:
        _helm(cluster, home, "uninstall", RELEASE, "--namespace", NAMESPACE, "--ignore-not-found", "--wait",
              "--timeout", "3m")
    except CommandError as exc:  # the finally block must go on restoring the kustomize install
        print(f"helm uninstall after the test: {exc}")
