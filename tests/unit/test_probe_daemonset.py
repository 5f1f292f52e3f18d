"""The probe DaemonSet runs the probe server from a real, unprivileged pod, as the agent expects."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxyshift.agent import probe_server
from proxyshift.cli import SUBCOMMANDS

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "config" / "agent"


def test_the_probe_daemonset_is_an_unprivileged_pod_on_the_pod_network() -> None:
    ds = yaml.safe_load((CONFIG / "probe-daemonset.yaml").read_text())
    assert (ds["kind"], ds["metadata"]["name"], ds["metadata"]["namespace"]) == (
        "DaemonSet", "proxyshift-probe", "proxyshift-system")
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "proxyshift-probe"
    assert not pod.get("hostNetwork") and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The args are a real subcommand, and the readiness probe asks the endpoint the server has.
    assert container["args"][0] in SUBCOMMANDS
    listen = container["args"][container["args"].index("--listen") + 1]
    assert probe_server.parse_listen(listen)[1] == container["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "probe-daemonset.yaml" in yaml.safe_load((CONFIG / "kustomization.yaml").read_text())["resources"]
