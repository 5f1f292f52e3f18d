"""The per-mode facts (proxyshift.modes): one registry keyed by Mode, read by both preflight and the plan."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import product
from pathlib import Path
from typing import get_args

import pytest
from test_plan_compat import policy

from proxyshift.agent import preflight
from proxyshift.agent.preflight import ToolVersions, check
from proxyshift.api.proxynode import Mode, ProxyNode
from proxyshift.modes import MODE_FACTS, MODES, startup_cleanup_drops_old_rules
from proxyshift.planner.preview import predict_preflight

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def test_every_mode_has_exactly_one_facts_entry() -> None:
    assert get_args(Mode) == MODES
    assert set(MODE_FACTS) == set(MODES)
    assert all(facts.mode == mode for mode, facts in MODE_FACTS.items())


def test_every_tool_a_mode_needs_has_a_node_check() -> None:
    needed = {need.tool for facts in MODE_FACTS.values() for need in facts.tools}
    assert needed <= set(preflight._TOOL_CHECKS)


def test_startup_cleanup_is_iptables_and_nftables_both_ways_only() -> None:
    pairs = {(a, b) for a, b in product([*MODES, None, "bogus"], repeat=2) if startup_cleanup_drops_old_rules(a, b)}
    assert pairs == {("iptables", "nftables"), ("nftables", "iptables")}


def _node(tools: dict[str, str], modules: list[str]) -> ProxyNode:
    return ProxyNode.model_validate({"metadata": {"name": "n1"}, "status": {
        "kernelRelease": "6.8.0", "modules": modules, "tools": tools,
        "heartbeat": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}})


def _node_check(mode: str, tools: ToolVersions) -> preflight.PreflightReport:
    return check(mode, proc_root=FIX / "proc" / "ipvs-builtin", sys_root=FIX / "sys" / "ipvs-builtin",
                 modules_root=FIX / "sys" / "ipvs-builtin" / "lib-modules", tools=tools)


@pytest.mark.parametrize(("tools", "predicted", "refused"), [
    # ipvs mode programs its chains with iptables-restore: the plan now predicts what the node refuses.
    ({"ipset": "7.17"}, "iptables not found (ipvs mode needs it)", "iptables binary"),
    ({"ipset": "5.4", "iptables": "1.8.9"}, "ipset 5.4: ipvs mode needs ipset >= 6.0", "ipset >= 6.0"),
    ({"iptables": "1.8.9"}, "ipset not found: ipvs mode needs ipset >= 6.0", "ipset binary"),
])
def test_plan_and_preflight_read_the_same_ipvs_tool_requirements(tools: dict[str, str], predicted: str,
                                                                 refused: str) -> None:
    p = policy(mode="ipvs")
    assert predicted in predict_preflight(_node(tools, ["ip_vs", "ip_vs_rr", "nf_conntrack"]), p)
    report = _node_check("ipvs", ToolVersions(iptables=tools.get("iptables"), iptables_nat=True,
                                              ipset=tools.get("ipset")))
    assert refused in [m.what for m in report.missing]


def test_a_node_with_every_ipvs_tool_passes_both() -> None:
    tools = {"ipset": "7.17", "iptables": "1.8.9"}
    assert predict_preflight(_node(tools, ["ip_vs", "ip_vs_rr", "nf_conntrack"]), policy(mode="ipvs")) == []
    report = _node_check("ipvs", ToolVersions(iptables="1.8.9", iptables_nat=True, ipset="7.17"))
    assert not [m for m in report.missing if not m.what.startswith("kernel module")]


def test_ipvs_set_names_are_kube_proxys_including_its_cut_ipv6_names() -> None:
    """kube-proxy cuts an IPv6 set name to the kernel's 31 characters (v1.37 pkg/proxy/ipvs/ipset.go NewIPSet);
    the flush must know the cut names, or they stay behind (seen on a real ipvs -> nftables move in the guest:
    kube-proxy's own cleanup destroys only the IPv4 names)."""
    from proxyshift.agent.ownership import is_kube_proxy_ipset
    from proxyshift.modes.ipvs import IPSET_MAX_NAME, IPVS_IPSETS

    assert all(len(name) <= IPSET_MAX_NAME for name in IPVS_IPSETS)
    for cut in ("KUBE-6-LOAD-BALANCER-SOURCE-CID", "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"):
        assert cut in IPVS_IPSETS and is_kube_proxy_ipset(cut)
    assert "KUBE-6-LOAD-BALANCER-SOURCE-IP" in IPVS_IPSETS and "KUBE-LOAD-BALANCER-SOURCE-CIDR" in IPVS_IPSETS
    assert not is_kube_proxy_ipset("KUBE-6-LOAD-BALANCER-SOURCE-CIDR"), "a name kube-proxy cannot create"
