"""The flush of a kube-proxy replacement's devices (agent/flush/devices.py) against recorded `ip -j` output, and
the guard that leaves a running Cilium's objects alone (agent/flush/__init__.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.devices import DeviceFlusher, parse_link_names, stale_devices
from proxyshift.commands import CommandError, Result

pytestmark = pytest.mark.unit

LINKS = [{"ifindex": 1, "ifname": "lo"}, {"ifindex": 2, "ifname": "eth0"}, {"ifindex": 5, "ifname": "cilium_net"},
         {"ifindex": 6, "ifname": "cilium_host"}, {"ifindex": 7, "ifname": "cilium_mine"}]
ROUTES = [{"dst": "198.18.56.0/24", "gateway": "198.18.56.1", "dev": "cilium_host"},
          {"dst": "198.18.56.1", "dev": "cilium_host", "scope": "link"}]


class FakeIp:
    """`ip` in a node: a veth pair cilium_host/cilium_net goes as a whole."""

    def __init__(self) -> None:
        self.links = [dict(link) for link in LINKS]
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **_: Any) -> Result:
        self.calls.append(argv)
        if argv[:3] == ["ip", "-j", "link"]:
            return Result(argv, 0, json.dumps(self.links), "")
        if argv[:3] == ["ip", "-j", "route"]:
            return Result(argv, 0, json.dumps(ROUTES if argv[-1] == "cilium_host" else []), "")
        if argv[:3] == ["ip", "link", "delete"]:
            name = argv[-1]
            if name not in {link["ifname"] for link in self.links}:
                raise CommandError(argv, "exited 1: Cannot find device")
            gone = {name} | ({"cilium_host", "cilium_net"} if name in ("cilium_host", "cilium_net") else set())
            self.links = [link for link in self.links if link["ifname"] not in gone]
            return Result(argv, 0, "", "")
        if argv[:4] == ["tc", "-j", "filter", "show"]:
            return Result(argv, 0, "[]", "")  # no legacy tc filter (tcx, or never attached)
        raise AssertionError(f"unexpected command {argv}")


def test_only_cilium_devices_go_with_their_routes() -> None:
    ip = FakeIp()
    (step,) = DeviceFlusher(run=ip).flush(frozenset({"cilium-kpr"}), "iptables")
    assert step.removed == {"devices": 1, "routes": 2} and not step.errors
    assert {link["ifname"] for link in ip.links} == {"lo", "eth0", "cilium_mine"}
    assert [c for c in ip.calls if c[:3] == ["ip", "link", "delete"]] == [["ip", "link", "delete", "dev",
                                                                            "cilium_host"]]
    # Idempotent: nothing of Cilium's left, nothing deleted.
    (again,) = DeviceFlusher(run=ip).flush(frozenset({"cilium-kpr"}), "iptables")
    assert again.removed == {} and not again.errors


def test_a_dry_run_counts_and_changes_nothing() -> None:
    ip = FakeIp()
    (step,) = DeviceFlusher(run=ip, dry_run=True).flush(frozenset({"cilium-kpr"}), None)
    assert step.removed == {"devices": 2, "routes": 2} and step.skipped == ["dry run: nothing changed"]
    assert len(ip.links) == len(LINKS)


def test_no_replacement_mode_no_device() -> None:
    assert stale_devices(frozenset({"iptables", "ipvs"}), "nftables") == []
    assert stale_devices(frozenset({"cilium-kpr"}), "cilium-kpr") == []
    assert stale_devices(frozenset({"cilium-kpr"}), "nftables") == ["cilium_host", "cilium_net"]


def test_ip_output_that_is_not_its_json_is_an_error_in_the_step() -> None:
    with pytest.raises(ValueError, match="more than 10 bytes"):
        parse_link_names("[" + " " * 20 + "]", max_bytes=10)
    with pytest.raises(ValueError, match="no JSON list"):
        parse_link_names('{"ifname": "x"}')

    def garbage(argv: list[str], **_: Any) -> Result:
        return Result(argv, 0, "not json", "")

    (step,) = DeviceFlusher(run=garbage).flush(frozenset({"cilium-kpr"}), None)
    assert step.errors and not step.removed


def test_a_running_cilium_keeps_its_objects(tmp_path: Path) -> None:
    ip = FakeIp()
    report = flush(["cilium-kpr"], "iptables", runner=ip, iptables_tools=[], answers=lambda socket: True,
                   bpffs=tmp_path)
    assert report.ok and report.total_removed() == 0
    assert report.steps[0].skipped == ["Cilium's agent answers on /var/run/cilium/cilium.sock: its objects are "
                                       "in use"]
    assert not any(c[:3] == ["ip", "link", "delete"] for c in ip.calls)
    stopped = flush(["cilium-kpr"], "iptables", runner=ip, iptables_tools=[], answers=lambda socket: False,
                    bpffs=tmp_path)  # no bpffs mount: its step says so
    assert {k: v for s in stopped.steps for k, v in s.removed.items()} == {"devices": 1, "routes": 2}
