"""Inventory and leftovers from recorded tool output (no host tools)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.inventory import (
    MAX_DUMMY_ADDRESSES,
    leftover_objects,
    leftovers,
    mode_objects,
    take_inventory,
)
from proxyshift.agent.ip_addr import MAX_IP_JSON_BYTES, addresses
from proxyshift.commands import CommandError, Result

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SAVE = (FIX / "iptables" / "iptables-mode-20-services-with-user-rules.save.txt").read_text()
NFT = (FIX / "nft" / "list-tables.json").read_text()


def fake(outputs: dict[str, str]) -> Callable[..., Result]:
    def runner(argv: Sequence[str], **_: Any) -> Result:
        key = " ".join(argv)
        for prefix, out in outputs.items():
            if key.startswith(prefix):
                if out == "!missing-device":
                    raise CommandError(list(argv), 'exited 1: Device "kube-ipvs0" does not exist.',
                                       stderr='Device "kube-ipvs0" does not exist.')
                return Result(list(argv), 0, out, "")
        return Result(list(argv), 0, "", "")
    return runner


def test_iptables_node_after_a_switch_to_nftables(tmp_path: Path) -> None:
    runner = fake({"iptables-nft-save": SAVE, "nft -j list tables": NFT, "ip -j addr show dev": "!missing-device"})
    inv = take_inventory(runner=runner, iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path)
    assert not inv.errors
    assert inv.nft_tables == [("ip", "kube-proxy")]
    by_mode = {o.mode: o for o in mode_objects(inv, "nftables")}
    assert by_mode["iptables"].count > 50 and "nat" in by_mode["iptables"].summary
    # The chains ipvs shares with iptables are not evidence that ipvs ever ran here.
    assert "ipvs" not in by_mode
    assert by_mode["nftables"].count == 1
    assert leftovers(inv, "nftables") == ["iptables"]
    # Seen from iptables mode, shared chains are not ipvs leftovers; the nft table is.
    assert leftovers(inv, "iptables") == ["nftables"]
    assert leftovers(inv, None) == []


def test_clean_node_has_no_objects(tmp_path: Path) -> None:
    inv = take_inventory(runner=fake({"ip -j addr show dev": "!missing-device"}),
                         iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path)
    assert mode_objects(inv) == [] and leftovers(inv, "iptables") == []


def test_ipvs_node_shared_chains_count_for_ipvs_and_iptables_leftovers_are_only_its_own(tmp_path: Path) -> None:
    save = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
COMMIT
"""
    runner = fake({"iptables-nft-save": save, "ip -j addr show dev": "!missing-device",
                   "ipset save": "create KUBE-CLUSTER-IP hash:ip,port family inet\n"})
    inv = take_inventory(runner=runner, iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path)
    by_mode = {o.mode: o.count for o in mode_objects(inv, "ipvs")}
    assert by_mode == {"iptables": 2, "ipvs": 3}
    assert leftovers(inv, "ipvs") == ["iptables"]
    assert leftovers(inv, "iptables") == ["ipvs"]
    # The count kubectl shows: only stale objects, never the ones the observed mode shares.
    assert leftover_objects(inv, "ipvs") == 1  # KUBE-SVC-*; KUBE-SERVICES is ipvs mode's own too
    assert leftover_objects(inv, "iptables") == 2  # KUBE-NODE-PORT and the ipset; not the shared KUBE-SERVICES
    assert leftover_objects(inv, None) == 0


# ---- kube-ipvs0's addresses ----

KUBE_IPVS0 = (FIX / "ip" / "kube-ipvs0-addr.json").read_text()  # recorded in the QEMU guest: fixtures/ip/README.md
KUBE_IPVS0_ADDRESSES = ["198.19.0.10", "198.19.0.11", "203.0.113.7", "fd00:10:96::a"]


def test_the_addresses_are_parsed_from_the_recorded_ip_json() -> None:
    assert addresses(KUBE_IPVS0) == KUBE_IPVS0_ADDRESSES
    assert addresses("") == [] and addresses('[{"ifname":"kube-ipvs0","addr_info":[]}]') == []
    # Entries that are not addresses are left out; a newer ip may print more kinds.
    assert addresses('[{"addr_info":[{"local":"not-an-ip"},{"local":7},"x",{"family":"inet"}]}, 3]') == []
    for bad, words in (('{"ifname":"kube-ipvs0"}', "not print a list"), ("[{", "Expecting"),
                       (" " * (MAX_IP_JSON_BYTES + 1), "more than")):
        with pytest.raises(ValueError, match=words):
            addresses(bad)


def test_the_inventory_lists_and_counts_kube_ipvs0s_addresses(tmp_path: Path) -> None:
    runner = fake({"ip -j addr show dev": KUBE_IPVS0,
                   "ipset save": "create KUBE-CLUSTER-IP hash:ip,port family inet\n"})
    inv = take_inventory(runner=runner, iptables_tools=[], proc_root=tmp_path)
    assert not inv.errors and inv.dummy_interface
    assert inv.dummy_addresses == KUBE_IPVS0_ADDRESSES and inv.dummy_address_count == 4
    (ipvs,) = mode_objects(inv, "nftables")
    # The interface, its four addresses and the ipset: what the status's objects and leftovers count.
    assert (ipvs.mode, ipvs.count) == ("ipvs", 1 + 4 + 1)
    assert ipvs.summary == "kube-ipvs0 with 4 addresses; 1 ipsets"
    assert leftover_objects(inv, "nftables") == 6


def test_the_address_list_is_bounded_and_the_count_is_not(tmp_path: Path) -> None:
    n = MAX_DUMMY_ADDRESSES + 100
    addrs = ",".join(f'{{"family":"inet","local":"{ipaddress.IPv4Address("198.19.0.0") + i}","prefixlen":32}}'
                     for i in reversed(range(n)))
    runner = fake({"ip -j addr show dev": f'[{{"ifname":"kube-ipvs0","addr_info":[{addrs}]}}]'})
    inv = take_inventory(runner=runner, iptables_tools=[], proc_root=tmp_path)
    assert inv.dummy_address_count == n and len(inv.dummy_addresses) == MAX_DUMMY_ADDRESSES
    assert inv.dummy_addresses[:2] == ["198.19.0.0", "198.19.0.1"]  # sorted, whatever order ip printed
    assert inv.count("ipvs") == 1 + n


def test_unreadable_addresses_are_an_inventory_error_not_a_crash(tmp_path: Path) -> None:
    inv = take_inventory(runner=fake({"ip -j addr show dev": "[{not json"}), iptables_tools=[], proc_root=tmp_path)
    assert inv.dummy_interface and inv.dummy_address_count == 0
    assert len(inv.errors) == 1 and inv.errors[0].startswith("ip: kube-ipvs0: ")


def test_a_fresh_read_of_one_tool_is_taken_instead_of_its_save_and_every_other_tool_is_read() -> None:
    from proxyshift.agent.iptables_save import parse

    asked: list[str] = []
    inner = fake({"ip6tables-nft-save": SAVE, "nft -j list tables": NFT, "ip -j addr show dev": "!missing-device"})

    def runner(argv: Sequence[str], **kw: Any) -> Result:
        asked.append(argv[0])
        return inner(argv, **kw)

    v4, v6 = IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")
    inv = take_inventory(runner=runner, iptables_tools=[v4, v6], proc_root=Path("/nonexistent"),
                         fresh={v4.label: parse(SAVE)})
    assert "iptables-nft-save" not in asked and "ip6tables-nft-save" in asked and "nft" in asked
    assert [c.label for c in inv.iptables] == [v4.label, v6.label]
    assert inv.iptables[0].chains == inv.iptables[1].chains and not inv.errors
