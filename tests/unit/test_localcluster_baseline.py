"""The baseline fixtures the render tests read are exactly what the local cluster installs."""

from __future__ import annotations

import pytest
import yaml

from localcluster import baseline

pytestmark = pytest.mark.unit


def test_fixture_files_are_current() -> None:
    # If this fails: python -m localcluster.baseline --write-fixtures
    for name, text in baseline.fixture_documents().items():
        assert (baseline.fixtures_dir() / name).read_text() == text, name


def test_daemonset_is_kubeadm_shaped() -> None:
    ds = baseline.daemonset()
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.k8s.io/kube-proxy:v1.37.2"
    assert container["command"] == ["/usr/local/bin/kube-proxy", "--config=/var/lib/kube-proxy/config.conf",
                                    "--hostname-override=$(NODE_NAME)"]
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert {v["name"] for v in pod["volumes"]} == {"kube-proxy", "xtables-lock", "lib-modules"}
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_config_leaves_host_wide_conntrack_alone() -> None:
    config = yaml.safe_load(baseline.configmap()["data"]["config.conf"])
    assert config["mode"] == "iptables"
    assert config["conntrack"]["maxPerCore"] == 0
    assert config["conntrack"]["tcpEstablishedTimeout"] == "0s"
    assert config["conntrack"]["tcpCloseWaitTimeout"] == "0s"
    kubeconfig = yaml.safe_load(baseline.configmap()["data"]["kubeconfig.conf"])
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://198.18.0.1:6443"


def test_mode_is_a_parameter() -> None:
    config = yaml.safe_load(baseline.configmap("nftables")["data"]["config.conf"])
    assert config["mode"] == "nftables"
