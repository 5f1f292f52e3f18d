"""The flush of a kube-proxy replacement's BPF attachments (agent/flush/bpf.py): which pins are Cilium's (only its
own bpffs folder, links first), mountinfo and `tc -j` parsing, bounds; on a plain folder standing in for the
node's bpffs (a fake mountinfo names it bpf) and recorded tc output. tests/dataplane/test_cilium_kpr_bpf.py runs
it on the real agent's pins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.flush.bpf import BpfFlusher, bpffs_mounts, parse_tc_filters, plan_pins
from proxyshift.commands import CommandError, Result
from proxyshift.modes.cilium_kpr import CILIUM_LINK_DIRS, CILIUM_TC_PROGRAMS

pytestmark = pytest.mark.unit

# What the v1.20.2 agent pinned in the test bed's node bpffs (tests/dataplane/test_cilium_kpr_bpf.py), plus a pod
# endpoint's and a plugin's as on a real node.
CILIUM_PINS = ("socketlb/links/cgroup/cil_sock4_connect", "socketlb/links/cgroup/cil_sock4_sendmsg",
               "socketlb/links/cgroup/cil_sock4_recvmsg", "devices/eth0/links/cil_from_netdev",
               "devices/eth0/links/cil_to_netdev", "devices/cilium_host/links/cil_to_host",
               "endpoints/1234/links/cil_from_container", "devices/eth0/plugins/tc/pre_hook",
               "socketlb/plugin_links/cgroup/x")
# Beside it, never Cilium's folder: iproute2's tc/globals (Cilium's maps are there too) and a user's pins.
OTHERS = ("tc/globals/cilium_lb4_services_v2", "tc/globals/my_map", "mine/links/my_link", "cilium_mine/pin")


def mountinfo(*bpf_mounts: Path) -> str:
    lines = ["22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw",
             "40 22 0:33 / /sys/fs/bpf/other\\040dir rw - bpf bpf rw,mode=700"]
    lines += [f"{50 + i} 22 0:{40 + i} / {p} rw,relatime - bpf bpf rw,mode=700" for i, p in enumerate(bpf_mounts)]
    return "\n".join(lines) + "\n"


def make_tree(root: Path) -> None:
    for rel in (*(f"cilium/{p}" for p in CILIUM_PINS), *OTHERS):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


def flusher(root: Path, tmp_path: Path, runner: Any = None, **kw: Any) -> BpfFlusher:
    info = tmp_path / "mountinfo"
    info.write_text(mountinfo(root))
    return BpfFlusher(run=runner or NoTc(), bpffs=root, mountinfo=info, **kw)


class NoTc:
    """A node with eth0 and no legacy tc filter."""

    def __call__(self, argv: list[str], **_: Any) -> Result:
        if argv[:3] == ["ip", "-j", "link"]:
            return Result(argv, 0, json.dumps([{"ifname": "lo"}, {"ifname": "eth0"}]), "")
        if argv[:4] == ["tc", "-j", "filter", "show"]:
            return Result(argv, 0, "[]", "")
        raise AssertionError(f"unexpected command {argv}")


def test_mountinfo_names_only_bpf_mounts_with_escapes_decoded(tmp_path: Path) -> None:
    assert bpffs_mounts(mountinfo(tmp_path)) == {"/sys/fs/bpf/other dir", str(tmp_path)}
    assert bpffs_mounts("garbage\n\n1 2 3\n") == set()
    with pytest.raises(ValueError, match="larger than"):
        bpffs_mounts("x" * 20, max_bytes=10)


def test_the_plan_is_every_pin_under_ciliums_folder_links_first_socket_lb_first(tmp_path: Path) -> None:
    make_tree(tmp_path)
    (tmp_path / "cilium/devices/eth0/links/alias").symlink_to(tmp_path / "mine")  # removed as a link, not followed
    plan = plan_pins(tmp_path / "cilium", CILIUM_LINK_DIRS)
    rel = [str(p.relative_to(tmp_path / "cilium")) for p in plan.pins]
    assert set(rel) == {*CILIUM_PINS, "devices/eth0/links/alias"}
    # socket-LB's links, then every other link, then the other pins.
    assert rel[:4] == ["socketlb/links/cgroup/cil_sock4_connect", "socketlb/links/cgroup/cil_sock4_recvmsg",
                       "socketlb/links/cgroup/cil_sock4_sendmsg", "socketlb/plugin_links/cgroup/x"]
    assert rel[-1] == "devices/eth0/plugins/tc/pre_hook" and len(plan.links) == len(rel) - 1
    # Folders deepest first, Cilium's folder itself last; nothing outside it.
    assert plan.folders[-1] == tmp_path / "cilium"
    assert all(p.is_relative_to(tmp_path / "cilium") for p in [*plan.pins, *plan.folders])
    depths = [len(p.parts) for p in plan.folders]
    assert depths == sorted(depths, reverse=True)
    assert not plan.truncated and not plan.not_entered


def test_the_plan_is_bounded_and_empty_without_the_folder(tmp_path: Path) -> None:
    make_tree(tmp_path)
    plan = plan_pins(tmp_path / "cilium", CILIUM_LINK_DIRS, max_pins=3)
    assert plan.truncated and len(plan.pins) == 3
    assert plan_pins(tmp_path / "nothing", CILIUM_LINK_DIRS).pins == []
    (tmp_path / "file").write_text("")
    assert plan_pins(tmp_path / "file", CILIUM_LINK_DIRS).not_entered == [tmp_path / "file"]


def test_the_flush_removes_ciliums_folder_and_nothing_beside_it(tmp_path: Path) -> None:
    root = tmp_path / "bpffs"
    make_tree(root)
    steps = flusher(root, tmp_path).flush(frozenset({"cilium-kpr"}), "iptables")
    pins, tc = steps
    assert pins.tool == "bpffs" and not pins.errors, pins.describe()
    assert pins.removed["link pins"] == 8 and pins.removed["pins"] == 1 and pins.removed["folders"] >= 10
    assert not (root / "cilium").exists()
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(OTHERS)
    assert tc.tool == "tc" and tc.removed == {} and not tc.errors
    # Idempotent.
    again = flusher(root, tmp_path).flush(frozenset({"cilium-kpr"}), "iptables")
    assert all(s.removed == {} and not s.errors for s in again)


def test_a_dry_run_counts_and_changes_nothing(tmp_path: Path) -> None:
    make_tree(tmp_path)
    pins, _ = flusher(tmp_path, tmp_path / "cilium" / "..", dry_run=True).flush(frozenset({"cilium-kpr"}), None)
    assert pins.removed == {"link pins": 8, "pins": 1} and "dry run: nothing changed" in pins.skipped
    assert all((tmp_path / "cilium" / p).exists() for p in CILIUM_PINS)


def test_no_bpffs_mount_no_pin_touched_and_no_replacement_no_step(tmp_path: Path) -> None:
    make_tree(tmp_path)
    info = tmp_path / "mountinfo"
    info.write_text(mountinfo())  # tmp_path is no bpf mount
    pins, _ = BpfFlusher(run=NoTc(), bpffs=tmp_path, mountinfo=info).flush(frozenset({"cilium-kpr"}), None)
    assert pins.removed == {} and "is no BPF filesystem here" in pins.skipped[0]
    assert all((tmp_path / "cilium" / p).exists() for p in CILIUM_PINS)
    assert flusher(tmp_path, tmp_path).flush(frozenset({"iptables", "ipvs"}), "nftables") == []
    assert flusher(tmp_path, tmp_path).flush(frozenset({"cilium-kpr"}), "cilium-kpr") == []


def test_pins_that_cannot_go_are_errors_bounded_and_keep_their_folders(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path)

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    pins, _ = flusher(tmp_path, tmp_path).flush(frozenset({"cilium-kpr"}), None)
    assert pins.removed == {} and len(pins.errors) == 6, pins.errors
    assert pins.errors[-1] == f"{len(CILIUM_PINS) - 5} more pins under {tmp_path / 'cilium'} not removed"
    monkeypatch.undo()
    assert (tmp_path / "cilium").is_dir()


def test_a_truncated_plan_keeps_the_folders_for_the_next_flush(tmp_path: Path) -> None:
    make_tree(tmp_path)
    pins, _ = flusher(tmp_path, tmp_path, max_pins=4).flush(frozenset({"cilium-kpr"}), None)
    first = sum(pins.removed.values())
    assert first == 4 and "the rest at the next flush" in pins.skipped[0] and "folders" not in pins.removed
    assert (tmp_path / "cilium").is_dir()
    pins, _ = flusher(tmp_path, tmp_path).flush(frozenset({"cilium-kpr"}), None)
    assert pins.removed["link pins"] + pins.removed.get("pins", 0) == len(CILIUM_PINS) - first
    assert not (tmp_path / "cilium").exists()


# `tc -j filter show dev eth0 ingress` on this machine: Cilium's legacy filter is named <program>-<device>
# (pkg/datapath/loader/tc.go); a user's filter from an object file carries the object's name even when its
# program is called like Cilium's.
TC_ETH0 = [
    {"protocol": "all", "pref": 1, "kind": "bpf", "chain": 0},
    {"protocol": "all", "pref": 1, "kind": "bpf", "chain": 0,
     "options": {"handle": "0x1", "bpf_name": "cil_from_netdev-eth0", "direct-action": True,
                 "prog": {"id": 7, "name": "cil_from_netdev", "tag": "59f4a931744dcdc6", "jited": 1}}},
    {"protocol": "all", "pref": 2, "kind": "bpf", "chain": 0,
     "options": {"handle": "0x1", "bpf_name": "prog.o:[tc]", "direct-action": True,
                 "prog": {"id": 9, "name": "cil_from_netdev", "tag": "59f4a931744dcdc6", "jited": 1}}},
    {"protocol": "all", "pref": 3, "kind": "bpf", "chain": 0,
     "options": {"handle": "0x1", "bpf_name": "cil_to_netdev-eth1"}},  # another device's name: not this one's
    {"protocol": "ip", "pref": 4, "kind": "u32", "chain": 0, "options": {"fh": "800::800"}},
]


def test_only_ciliums_exact_filter_names_on_their_own_device() -> None:
    found = parse_tc_filters(json.dumps(TC_ETH0), "eth0", "ingress", CILIUM_TC_PROGRAMS)
    assert [(f.name, f.pref, f.handle) for f in found] == [("cil_from_netdev-eth0", 1, "0x1")]
    assert found[0].delete_argv() == ["tc", "filter", "del", "dev", "eth0", "ingress", "protocol", "all",
                                      "pref", "1", "handle", "0x1", "bpf"]
    assert parse_tc_filters("", "eth0", "ingress", CILIUM_TC_PROGRAMS) == []
    with pytest.raises(ValueError, match="no JSON list"):
        parse_tc_filters("{}", "eth0", "ingress", CILIUM_TC_PROGRAMS)
    with pytest.raises(ValueError, match="more than"):
        parse_tc_filters("[" + " " * 20 + "]", "eth0", "ingress", CILIUM_TC_PROGRAMS, max_bytes=10)


class LegacyTc:
    """eth0 with TC_ETH0 at ingress; a second device that vanishes (cilium_net after cilium_host)."""

    def __init__(self) -> None:
        self.filters = list(TC_ETH0)
        self.deleted: list[list[str]] = []

    def __call__(self, argv: list[str], **_: Any) -> Result:
        if argv[:3] == ["ip", "-j", "link"]:
            return Result(argv, 0, json.dumps([{"ifname": "eth0"}, {"ifname": "gone0"}]), "")
        if argv[:4] == ["tc", "-j", "filter", "show"]:
            if argv[5] == "gone0":
                raise CommandError(argv, 'exited 1: Cannot find device "gone0"')
            return Result(argv, 0, json.dumps(self.filters if argv[6] == "ingress" else []), "")
        if argv[:3] == ["tc", "filter", "del"]:
            self.deleted.append(argv)
            self.filters = [f for f in self.filters if not (f.get("pref") == int(argv[9]) and "options" in f)]
            return Result(argv, 0, "", "")
        raise AssertionError(f"unexpected command {argv}")


def test_the_tc_step_deletes_ciliums_filters_only(tmp_path: Path) -> None:
    tc = LegacyTc()
    _, step = flusher(tmp_path, tmp_path, runner=tc).flush(frozenset({"cilium-kpr"}), "nftables")
    assert step.removed == {"tc filters": 1} and not step.errors, step.describe()
    assert tc.deleted == [["tc", "filter", "del", "dev", "eth0", "ingress", "protocol", "all", "pref", "1",
                           "handle", "0x1", "bpf"]]
    _, again = flusher(tmp_path, tmp_path, runner=tc).flush(frozenset({"cilium-kpr"}), "nftables")
    assert again.removed == {} and len(tc.deleted) == 1
    _, capped = flusher(tmp_path, tmp_path, runner=LegacyTc(), max_devices=1).flush(frozenset({"cilium-kpr"}), None)
    assert capped.skipped == ["2 devices: only the first 1 looked at"] and capped.removed == {"tc filters": 1}
