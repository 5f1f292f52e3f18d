"""Inventory on real tools in a fresh namespace: objects per mode and leftovers."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.inventory import leftovers, mode_objects, take_inventory
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, nftables_mode_ruleset, user_rules
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane
TOOLS = [IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")]


def test_inventory_after_a_switch_from_iptables_to_nftables_and_after_the_cleanup(netns: Netns, tmp_path: Path) -> None:
    before, after = user_rules()
    netns.restore(kubelet_rules())
    netns.restore(before)
    netns.restore(iptables_mode_rules(100))
    netns.restore(after)
    netns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(100))

    inv = take_inventory(runner=netns.run, iptables_tools=TOOLS, proc_root=tmp_path)
    assert not inv.errors
    objects = {o.mode: o.count for o in mode_objects(inv, "nftables")}
    assert objects["nftables"] == 1 and objects["iptables"] > 200 and "ipvs" not in objects
    assert leftovers(inv, "nftables") == ["iptables"]

    assert flush(leftovers(inv, "nftables"), "nftables", runner=netns.run, iptables_tools=TOOLS).ok
    inv = take_inventory(runner=netns.run, iptables_tools=TOOLS, proc_root=tmp_path)
    assert leftovers(inv, "nftables") == []
    assert {o.mode for o in mode_objects(inv, "nftables")} == {"nftables"}
