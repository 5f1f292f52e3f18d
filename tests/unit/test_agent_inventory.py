"""Inventory and leftovers from recorded tool output (no host tools)."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_agent_flush_plan import FakeNode as IpvsNode

from proxyshift.agent import inventory as inventory_mod
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.inventory import (
    MAX_DUMMY_ADDRESSES,
    Inventory,
    _merged,
    _Part,
    leftover_objects,
    leftovers,
    mode_objects,
    take_inventory,
    take_ipvs_inventory,
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


# ---- the readers' parts, merged ----

def test_a_field_a_part_read_as_its_default_is_kept() -> None:
    filled = frozenset({"ipvs_available", "dummy_interface", "dummy_address_count", "bpf_link_pins", "errors"})
    first = _Part(Inventory(ipvs_available=True, dummy_interface=True, dummy_address_count=3, bpf_link_pins=2,
                            errors=["first"]), filled)
    # No IPVS, no kube-ipvs0, no pins: read, and each the default. A value is no sign of whether it was read.
    later = _Part(Inventory(errors=["later"]), filled)
    assert _merged([first, later]) == Inventory(errors=["first", "later"])
    # The parts' order decides, not their values; lists are joined in that order.
    assert _merged([later, first]) == dataclasses.replace(first.inventory, errors=["later", "first"])
    # A field a part did not fill is not taken from it, whatever it holds.
    assert _merged([_Part(Inventory(ipvs_available=True, nft_tables=[("ip", "kube-proxy")]),
                          frozenset({"errors"}))]) == Inventory()


def test_every_field_a_reader_fills_reaches_the_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with something of every kind: no field of the merged inventory is left at its default, so each
    reader names every field it fills (a field it fills but does not name would be dropped by the merge)."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")
    bpffs = tmp_path / "bpffs"
    (bpffs / "cilium" / "socketlb" / "links" / "cgroup").mkdir(parents=True)
    (bpffs / "cilium" / "socketlb" / "links" / "cgroup" / "cil_sock4_connect").write_text("")
    monkeypatch.setattr(inventory_mod, "is_bpffs", lambda path, mountinfo: path == bpffs)
    ipvs_node = IpvsNode()

    def runner(argv: Sequence[str], **kw: Any) -> Result:
        text = {"iptables-nft-save": SAVE, "nft -j list tables": NFT,
                "ip -j link show": '[{"ifname":"lo"},{"ifname":"cilium_host"},{"ifname":"cilium_net"}]'}.get(
                    " ".join(argv))
        return Result(list(argv), 0, text, "") if text is not None else ipvs_node(argv, **kw)

    merged = take_inventory(runner=runner, iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path,
                            bpffs=bpffs)
    ipvs_only = take_ipvs_inventory(runner=runner, proc_root=tmp_path)
    assert not merged.errors and not ipvs_only.errors
    empty = Inventory()
    left = {f.name for f in dataclasses.fields(Inventory) if getattr(merged, f.name) == getattr(empty, f.name)}
    # The devices are read by take_ipvs_inventory alone (preflight's); the errors are empty on this node.
    assert left == {"replacement_devices", "errors"}
    assert ipvs_only.replacement_devices == ["cilium_host", "cilium_net"]
    assert ipvs_only.kube_virtual_servers == merged.kube_virtual_servers and ipvs_only.ipsets == merged.ipsets
