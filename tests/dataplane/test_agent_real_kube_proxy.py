"""Against the real kube-proxy binary (fed by fake_apiserver.py) in fresh namespaces.

The agent's probe reads a real kube-proxy, and the flush removes the rules a
real kube-proxy wrote (not synthetic ones), leaving the user's and kubelet's
rules byte for byte, in both iptables families and in nftables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.nftables import list_tables
from proxyshift.agent.inventory import leftovers, take_inventory
from proxyshift.planner.metrics import parse_kube_proxy_metrics
from tests.support.kp_rules import kubelet_rules, user_rules
from tests.support.kube_proxy_runner import KubeProxy, find_kube_proxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

TOOLS = [IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")]
USER_NFT = "table inet user-fw {\n\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n" \
           '\t\ttcp dport 22 accept comment "user: ssh"\n\t}\n}\n'


@pytest.fixture(autouse=True)
def _binary() -> None:
    if find_kube_proxy() is None:
        pytest.skip("no kube-proxy binary (build the local cluster or set PROXYSHIFT_KUBE_PROXY)")


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def load_user(ns: Netns, part: str) -> None:
    before, after = user_rules()
    if part == "before":
        ns.restore(kubelet_rules())
        ns.restore(before)
    else:
        ns.restore(after)


def test_probe_reads_a_real_iptables_kube_proxy_and_the_flush_removes_its_real_rules(
        netns_factory: Callable[[], Netns], tmp_path: Path) -> None:
    node, ref = netns_factory(), netns_factory()
    for ns in (node, ref):
        load_user(ns, "before")
    kp = KubeProxy(node, tmp_path / "kp", "iptables", services=30)
    try:
        answer = kp.wait_synced(1)
    finally:
        kp.stop()
    facts = answer["facts"]
    assert facts["proxyMode"] == "iptables" and facts["healthzStatus"] == 200 and facts["error"] is None
    assert facts["syncCount"] >= 1 and facts["lastSyncTimestamp"] >= facts["processStartTime"]
    assert parse_kube_proxy_metrics(answer["metrics"]).sync_count == facts["syncCount"]

    for ns in (node, ref):
        load_user(ns, "after")
    saved = node.save()
    assert sum(1 for line in saved.splitlines() if line.startswith(":KUBE-SVC-")) == 30
    inv = take_inventory(runner=node.run, iptables_tools=TOOLS, proc_root=tmp_path)
    assert leftovers(inv, "nftables") == ["iptables"]

    report = flush(["iptables", "ipvs"], "nftables", runner=node.run, iptables_tools=TOOLS)

    assert report.ok, report.message()
    assert body(node.save()) == body(ref.save())
    # kube-proxy also ran an IPv6 proxier. What remains there is the table skeletons and
    # KUBE-FIREWALL, which kube-proxy 1.37 creates too but which kubelet owns: left alone.
    v6 = body(node.save(v6=True))
    assert [line for line in v6 if line.startswith(":") and " - " in line] == [":KUBE-FIREWALL - [0:0]"]
    assert {line for line in v6 if line.startswith("-A")} == {"-A INPUT -j KUBE-FIREWALL",
                                                             "-A OUTPUT -j KUBE-FIREWALL"}


def test_probe_reads_a_real_nftables_kube_proxy_and_the_flush_removes_its_tables(netns: Netns, tmp_path: Path) -> None:
    netns.run(["nft", "-f", "-"], input=USER_NFT)
    user_before = netns.run(["nft", "list", "table", "inet", "user-fw"]).stdout
    kp = KubeProxy(netns, tmp_path / "kp", "nftables", services=30)
    try:
        answer = kp.wait_synced(1)
    finally:
        kp.stop()
    assert answer["facts"]["proxyMode"] == "nftables" and answer["facts"]["syncCount"] >= 1
    assert ("ip", "kube-proxy") in list_tables(netns.run)

    report = flush(["nftables"], "iptables", runner=netns.run, iptables_tools=TOOLS)

    assert report.ok, report.message()
    tables = list_tables(netns.run)
    assert ("ip", "kube-proxy") not in tables and ("ip6", "kube-proxy") not in tables
    assert netns.run(["nft", "list", "table", "inet", "user-fw"]).stdout == user_before


def test_real_kube_proxy_refuses_ipvs_here_exactly_when_preflight_does(netns: Netns, tmp_path: Path) -> None:
    import time

    from proxyshift.agent.preflight import check

    report = check("ipvs")
    kp = KubeProxy(netns, tmp_path / "kp", "ipvs", services=3)
    try:
        deadline = time.monotonic() + 60
        while kp.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        exited = kp.proc.poll()
    finally:
        kp.stop()
    log = (tmp_path / "kp" / "kube-proxy.log").read_text()
    if report.ok:
        pytest.skip("this kernel has IPVS: kube-proxy may run in ipvs mode")
    # kube-proxy has no fallback: it exits, and the preflight named why beforehand.
    assert exited not in (None, 0), log[-2000:]
    assert "ipvs" in log.lower()
    assert "ip_vs" in report.details()["missingModules"]
