"""Cilium in the local cluster without running it: the DaemonSet's contract, the podCIDRs, the node's socket."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from localcluster import cilium, cilium_install, paths, podnet
from localcluster.nodesim import node as sim_node
from localcluster.nodesim import podspec, volumes
from localcluster.security_context import confinement

pytestmark = pytest.mark.unit


def _pod_spec() -> dict[str, Any]:
    return dict(cilium_install.daemonset()["spec"]["template"]["spec"])


def test_daemonset_runs_only_on_labelled_nodes() -> None:
    terms = _pod_spec()["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": "proxyshift.io/kube-proxy-replacement", "operator": "In", "values": ["cilium"]}]}]
    assert _pod_spec()["hostNetwork"] is True


def test_daemonset_image_is_the_one_the_simulator_runs_confined() -> None:
    (container,) = _pod_spec()["containers"]
    assert podspec.image_kind(container["image"]) == "cilium"
    assert container["command"] == [podspec.CILIUM_COMMAND]
    # Not privileged: exactly Cilium's capability list.
    granted = confinement(_pod_spec(), container, "cilium")
    assert granted.uid == 0 and granted.capabilities == frozenset(cilium_install.CAPABILITIES)


def test_no_host_wide_bpffs_or_cgroup_volume() -> None:
    # The launcher gives the agent its own bpffs and the node's cgroup: a hostPath of the host's would
    # undo the confinement.
    host_paths = {v["hostPath"]["path"] for v in _pod_spec()["volumes"] if "hostPath" in v}
    assert host_paths == {cilium_install.SOCKET_DIR, "/lib/modules", "/run/xtables.lock"}
    assert not any(p.startswith(("/sys/fs/bpf", "/sys/fs/cgroup", "/run/cilium/cgroupv2")) for p in host_paths)


def test_config_is_kpr_against_the_api_server() -> None:
    config = cilium_install.config()
    assert config["kube-proxy-replacement"] == "true"
    assert config["ipam"] == "kubernetes"
    assert config["identity-allocation-mode"] == "crd"
    assert config["devices"] == "eth0"
    assert "enable-k8s" not in config and "lb-state-file" not in config
    for off in ("enable-l7-proxy", "enable-hubble", "enable-health-checking", "enable-endpoint-health-checking",
                "cni-exclusive", "enable-ipv6"):
        assert config[off] == "false", off
    assert ipaddress.ip_network(config["ipv4-native-routing-cidr"]) == ipaddress.ip_network("198.18.0.0/15")


def test_rbac_reads_no_secrets() -> None:
    rules = cilium_install.cluster_role_rules()
    assert not any("secrets" in rule["resources"] for rule in rules)
    assert any("ciliumidentities" in r["resources"] and "create" in r["verbs"] for r in rules)


def test_node_pod_cidrs_are_disjoint_from_every_other_range() -> None:
    cidrs = [podnet.node_pod_cidr(i) for i in range(1, paths.MAX_NODES + 1)]
    assert all(c.subnet_of(podnet.NODE_POD_CIDR_RANGE) for c in cidrs)
    assert len(set(cidrs)) == len(cidrs)
    taken = [ipaddress.ip_network(n) for n in ("198.18.0.0/24", "198.18.1.0/24", paths.SERVICE_CIDR)] + \
        [podnet.POD_RANGE, podnet.SECOND_ADDRESS_NETWORK]
    assert not any(podnet.NODE_POD_CIDR_RANGE.overlaps(t) for t in taken)
    assert podnet.NODE_POD_CIDR_RANGE.subnet_of(ipaddress.IPv4Network(paths.KUBE_PROXY_CLUSTER_CIDR))


def test_node_manifest_carries_its_pod_cidr() -> None:
    node = sim_node.node_manifest("ps-node-2", "198.18.0.12", "blue", "v1.37.2", "198.18.64.32/27")
    assert node["spec"] == {"podCIDR": "198.18.64.32/27", "podCIDRs": ["198.18.64.32/27"]}
    assert sim_node.node_manifest("ps-node-2", "198.18.0.12", "blue", "v1.37.2")["spec"] == {}


def test_cilium_socket_folder_is_the_nodes_own(tmp_path: Path) -> None:
    one, two = tmp_path / "ps-node-1", tmp_path / "ps-node-2"
    assert volumes.node_host_path(one, Path("/var/run/cilium")) == one / "hostpath/run/cilium"
    assert volumes.node_host_path(one, Path("/run/cilium/cilium.sock")) == one / "hostpath/run/cilium/cilium.sock"
    assert volumes.node_host_path(two, Path("/var/run/cilium")) != volumes.node_host_path(one, Path("/var/run/cilium"))
    # The node's BPF filesystem is its own too (a bpffs instance per node, mounted by the simulator).
    assert volumes.node_host_path(one, Path("/sys/fs/bpf")) == one / "hostpath/sys/fs/bpf"
    assert volumes.node_host_path(one, Path("/sys/fs/bpf/cilium")) == one / "hostpath/sys/fs/bpf/cilium"
    # Everything else stays the machine's.
    for shared in ("/lib/modules", "/run/xtables.lock", "/var/run/ciliumx", "/run", "/sys/fs/bpfx", "/sys"):
        assert volumes.node_host_path(one, Path(shared)) is None, shared
    socket = cilium_install.node_socket(tmp_path, "ps-node-1")
    assert socket == paths.StateLayout(tmp_path).nodes / "ps-node-1/hostpath/run/cilium/cilium.sock"


def test_image_flags_point_at_the_launchers_mounts() -> None:
    flags = dict(f.removeprefix("--").split("=", 1) for f in cilium.image_flags(Path("/n/cilium/lib")))
    assert flags == {"lib-dir": "/n/cilium/lib", "bpf-root": str(cilium.PRIVATE_BPFFS),
                     "cgroup-root": str(cilium.PRIVATE_CGROUP)}
    # Beside the agent's state dir, not in it: /run/cilium is the node's hostPath folder in a pod.
    assert not cilium.PRIVATE_BPFFS.is_relative_to(cilium.PRIVATE_RUN)
    assert not cilium.PRIVATE_CGROUP.is_relative_to(cilium.PRIVATE_RUN)


SAVE = """# Generated by iptables-save
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:CILIUM_OUTPUT_nat - [0:0]
:CILIUM_PRE_nat - [0:0]
-A PREROUTING -m comment --comment "cilium-feeder: CILIUM_PRE_nat" -j CILIUM_PRE_nat
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "cilium-feeder: CILIUM_OUTPUT_nat" -j CILIUM_OUTPUT_nat
-A CILIUM_OUTPUT_nat -j CILIUM_PRE_nat
COMMIT
*filter
:INPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
COMMIT
"""


def test_leftover_rules_remove_only_ciliums_chains_and_jumps() -> None:
    rules = cilium_install.leftover_rules(SAVE)
    assert rules == {"nat": [
        '-D PREROUTING -m comment --comment "cilium-feeder: CILIUM_PRE_nat" -j CILIUM_PRE_nat',
        '-D OUTPUT -m comment --comment "cilium-feeder: CILIUM_OUTPUT_nat" -j CILIUM_OUTPUT_nat',
        "-F CILIUM_OUTPUT_nat", "-F CILIUM_PRE_nat", "-X CILIUM_OUTPUT_nat", "-X CILIUM_PRE_nat"]}
    assert cilium_install.leftover_rules("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n") == {}
