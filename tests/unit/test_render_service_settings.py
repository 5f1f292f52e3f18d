"""Rendering of the Service-behaviour settings: nodePortAddresses, conntrack, nftables localhost NodePorts."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import NFTABLES_LOCALHOST_GATE, NODE_PORT_ADDRESS_PATTERN, ProxyPolicy
from proxyshift.render.kubeproxyconfig import baseline_config, config_hash, render_config

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CM = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-configmap.yaml").read_text())
BASELINE = baseline_config(CM)


def rendered(spec: dict[str, Any], baseline: KubeProxyConfiguration = BASELINE) -> dict[str, Any]:
    policy = ProxyPolicy.model_validate({"metadata": {"name": "p"}, "spec": {"nodeSelector": {}, **spec}})
    return render_config(policy.spec, baseline).to_dict()


@pytest.mark.parametrize("mode", ["iptables", "ipvs", "nftables"])
def test_node_port_addresses_rendered_at_top_level_in_every_mode(mode: str) -> None:
    config = rendered({"mode": mode, "nodePortAddresses": ["primary", "198.18.0.0/16"]})
    assert config["nodePortAddresses"] == ["primary", "198.18.0.0/16"]
    assert "nodePortAddresses" not in (config.get(mode) or {})


def test_unset_node_port_addresses_keeps_the_baselines_value() -> None:
    assert rendered({"mode": "nftables"})["nodePortAddresses"] is None  # kubeadm writes an explicit null
    baseline = BASELINE.model_copy(update={"node_port_addresses": ["0.0.0.0/0"]}, deep=True)
    assert rendered({"mode": "nftables"}, baseline)["nodePortAddresses"] == ["0.0.0.0/0"]
    assert rendered({"mode": "nftables", "nodePortAddresses": ["primary"]}, baseline)["nodePortAddresses"] == [
        "primary"]


def test_tcp_be_liberal_rendered_and_other_conntrack_fields_kept() -> None:
    before = BASELINE.to_dict()["conntrack"]
    config = rendered({"mode": "nftables", "conntrack": {"tcpBeLiberal": True}})
    assert config["conntrack"]["tcpBeLiberal"] is True
    assert {k: v for k, v in config["conntrack"].items() if k != "tcpBeLiberal"} == {
        k: v for k, v in before.items() if k != "tcpBeLiberal"}
    # Unset in the policy: the baseline's own value (kubeadm: false) stays.
    assert rendered({"mode": "nftables", "conntrack": {}})["conntrack"]["tcpBeLiberal"] is False


def test_nftables_localhost_node_ports_is_a_feature_gate() -> None:
    config = rendered({"mode": "nftables", "nodePortAddresses": ["primary", "localhost"],
                       "nftables": {"localhostNodePorts": True, "syncPeriod": "30s"}})
    assert config["featureGates"] == {NFTABLES_LOCALHOST_GATE: True}
    assert "localhostNodePorts" not in config["nftables"]
    assert config["nftables"]["syncPeriod"] == "30s"


def test_feature_gate_merges_with_the_baselines_gates() -> None:
    baseline = BASELINE.model_copy(update={"feature_gates": {"SomeOtherGate": False}}, deep=True)
    config = rendered({"mode": "nftables", "nodePortAddresses": ["127.0.0.0/8"],
                       "nftables": {"localhostNodePorts": True}}, baseline)
    assert config["featureGates"] == {"SomeOtherGate": False, NFTABLES_LOCALHOST_GATE: True}
    assert baseline.feature_gates == {"SomeOtherGate": False}  # the baseline is not modified


def test_nftables_localhost_needs_loopback_in_node_port_addresses() -> None:
    with pytest.raises(ValueError, match="needs nodePortAddresses to name loopback"):
        rendered({"mode": "nftables", "nftables": {"localhostNodePorts": True}})
    with pytest.raises(ValueError, match="needs nodePortAddresses to name loopback"):
        rendered({"mode": "nftables", "nodePortAddresses": ["0.0.0.0/0"], "nftables": {"localhostNodePorts": True}})
    # Turning it off needs nothing.
    assert rendered({"mode": "nftables", "nftables": {"localhostNodePorts": False}})["featureGates"] == {
        NFTABLES_LOCALHOST_GATE: False}


def test_the_hash_changes_with_each_setting() -> None:
    def hash_of(spec: dict[str, Any]) -> str:
        policy = ProxyPolicy.model_validate({"metadata": {"name": "p"}, "spec": {"nodeSelector": {}, **spec}})
        return config_hash(render_config(policy.spec, BASELINE))

    hashes = {
        hash_of({"mode": "nftables"}),
        hash_of({"mode": "nftables", "nodePortAddresses": ["primary"]}),
        hash_of({"mode": "nftables", "nodePortAddresses": ["primary", "localhost"]}),
        hash_of({"mode": "nftables", "conntrack": {"tcpBeLiberal": True}}),
        hash_of({"mode": "nftables", "nodePortAddresses": ["primary", "localhost"],
                 "nftables": {"localhostNodePorts": True}}),
    }
    assert len(hashes) == 5
    # The behaviour gate settings are the operator's, not kube-proxy's: they never move a node.
    assert hash_of({"mode": "nftables"}) == hash_of(
        {"mode": "nftables", "gate": {"behaviour": {"allowChanges": ["LocalhostNodePorts"], "samplePerKind": 4}}})


IPV4_CIDRS = st.builds(lambda a, p: f"{ipaddress.IPv4Address(a)}/{p}", st.integers(0, 2**32 - 1), st.integers(0, 32))
IPV6_CIDRS = st.builds(lambda a, p: f"{ipaddress.IPv6Address(a).compressed}/{p}",
                       st.integers(0, 2**128 - 1), st.integers(0, 128))
ADDRESSES = st.lists(st.one_of(st.sampled_from(["primary", "localhost", "all"]), IPV4_CIDRS, IPV6_CIDRS),
                     max_size=16, unique=True)


@settings(max_examples=150, deadline=None)
@given(addresses=ADDRESSES, mode=st.sampled_from(["iptables", "ipvs", "nftables"]))
def test_any_valid_list_is_accepted_and_rendered_verbatim(addresses: list[str], mode: str) -> None:
    config = rendered({"mode": mode, "nodePortAddresses": addresses})
    assert config["nodePortAddresses"] == addresses
    # Everything else is what the same policy renders without the list.
    without = rendered({"mode": mode})
    assert {k: v for k, v in config.items() if k != "nodePortAddresses"} == {
        k: v for k, v in without.items() if k != "nodePortAddresses"}


@settings(max_examples=150, deadline=None)
@given(addresses=ADDRESSES)
def test_any_valid_list_matches_the_crd_pattern(addresses: list[str]) -> None:
    assert all(re.match(NODE_PORT_ADDRESS_PATTERN, a) for a in addresses)
