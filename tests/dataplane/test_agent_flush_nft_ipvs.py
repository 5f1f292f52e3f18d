"""nftables and ipvs leftovers on real nft/ipset/ip in fresh namespaces, beside a user's own objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.nftables import list_tables
from proxyshift.commands import CommandError
from tests.support.kp_rules import ipvs_mode_ipsets, ipvs_mode_rules, nftables_mode_ruleset
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

USER_NFT = """\
table inet user-fw {
	set allowed {
		type ipv4_addr
		elements = { 198.18.5.1, 198.18.5.2 }
	}

	chain input {
		type filter hook input priority filter; policy accept;
		ip saddr @allowed tcp dport 22 accept comment "user: ssh"
	}
}
table ip kube-proxy-lookalike {
	chain c {
		ip daddr 198.18.9.9 drop
	}
}
"""


def nft_list(ns: Netns, family: str, name: str) -> str:
    return ns.run(["nft", "list", "table", family, name]).stdout


def test_nft_flush_removes_both_kube_proxy_tables_and_keeps_the_users(netns: Netns) -> None:
    netns.run(["nft", "-f", "-"], input=USER_NFT)
    user_before = {t: nft_list(netns, *t) for t in [("inet", "user-fw"), ("ip", "kube-proxy-lookalike")]}
    netns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(1000, family="ip"))
    netns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(100, family="ip6"))
    assert {("ip", "kube-proxy"), ("ip6", "kube-proxy")} <= set(list_tables(netns.run))

    report = flush(["nftables"], "iptables", runner=netns.run, iptables_tools=[])

    assert report.ok, report.message()
    assert report.steps[-1].removed == {"tables": 2}
    tables = set(list_tables(netns.run))
    assert ("ip", "kube-proxy") not in tables and ("ip6", "kube-proxy") not in tables
    assert {t: nft_list(netns, *t) for t in user_before} == user_before

    again = flush(["nftables"], "iptables", runner=netns.run, iptables_tools=[])
    assert again.ok and again.total_removed() == 0


def test_nft_flush_never_runs_when_nftables_is_the_target(netns: Netns) -> None:
    netns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(5))
    report = flush(["nftables", "iptables"], "nftables", runner=netns.run, iptables_tools=[])
    assert report.ok
    assert ("ip", "kube-proxy") in set(list_tables(netns.run))


def _ipset_names(ns: Netns) -> set[str]:
    return set(ns.run(["ipset", "list", "-n"]).stdout.split())


def test_ipvs_flush_without_ipvs_in_the_kernel_removes_sets_dummy_and_chains_but_no_user_objects(
        netns: Netns, tmp_path: Path) -> None:
    # Everything ipvs mode leaves besides virtual servers can exist without ip_vs.
    netns.run(["ipset", "restore"], input=ipvs_mode_ipsets())
    netns.run(["ipset", "create", "KUBE-ALLOWED", "hash:ip"])          # a user's set with a KUBE- name
    netns.run(["ipset", "create", "user-blocklist", "hash:net"])
    netns.restore(ipvs_mode_rules())
    netns.restore("*filter\n:USER-IN - [0:0]\n-A INPUT -m set --match-set user-blocklist src -j DROP\n"
                  "-A INPUT -j USER-IN\nCOMMIT\n")
    try:
        netns.run(["ip", "link", "add", "kube-ipvs0", "type", "dummy"])
        has_dummy = True
    except CommandError:
        has_dummy = False  # no dummy driver here; the rest still applies
    no_ipvs_proc = tmp_path  # a /proc without net/ip_vs, like this kernel's

    report = flush(["ipvs"], "iptables", runner=netns.run, iptables_tools=[IptablesTool("ipv4", "nft")],
                   proc_root=Path(no_ipvs_proc))

    assert report.ok, report.message()
    ipvs_step = next(s for s in report.steps if s.tool == "ipvs")
    assert any("no IPVS" in s for s in ipvs_step.skipped)
    assert _ipset_names(netns) == {"KUBE-ALLOWED", "user-blocklist"}
    save = netns.save()
    for gone in ("KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-IPVS-FILTER", "KUBE-SOURCE-RANGES-FIREWALL"):
        assert f":{gone} " not in save
    # Shared with the iptables target: kept, minus the rules that matched the destroyed sets.
    assert ":KUBE-SERVICES " in save and ":KUBE-POSTROUTING " in save
    assert "KUBE-CLUSTER-IP" not in save and "KUBE-LOOP-BACK" not in save
    assert "-A INPUT -m set --match-set user-blocklist src -j DROP" in save
    if has_dummy:
        links = netns.run(["ip", "-o", "link", "show"]).stdout
        assert "kube-ipvs0" not in links
        assert ipvs_step.removed.get("interfaces") == 1

    again = flush(["ipvs"], "iptables", runner=netns.run, iptables_tools=[IptablesTool("ipv4", "nft")],
                  proc_root=Path(no_ipvs_proc))
    assert again.ok and again.total_removed() == 0


def test_ipvs_flush_reports_a_kube_set_a_user_rule_still_uses(netns: Netns, tmp_path: Path) -> None:
    netns.run(["ipset", "restore"], input=ipvs_mode_ipsets())
    netns.restore("*filter\n-A INPUT -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n")
    report = flush(["ipvs"], "nftables", runner=netns.run, iptables_tools=[IptablesTool("ipv4", "nft")],
                   proc_root=tmp_path)
    assert not report.ok
    assert "KUBE-CLUSTER-IP" in report.message()
    assert "KUBE-CLUSTER-IP" in _ipset_names(netns)
    assert "KUBE-LOOP-BACK" not in _ipset_names(netns)
    # The user's rule is untouched.
    assert "-A INPUT -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT" in netns.save()
