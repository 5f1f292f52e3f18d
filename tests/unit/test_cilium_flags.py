"""The confined Cilium agent's flags and lb state file (localcluster/cilium.py), without running it."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcluster import cilium

pytestmark = pytest.mark.unit


def _flags() -> dict[str, str]:
    argv = cilium.agent_flags(["eth0", "pspod0"], lib_dir=Path("/tmp/w/lib"), socket_path=Path("/tmp/w/cilium.sock"),
                              lb_state_file=Path("/tmp/w/lb.json"), native_cidr="198.18.0.0/15")
    return dict(flag.removeprefix("--").split("=", 1) for flag in argv)


def test_every_host_wide_path_is_the_launchers_private_mount() -> None:
    # The agent's defaults are the host's /sys/fs/bpf and a cgroup2 mount of the host's root cgroup:
    # both must be the mounts the launcher made in the agent's own mount namespace.
    flags = _flags()
    assert flags["cgroup-root"] == str(cilium.PRIVATE_CGROUP)
    assert flags["bpf-root"] == str(cilium.PRIVATE_BPFFS)
    assert flags["state-dir"] == str(cilium.PRIVATE_RUN)
    assert cilium.PRIVATE_RUN.is_relative_to("/run")  # under the launcher's tmpfs over /run
    assert not any(value.startswith("/sys/") for value in flags.values())


def test_kube_proxy_replacement_without_api_server_or_extras() -> None:
    flags = _flags()
    assert flags["kube-proxy-replacement"] == "true"
    assert flags["devices"] == "eth0,pspod0"
    assert flags["lb-state-file"] == "/tmp/w/lb.json"
    for off in ("enable-l7-proxy", "enable-hubble", "enable-health-checking", "cni-exclusive"):
        assert flags[off] == "false", off


def test_lb_state_holds_a_service_and_its_endpoint_slice() -> None:
    state = cilium.lb_state([cilium.Service("echo", "198.19.0.10", 80, 8080, ("198.18.1.2",), node_port=30080)])
    (service,) = state["services"]
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"] == [{"name": "tcp", "port": 80, "protocol": "TCP", "targetPort": 8080,
                                         "nodePort": 30080}]
    (slice_,) = state["endpoints"]
    assert slice_["metadata"]["labels"] == {"kubernetes.io/service-name": "echo"}
    assert [e["addresses"] for e in slice_["endpoints"]] == [["198.18.1.2"]]
    assert slice_["ports"][0]["port"] == 8080


def test_health_reports_kube_proxy_replacement_by_its_mode() -> None:
    assert cilium.kpr_enabled({"kube-proxy-replacement": {"mode": "True"}})
    assert not cilium.kpr_enabled({"kube-proxy-replacement": {"mode": "False"}})
    assert not cilium.kpr_enabled({})
