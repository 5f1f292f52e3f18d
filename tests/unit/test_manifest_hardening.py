"""What users check in an operator's manifests: seccomp, capabilities, Pod Security labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "config"


def _docs(path: str) -> list[dict[str, Any]]:
    with open(CONFIG / path) as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def _pod_spec(path: str, kind: str) -> dict[str, Any]:
    (workload,) = [d for d in _docs(path) if d["kind"] == kind]
    return workload["spec"]["template"]["spec"]


@pytest.mark.parametrize(("path", "kind"), [("agent/daemonset.yaml", "DaemonSet"),
                                            ("manager/deployment.yaml", "Deployment")])
def test_both_workloads_run_under_the_runtime_default_seccomp_profile(path: str, kind: str) -> None:
    spec = _pod_spec(path, kind)
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in spec["containers"]:
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx.get("privileged")


def test_the_agent_adds_exactly_net_admin_and_net_raw() -> None:
    (agent,) = _pod_spec("agent/daemonset.yaml", "DaemonSet")["containers"]
    assert sorted(agent["securityContext"]["capabilities"]["add"]) == ["NET_ADMIN", "NET_RAW"]


def test_the_namespace_says_which_pod_security_level_the_agent_needs() -> None:
    (namespace,) = _docs("rbac/namespace.yaml")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"  # hostNetwork + NET_ADMIN
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
