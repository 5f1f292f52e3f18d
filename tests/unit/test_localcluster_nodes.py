"""The node half's pure pieces: $(VAR) expansion, image mapping, fieldRefs, bind specs, node plans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localcluster import container, listener, network
from localcluster.nodesim import node as sim_node
from localcluster.nodesim import podspec, volumes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), [
    ("--hostname-override=$(NODE_NAME)", "--hostname-override=ps-node-1"),
    ("$(NODE_NAME)-$(NODE_NAME)", "ps-node-1-ps-node-1"),
    ("$$(NODE_NAME)", "$(NODE_NAME)"),  # escaped
    ("$(MISSING)", "$(MISSING)"),  # unknown stays as written
    ("$(unterminated", "$(unterminated"),
    ("cost: $5", "cost: $5"),
])
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert podspec.expand(text, {"NODE_NAME": "ps-node-1"}) == expected


@pytest.mark.parametrize(("image", "kind"), [
    ("registry.k8s.io/kube-proxy:v1.37.2", "kube-proxy"),
    ("registry.k8s.io/kube-proxy@sha256:abc", "kube-proxy"),
    ("registry.k8s.io/kube-proxy", "kube-proxy"),
    ("ghcr.io/proxyshift/proxyshift:dev", "proxyshift"),
    ("ghcr.io/proxyshift/localcluster:dev", "localcluster"),
    ("registry.k8s.io/pause:3.10", "pause"),
    ("registry.k8s.io/kube-proxy-amd64:v1.37.2", None),
    ("docker.io/library/busybox:1", None),
    ("localhost:5000/kube-proxy:v1", None),
])
def test_image_kind(image: str, kind: str | None) -> None:
    assert podspec.image_kind(image) == kind


def test_field_refs() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"app": "x"}},
           "spec": {"nodeName": "ps-node-2"}}
    assert podspec.field_value(pod, "spec.nodeName", "198.18.0.12") == "ps-node-2"
    assert podspec.field_value(pod, "status.podIP", "198.18.0.12") == "198.18.0.12"
    assert podspec.field_value(pod, "status.hostIP", "198.18.0.12") == "198.18.0.12"
    assert podspec.field_value(pod, "metadata.labels['app']", "") == "x"
    assert podspec.field_value(pod, "spec.serviceAccountName", "") == "default"
    with pytest.raises(podspec.PodError):
        podspec.field_value(pod, "spec.bogus", "")


def test_named_ports_resolve_from_the_container() -> None:
    spec = {"name": "c", "ports": [{"name": "healthz", "containerPort": 10256}]}
    assert podspec.resolve_port("healthz", spec) == 10256
    assert podspec.resolve_port(8080, spec) == 8080
    with pytest.raises(ValueError, match="metrics"):
        podspec.resolve_port("metrics", spec)


def test_bind_specs() -> None:
    assert container.parse_bind("/a:/var/lib/kube-proxy") == ("/a", "/var/lib/kube-proxy", False)
    assert container.parse_bind("/a:/b:ro") == ("/a", "/b", True)
    for bad in ("/a", "/a:relative", ":/b", "/a:/b:/c:/d"):
        with pytest.raises(ValueError):
            container.parse_bind(bad)


def test_listener_endpoint_specs() -> None:
    assert listener.parse_endpoint("ps-ep-1:8080,8081") == ("ps-ep-1", [8080, 8081])
    with pytest.raises(ValueError):
        listener.parse_endpoint("ps-ep-1")


def test_node_plan_numbers_nodes_in_pool_order() -> None:
    assert network._node_plan({"blue": 2, "green": 1}) == [(1, "blue"), (2, "blue"), (3, "green")]
    assert network.node_ip(1) == "198.18.0.11"
    assert network.endpoint_ip(7) == "198.18.1.7"
    assert network.node_index("ps-node-12") == 12
    with pytest.raises(ValueError):
        network.node_ip(0)
    with pytest.raises(ValueError):
        network._node_plan({"x": network.MAX_NODES + 1})


def test_cluster_access_prefers_the_node_facing_url() -> None:
    access = network.cluster_access({"kubeconfig": "/k", "bin_dir": "/b", "api_url": "https://127.0.0.1:6443",
                                     "node_api_url": "https://198.18.0.1:6443"})
    assert access.api_url == "https://198.18.0.1:6443"
    assert access.api_host_port == ("198.18.0.1", 6443)
    assert access.kubeconfig == Path("/k")
    with pytest.raises(ValueError):
        network.cluster_access({"kubeconfig": "/k"})


def test_node_manifest_has_what_the_scheduler_and_tests_read() -> None:
    node = sim_node.node_manifest("ps-node-3", "198.18.0.13", "green", "v1.37.2")
    labels = node["metadata"]["labels"]
    assert labels["pool"] == labels["proxyshift-test-pool"] == "green"
    assert labels["kubernetes.io/hostname"] == "ps-node-3"
    assert labels["kubernetes.io/os"] == "linux"
    status = node["status"]
    assert {"type": "InternalIP", "address": "198.18.0.13"} in status["addresses"]
    assert [c["status"] for c in status["conditions"] if c["type"] == "Ready"] == ["True"]
    assert status["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert set(status["allocatable"]) >= {"cpu", "memory", "pods"}


def test_volume_files_are_written_in_place(tmp_path: Path) -> None:
    target = tmp_path / "vol"
    target.mkdir()
    volumes.write_files(target, {"config.conf": (b"mode: iptables\n", 0o644), "sub/x": (b"1", 0o600)})
    inode = (target / "config.conf").stat().st_ino
    volumes.write_files(target, {"config.conf": (b"mode: nftables\n", 0o644)})
    assert (target / "config.conf").read_text() == "mode: nftables\n"
    assert (target / "config.conf").stat().st_ino != inode  # replaced by rename: readers never see half a file
    assert not (target / "sub" / "x").exists()  # keys that left the object leave the volume


def test_a_volume_over_the_checkout_hides_the_package_and_the_venv_and_they_are_bound_back() -> None:
    package, venv, base = Path("/tmp/ck/operator/proxyshift"), Path("/tmp/ck/.venv"), Path("/usr")
    assert podspec.hidden_by([Path("/tmp")], [package, venv, base]) == [package, venv]
    assert podspec.hidden_by([Path("/tmp/ck/.venv/lib")], [package, venv, base]) == []
    assert podspec.hidden_by([], [package, venv, base]) == []


def test_image_paths_are_the_checkout_and_this_interpreters_environment() -> None:
    import sys

    import proxyshift

    paths = podspec.image_paths()
    assert str(Path(proxyshift.__file__).resolve().parent.parent) in paths
    assert sys.prefix in paths and sys.base_prefix in paths  # the venv, and the python it links to


def test_a_python_image_runs_its_own_package_from_this_checkout() -> None:
    import proxyshift

    product = str(Path(proxyshift.__file__).resolve().parent.parent)
    assert podspec.python_path("proxyshift") == product  # the product image: the product only
    testbed, rest = podspec.python_path("localcluster").split(":")
    assert rest == product and (Path(testbed) / "localcluster" / "nodesim" / "podspec.py").exists()
    assert testbed in podspec.image_paths()



def test_probe_time_scale_stretches_initial_delays_and_timeouts_only() -> None:
    from localcluster.nodesim import probes

    container: dict[str, Any] = {"name": "agent", "image": "x",
                 "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9811}, "initialDelaySeconds": 5,
                                   "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 3},
                 "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9811}, "periodSeconds": 10}}
    assert probes.scaled_probes(container, 1) is container
    scaled = probes.scaled_probes(container, 20)
    assert scaled["livenessProbe"]["initialDelaySeconds"] == 100 and scaled["livenessProbe"]["timeoutSeconds"] == 100
    assert scaled["livenessProbe"]["periodSeconds"] == 20 and scaled["livenessProbe"]["failureThreshold"] == 3
    # Defaults (0 s delay, 1 s timeout) scale too; the period stays, so readiness is seen as often.
    assert scaled["readinessProbe"]["initialDelaySeconds"] == 0 and scaled["readinessProbe"]["timeoutSeconds"] == 20
    assert scaled["readinessProbe"]["periodSeconds"] == 10
    assert container["livenessProbe"]["initialDelaySeconds"] == 5, "the pod's own spec is not changed"
    with pytest.raises(ValueError, match="positive"):
        probes.scaled_probes(container, 0)


def test_simulator_argv_passes_a_probe_time_scale_only_when_set() -> None:
    access = network.ClusterAccess(Path("/k"), Path("/bin"), "https://198.18.0.1:6443")
    plain = network.simulator_argv(access, Path("/s"), "ps-node-4", "vm")
    assert "--probe-time-scale" not in plain
    scaled = network.simulator_argv(access, Path("/s"), "ps-node-4", "vm", probe_time_scale=20)
    assert scaled[scaled.index("--probe-time-scale") + 1] == "20" and scaled[:len(plain)] == plain
