"""The pure pieces of nodes in the QEMU guest (localcluster.vmnodes): the plan, the guest's command, the tap."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcluster import paths, vm, vmnodes

pytestmark = pytest.mark.unit


def test_parse_plan() -> None:
    assert vmnodes.parse_plan("4:vm") == [(4, "vm")]
    assert vmnodes.parse_plan("4:vm,5:blue") == [(4, "vm"), (5, "blue")]
    for bad in ("4", "x:vm", "4:", "0:vm", "999:vm", "4:vm,4:vm"):
        with pytest.raises(ValueError):
            vmnodes.parse_plan(bad)


def test_guest_argv_round_trips_the_plan_and_uses_the_guest_share() -> None:
    argv = vmnodes.guest_argv("/venv/bin/python", [(4, "vm"), (5, "vm")], [1, 2, 3], bin_dir=Path("/b"),
                              api_url="https://198.18.0.1:6443", max_seconds=600)
    assert argv[:4] == ["/venv/bin/python", "-m", "localcluster.vmnodes", "guest"]
    assert argv[argv.index("--share") + 1] == vm.GUEST_RUN_DIR
    assert vmnodes.parse_plan(argv[argv.index("--nodes") + 1]) == [(4, "vm"), (5, "vm")]
    assert argv[argv.index("--host-nodes") + 1] == "1,2,3"
    assert argv[argv.index("--api-url") + 1] == "https://198.18.0.1:6443"
    assert argv[argv.index("--max-seconds") + 1] == "600"  # a guest whose host test died ends itself


def test_tap_goes_on_the_cluster_bridge_without_an_address() -> None:
    commands = vmnodes.tap_commands("pstap0")
    assert commands[0] == ["ip", "tuntap", "add", "dev", "pstap0", "mode", "tap"]
    assert ["ip", "link", "set", "pstap0", "master", paths.BRIDGE_NAME] in commands
    assert not any("addr" in argv or "route" in argv for argv in commands)


def test_the_guest_bridge_address_is_in_the_cluster_range_and_no_one_elses() -> None:
    import ipaddress

    from localcluster import network, podnet

    address = ipaddress.IPv4Address(vmnodes.GUEST_BRIDGE_ADDRESS)
    assert address in ipaddress.IPv4Network(paths.CLUSTER_CIDR)
    assert address != ipaddress.IPv4Address(paths.BRIDGE_ADDRESS)
    taken = {ipaddress.IPv4Address(paths.node_ip(i)) for i in range(1, paths.MAX_NODES + 1)}
    taken |= {ipaddress.IPv4Address(network.endpoint_ip(n)) for n in range(1, network.MAX_ENDPOINTS + 1)}
    assert address not in taken and address not in podnet.POD_RANGE and address not in podnet.SECOND_ADDRESS_NETWORK
    assert address != ipaddress.IPv4Address(network.SINK_GATEWAY)


def test_guest_mode_refuses_to_run_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vmnodes.GUEST_ENV, raising=False)
    with pytest.raises(SystemExit):
        vmnodes.main(["guest", "--share", "/x", "--nodes", "4:vm", "--bin-dir", "/b", "--api-url", "https://x:1"])
