"""The node simulator's reading of securityContext (localcluster/security_context.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import baseline
from localcluster.security_context import DEFAULT_CAPABILITIES, SecurityContextError, confinement

pytestmark = pytest.mark.unit
CONFIG = Path(__file__).resolve().parents[2] / "config"


def pod_spec(path: str, kind: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((CONFIG / path).read_text()) if d and d["kind"] == kind]
    return docs[0]["spec"]["template"]["spec"]


def test_the_agent_gets_exactly_what_its_daemonset_grants() -> None:
    spec = pod_spec("agent/daemonset.yaml", "DaemonSet")
    c = confinement(spec, spec["containers"][0], "proxyshift")
    assert (c.uid, c.gid) == (0, 0)  # runAsUser: 0 over the image's 65532; no runAsGroup, so group 0
    assert c.capabilities == {"NET_ADMIN", "NET_RAW"}
    assert c.read_only_root and c.no_new_privs
    assert c.launcher_args() == ["--uid", "0", "--gid", "0", "--caps", "NET_ADMIN,NET_RAW", "--read-only-root",
                                 "--no-new-privs"]


def test_the_operator_and_the_probe_server_run_as_the_image_user_with_no_capability() -> None:
    for path, kind in (("manager/deployment.yaml", "Deployment"), ("agent/probe-daemonset.yaml", "DaemonSet")):
        spec = pod_spec(path, kind)
        c = confinement(spec, spec["containers"][0], "proxyshift")
        assert (c.uid, c.gid) == (65532, 65532), path
        assert c.capabilities == frozenset() and c.read_only_root and c.no_new_privs, path
        assert "--caps" in c.launcher_args() and c.launcher_args()[c.launcher_args().index("--caps") + 1] == ""


def test_privileged_kube_proxy_keeps_every_capability() -> None:
    spec = baseline.daemonset("v1.37.2")["spec"]["template"]["spec"]
    c = confinement(spec, spec["containers"][0], "kube-proxy")
    assert c.capabilities is None and c.uid == 0 and not c.read_only_root
    assert "--caps" not in c.launcher_args()


def test_no_security_context_is_the_runtime_default() -> None:
    c = confinement({}, {"name": "c"}, "proxyshift")
    assert (c.uid, c.gid) == (65532, 65532)  # the Dockerfile's USER
    assert c.capabilities == DEFAULT_CAPABILITIES and not c.read_only_root and not c.no_new_privs


def test_container_settings_win_over_the_pod_and_names_are_normalised() -> None:
    spec = {"securityContext": {"runAsUser": 1000, "runAsGroup": 2000}}
    c = confinement(spec, {"name": "c", "securityContext": {
        "runAsUser": 1001, "capabilities": {"drop": ["net_raw", "CAP_KILL"], "add": ["CAP_NET_ADMIN"]}}}, "pause")
    assert (c.uid, c.gid) == (1001, 2000)
    assert c.capabilities == (DEFAULT_CAPABILITIES - {"NET_RAW", "KILL"}) | {"NET_ADMIN"}
    # a runAsUser that is not the image's user gets group 0 when no runAsGroup is given
    assert confinement({}, {"name": "c", "securityContext": {"runAsUser": 7}}, "proxyshift").gid == 0


@pytest.mark.parametrize(("pod", "container", "message"), [
    ({"securityContext": {"runAsNonRoot": True}}, {}, "has runAsNonRoot and image will run as root"),
    ({"securityContext": {"runAsNonRoot": True}}, {"securityContext": {"runAsUser": 0}},
     "runAsUser breaks non-root policy"),
    ({}, {"securityContext": {"privileged": True, "allowPrivilegeEscalation": False}},
     "cannot set allowPrivilegeEscalation to false and privileged to true"),
])
def test_what_a_kubelet_refuses_is_refused(pod: dict[str, Any], container: dict[str, Any], message: str) -> None:
    with pytest.raises(SecurityContextError, match=message):
        confinement(pod, {"name": "c", **container}, "kube-proxy")
