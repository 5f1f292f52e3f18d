"""The iptables flush on real iptables in fresh namespaces: kube-proxy's objects go, the user's stay.

"Byte for byte" is checked against a reference namespace that received exactly
the same user and kubelet rules in the same order but never any of
kube-proxy's: after the flush both namespaces' iptables-save texts must be
identical (headers with timestamps aside).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.iptables_save import parse
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, user_rules
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

V4_NFT = [IptablesTool("ipv4", "nft")]
V6_NFT = [IptablesTool("ipv6", "nft")]
SHARED_WITH_IPVS = {("nat", "KUBE-SERVICES"), ("nat", "KUBE-POSTROUTING"), ("nat", "KUBE-MARK-MASQ"),
                    ("filter", "KUBE-FORWARD"), ("filter", "KUBE-PROXY-FIREWALL")}


def body(save_text: str) -> list[str]:
    """iptables-save output without its timestamped comment lines."""
    return [line for line in save_text.splitlines() if not line.startswith("#")]


def chains(save_text: str) -> set[tuple[str, str]]:
    dump = parse(save_text)
    return {(t.name, c) for t in dump.tables.values() for c in t.user_defined()}


def load_node(ns: Netns, services: int, *, v6: bool = False) -> None:
    before, after = user_rules(v6=v6)
    ns.restore(kubelet_rules(v6=v6), v6=v6)
    ns.restore(before, v6=v6)
    ns.restore(iptables_mode_rules(services, v6=v6), v6=v6)
    ns.restore(after, v6=v6)


def load_reference(ns: Netns, *, v6: bool = False) -> None:
    before, after = user_rules(v6=v6)
    ns.restore(kubelet_rules(v6=v6), v6=v6)
    ns.restore(before, v6=v6)
    ns.restore(after, v6=v6)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_flush_for_nftables_removes_every_kube_proxy_chain_and_keeps_user_rules_byte_for_byte(
        netns_factory: Callable[[], Netns], v6: bool) -> None:
    node, ref = netns_factory(), netns_factory()
    load_node(node, 1000, v6=v6)
    load_reference(ref, v6=v6)
    before = node.save(v6=v6)
    assert len([c for c in chains(before) if c[1].startswith("KUBE-SVC-")]) > 900

    report = flush(["iptables", "ipvs"], "nftables", runner=node.run, iptables_tools=V6_NFT if v6 else V4_NFT)

    assert report.ok, report.message()
    after = node.save(v6=v6)
    assert body(after) == body(ref.save(v6=v6))
    left = {c for c in chains(after) if c[1].startswith("KUBE-")}
    assert left == {("mangle", "KUBE-KUBELET-CANARY"), ("nat", "KUBE-KUBELET-CANARY"),
                    ("filter", "KUBE-KUBELET-CANARY"), ("filter", "KUBE-FIREWALL"), ("filter", "KUBE-MYAPP")}


def test_flush_is_idempotent(netns: Netns) -> None:
    load_node(netns, 200)
    first = flush(["iptables"], "nftables", runner=netns.run, iptables_tools=V4_NFT)
    after_first = body(netns.save())
    second = flush(["iptables"], "nftables", runner=netns.run, iptables_tools=V4_NFT)
    assert first.ok and second.ok
    assert first.total_removed() > 0
    assert second.total_removed() == 0
    assert body(netns.save()) == after_first


def test_flush_for_ipvs_keeps_the_chains_ipvs_shares(netns_factory: Callable[[], Netns]) -> None:
    node = netns_factory()
    load_node(node, 300)
    report = flush(["iptables"], "ipvs", runner=node.run, iptables_tools=V4_NFT)
    assert report.ok, report.message()
    after = node.save()
    kube = {c for c in chains(after) if c[1].startswith("KUBE-")}
    assert kube - {("mangle", "KUBE-KUBELET-CANARY"), ("nat", "KUBE-KUBELET-CANARY"),
                   ("filter", "KUBE-KUBELET-CANARY"), ("filter", "KUBE-FIREWALL"),
                   ("filter", "KUBE-MYAPP")} == SHARED_WITH_IPVS
    lines = body(after)
    # The jumps into shared chains and their own non-service rules stay for the ipvs kube-proxy.
    assert '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in lines
    assert any(line.startswith("-A KUBE-POSTROUTING") and "MASQUERADE" in line for line in lines)
    assert any(line.startswith("-A KUBE-MARK-MASQ") for line in lines)
    # ...but nothing in them points at a removed per-service chain any more.
    assert not [line for line in lines if "KUBE-SVC-" in line or "KUBE-SEP-" in line or "KUBE-NODEPORTS" in line]


def test_flush_leaves_a_node_without_kube_proxy_rules_untouched(netns_factory: Callable[[], Netns]) -> None:
    node, ref = netns_factory(), netns_factory()
    load_reference(node)
    load_reference(ref)
    report = flush(["iptables", "ipvs"], "nftables", runner=node.run, iptables_tools=V4_NFT)
    assert report.ok and report.total_removed() == 0
    assert body(node.save()) == body(ref.save())


@pytest.mark.parametrize("stale", [False, True], ids=["hold-only", "hold-and-stale"])
def test_one_round_removes_the_rule_hold_and_the_stale_chains_and_keeps_user_rules_byte_for_byte(
        netns_factory: Callable[[], Netns], stale: bool) -> None:
    from proxyshift.agent import hold

    node, ref = netns_factory(), netns_factory()
    for v6 in (False, True):
        load_node(node, 200, v6=v6)
        load_reference(ref, v6=v6)
    made = hold.install("iptables", runner=node.run, iptables_tools=V4_NFT + V6_NFT)
    assert made.ok and len(made.done) == 2, made.message()
    if not stale:  # what an nftables kube-proxy's start leaves: its cleanup took iptables mode's chains, not the hold
        assert flush(["iptables"], "nftables", runner=node.run, iptables_tools=V4_NFT + V6_NFT).ok

    flushed, released = hold.release_with_flush(["iptables"], "nftables", runner=node.run,
                                                iptables_tools=V4_NFT + V6_NFT)

    assert flushed.ok and released.ok, (flushed.message(), released.message())
    assert [line.split(":")[0] for line in released.done] == [t.label for t in V4_NFT + V6_NFT]
    assert all(bool(s.removed) == stale for s in flushed.steps)
    for v6 in (False, True):
        assert body(node.save(v6=v6)) == body(ref.save(v6=v6))
        assert set(flushed.after) == {t.label for t in V4_NFT + V6_NFT}
    assert not hold.present(runner=node.run, iptables_tools=V4_NFT + V6_NFT)
