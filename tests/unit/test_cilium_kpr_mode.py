"""mode: cilium-kpr (issue 19): the policy's settings and their validation, and the facts callers ask instead
of comparing the mode's name (no kube-proxy, the replacement label, what Cilium needs and owns)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from proxyshift.api.policy import (
    CILIUM_CONNTRACK_MESSAGE,
    CILIUM_NODE_PORT_MESSAGE,
    DEFAULT_CILIUM_SOCKET,
    SOCKET_PATH_MESSAGE,
    ProxyPolicySpec,
)
from proxyshift.modes import (
    KUBE_PROXY_MODES,
    MODE_FACTS,
    MODES,
    replacement_labels,
    runs_kube_proxy,
)
from proxyshift.modes.cilium_kpr import CILIUM_DEVICES, REPLACEMENT_LABEL

pytestmark = pytest.mark.unit

LABEL_KEY = "proxyshift.io/kube-proxy-replacement"


def spec(**fields: Any) -> ProxyPolicySpec:
    return ProxyPolicySpec.model_validate({"nodeSelector": {}, "mode": "cilium-kpr", **fields})


def refusal(**fields: Any) -> list[str]:
    with pytest.raises(ValidationError) as info:
        spec(**fields)
    return [e["msg"].removeprefix("Value error, ") for e in info.value.errors()]


def test_a_cilium_kpr_policy_and_its_defaults() -> None:
    plain = spec()
    assert plain.cilium is None and plain.scheduler is None
    full = spec(cilium={"socketPath": "/run/cilium/cilium.sock", "loadBalancerAlgorithm": "maglev",
                        "hostNamespaceOnly": True},
                nodePortAddresses=["198.18.0.0/15", "fd00::/8"])
    assert full.cilium is not None
    assert (full.cilium.socket_path, full.cilium.load_balancer_algorithm, full.cilium.host_namespace_only) == (
        "/run/cilium/cilium.sock", "maglev", True)
    defaulted = spec(cilium={}).cilium
    assert defaulted is not None and defaulted.socket_path == DEFAULT_CILIUM_SOCKET


def test_what_a_cilium_kpr_policy_may_not_say() -> None:
    assert refusal(conntrack={"tcpBeLiberal": True}) == [CILIUM_CONNTRACK_MESSAGE]
    for keyword in ("primary", "localhost", "all"):
        assert refusal(nodePortAddresses=["198.18.0.0/16", keyword]) == [CILIUM_NODE_PORT_MESSAGE]
    assert refusal(nftables={"syncPeriod": "30s"}) == ["nftables settings are only allowed with mode: nftables"]
    with pytest.raises(ValidationError, match="cilium settings are only allowed with mode: cilium-kpr"):
        ProxyPolicySpec.model_validate({"nodeSelector": {}, "mode": "iptables", "cilium": {}})
    assert refusal(cilium={"loadBalancerAlgorithm": "rr"}) == ["Input should be 'random' or 'maglev'"]
    assert refusal(cilium={"socketPath": "/" + "a" * 107})[0].startswith("String should have at most 107")


SEGMENT = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)


@given(st.lists(SEGMENT, min_size=1, max_size=6))
def test_a_socket_path_is_accepted_exactly_when_absolute_and_without_dot_dot(segments: list[str]) -> None:
    path = "/" + "/".join(segments)
    ok = ".." not in segments and len(path) <= 107
    if ok:
        accepted = spec(cilium={"socketPath": path}).cilium
        assert accepted is not None and accepted.socket_path == path
    else:
        assert refusal(cilium={"socketPath": path})
    # A relative path is never a socket the agent may dial.
    assert SOCKET_PATH_MESSAGE in refusal(cilium={"socketPath": path.lstrip("/")})


def test_only_cilium_kpr_runs_without_kube_proxy() -> None:
    assert KUBE_PROXY_MODES == ("iptables", "ipvs", "nftables")
    assert [m for m in MODES if not runs_kube_proxy(m)] == ["cilium-kpr"]
    # A mode this version does not know was a kube-proxy's: the node keeps kube-proxy.
    assert runs_kube_proxy("userspace") and runs_kube_proxy(None)


def test_the_replacement_label_is_set_for_cilium_kpr_and_removed_for_every_other_mode() -> None:
    assert REPLACEMENT_LABEL == (LABEL_KEY, "cilium")
    assert replacement_labels("cilium-kpr") == {LABEL_KEY: "cilium"}
    for mode in (*KUBE_PROXY_MODES, "userspace", None):
        assert replacement_labels(mode) == {LABEL_KEY: None}


def test_what_cilium_kpr_needs_and_owns() -> None:
    facts = MODE_FACTS["cilium-kpr"]
    assert facts.tools == () and facts.held_as is None and facts.replacement is not None
    assert facts.replacement.default_socket == "/var/run/cilium/cilium.sock"
    assert {f.feature for f in facts.features} == {"cgroup2", "bpffs", "btf"}
    assert facts.min_kernel == (5, 10)
    assert facts.owned.devices == CILIUM_DEVICES == ("cilium_host", "cilium_net")
    # Its chains are Cilium's exact names (and their OLD_ copies), never a KUBE- name of kube-proxy or kubelet.
    assert ("filter", "CILIUM_INPUT") in facts.owned.chains and ("nat", "OLD_CILIUM_POST_nat") in facts.owned.chains
    assert all(chain.startswith(("CILIUM_", "OLD_CILIUM_")) for _, chain in facts.owned.chains)
    assert not facts.owned.nft_tables and not facts.owned.ipsets and facts.owned.interface is None
    assert facts.objects == ("iptables-chains", "replacement-devices", "bpf-attachments")
    # Its pins: only its own bpffs folder, links under "links"/"plugin_links"; its legacy tc filters by program name.
    assert facts.owned.bpffs_dir == "cilium" and facts.owned.bpffs_link_dirs == {"links", "plugin_links"}
    assert {"cil_from_netdev", "cil_to_netdev", "cil_from_host", "cil_to_host"} <= facts.owned.tc_filter_programs
    assert all(p.startswith("cil_") for p in facts.owned.tc_filter_programs)
    assert facts.socket_lb and not any(MODE_FACTS[m].socket_lb for m in KUBE_PROXY_MODES)
    # Devices and chain prefixes are names no kube-proxy mode uses.
    for mode in KUBE_PROXY_MODES:
        owned = MODE_FACTS[mode].owned
        assert not owned.devices and owned.bpffs_dir is None and not owned.tc_filter_programs
        assert not any(re.match(r"(OLD_)?CILIUM_", c) for _, c in owned.chains)


def test_the_frontends_cilium_must_hold_are_every_dialable_clusterip_port() -> None:
    from proxyshift.planner.services import ServicePortView, ServiceView, cluster_ip_frontends

    services = [
        ServiceView("default", "web", cluster_ips=("198.19.0.10",), ports=(ServicePortView("http", "TCP", 80),
                                                                          ServicePortView("dns", "UDP", 53))),
        ServiceView("default", "dual", cluster_ips=("198.19.0.11", "fd00::b"),
                    ports=(ServicePortView("", "TCP", 443),)),
        ServiceView("default", "db", headless=True, ports=(ServicePortView("", "TCP", 5432),)),
        ServiceView("default", "ext", type="ExternalName", ports=(ServicePortView("", "TCP", 80),)),
        ServiceView("other", "web", cluster_ips=("198.19.0.10",), ports=(ServicePortView("http", "TCP", 80),)),
    ]
    assert cluster_ip_frontends(services) == ["198.19.0.10:53/UDP", "198.19.0.10:80/TCP", "198.19.0.11:443/TCP",
                                              "[fd00::b]:443/TCP"]


def _node_tree(root: Path, *, release: str, filesystems: list[str], btf: bool) -> tuple[Path, Path]:
    proc, sys = root / "proc", root / "sys"
    (proc / "sys" / "kernel").mkdir(parents=True)
    (proc / "sys" / "kernel" / "osrelease").write_text(release + "\n")
    (proc / "filesystems").write_text("".join(f"nodev\t{kind}\n" for kind in filesystems) + "\text4\n")
    # What the agent's own container has mounted says nothing: Cilium mounts cgroup2 and bpffs itself.
    (proc / "mounts").write_text("overlay / overlay rw 0 0\n")
    (sys / "module").mkdir(parents=True)
    if btf:
        (sys / "kernel" / "btf").mkdir(parents=True)
        (sys / "kernel" / "btf" / "vmlinux").write_bytes(b"\x9f\xeb")
    return proc, sys


def test_preflight_for_cilium_kpr_checks_the_kernel_it_needs(tmp_path: Path) -> None:
    from proxyshift.agent.preflight import ToolVersions, check

    proc, sys = _node_tree(tmp_path / "good", release="6.1.0-41-amd64", filesystems=["cgroup2", "bpf", "proc"],
                           btf=True)
    good = check("cilium-kpr", proc_root=proc, sys_root=sys, modules_root=tmp_path, tools=ToolVersions())
    assert good.ok, good.message()
    assert good.message().startswith("preflight for cilium-kpr passed on kernel 6.1.0-41-amd64")
    proc, sys = _node_tree(tmp_path / "bad", release="5.4.0-200-generic", filesystems=["cgroup", "proc"], btf=False)
    bad = check("cilium-kpr", proc_root=proc, sys_root=sys, modules_root=tmp_path, tools=ToolVersions())
    assert [m.what for m in bad.missing] == ["kernel >= 5.10", "kernel cgroup v2 support", "the BPF filesystem",
                                             "kernel BTF (/sys/kernel/btf/vmlinux)"]
    assert "Cilium's kube-proxy replacement needs kernel 5.10 or newer" in bad.message()
