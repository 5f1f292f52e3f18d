"""Preflight against fixture kernels (tests/fixtures/proc, sys) with canned tool versions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.inventory import Inventory
from proxyshift.agent.preflight import (
    PreflightReport,
    ToolVersions,
    VersionCache,
    check,
    detect_tools,
    parse_kernel_release,
    parse_version,
)
from proxyshift.commands import CommandError, Result, ToolMissingError

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GOOD_TOOLS = ToolVersions(nft="1.0.9", iptables="1.8.10", iptables_backend="nf_tables", ipset="7.19",
                          nft_usable=True, iptables_nat=True)


def kernel(name: str, mode: str, scheduler: str | None = None, **kw: Any) -> PreflightReport:
    kw.setdefault("tools", GOOD_TOOLS)
    # The fixture kernels with /proc/net/ip_vs hold no virtual server; never the host's ipvsadm.
    kw.setdefault("ipvs_inventory", lambda: Inventory(ipvs_available=True))
    return check(mode, scheduler, proc_root=FIX / "proc" / name, sys_root=FIX / "sys" / name,
                 modules_root=FIX / "sys" / name / "lib-modules", **kw)


def test_builtin_ipvs_passes_for_every_scheduler_seen_through_sys_and_modules_builtin() -> None:
    for sched in ("rr", "mh", "sh"):
        report = kernel("ipvs-builtin", "ipvs", sched)
        assert report.ok, report.message()
    assert "ip_vs" in report.present_modules() and "ip_vs_mh" in report.present_modules()


def test_kernel_without_ipvs_refuses_ipvs_listing_every_module_and_accepts_nftables() -> None:
    report = kernel("no-ipvs", "ipvs")
    assert not report.ok
    assert report.details()["missingModules"] == ["ip_vs", "ip_vs_rr"]
    assert "use a kernel built with ip_vs" in report.message()
    assert kernel("no-ipvs", "nftables").ok


def test_ip_vs_without_ip_vs_mh_says_how_to_load_it() -> None:
    assert kernel("ipvs-no-mh", "ipvs", "rr").ok
    report = kernel("ipvs-no-mh", "ipvs", "mh")
    assert [m.what for m in report.missing] == ["kernel module ip_vs_mh"]
    assert "modprobe ip_vs_mh" in report.missing[0].fix and "loadModules" in report.missing[0].fix


def test_load_modules_modprobes_and_reports_what_it_loaded() -> None:
    calls = []

    def runner(argv: Sequence[str], **_: Any) -> Result:
        calls.append(list(argv))
        return Result(list(argv), 0, "", "")

    report = kernel("ipvs-no-mh", "ipvs", "mh", load_modules=True, runner=runner)
    assert ["modprobe", "--", "ip_vs_mh"] in calls
    assert report.loaded == ["ip_vs_mh"]
    # The fixture tree does not change, so the module is still honestly reported missing.
    assert not report.ok


def test_old_kernel_refuses_nftables_but_not_iptables_or_ipvs() -> None:
    report = kernel("old-5.4", "nftables")
    assert [m.what for m in report.missing] == ["kernel >= 5.13"]
    assert "5.4.0-150-generic" in report.message()
    assert kernel("old-5.4", "iptables").ok
    assert kernel("old-5.4", "ipvs", "wrr").ok


def test_tool_requirements() -> None:
    old_nft = ToolVersions(nft="0.9.8", iptables="1.8.7", iptables_backend="legacy", ipset="7.1",
                           nft_usable=True, iptables_nat=True)
    assert [m.what for m in kernel("no-ipvs", "nftables", tools=old_nft).missing] == ["nft >= 1.0.1"]
    none = ToolVersions()
    assert {m.what for m in kernel("ipvs-builtin", "ipvs", tools=none).missing} == {"iptables binary", "ipset binary"}
    assert [m.what for m in kernel("no-ipvs", "nftables", tools=none).missing] == ["nft binary"]
    no_nat = ToolVersions(iptables="1.8.9", iptables_nat=False)
    assert [m.what for m in kernel("no-ipvs", "iptables", tools=no_nat).missing] == ["iptables nat table"]


def test_extra_modules_and_bad_input() -> None:
    report = kernel("no-ipvs", "nftables", extra_modules=["br_netfilter"])
    assert [m.what for m in report.missing] == ["kernel module br_netfilter"]
    with pytest.raises(ValueError, match="unknown kube-proxy mode"):
        kernel("no-ipvs", "userspace")
    with pytest.raises(ValueError, match="scheduler"):
        kernel("no-ipvs", "ipvs", "fastest")
    for bad in ("--force", "../../x", "a b", ""):
        with pytest.raises(ValueError, match="invalid kernel module name"):
            kernel("no-ipvs", "nftables", extra_modules=[bad])


def test_version_parsing() -> None:
    assert parse_version("nftables v1.0.6 (Lester Gooch #5)") == (1, 0, 6)
    assert parse_version("iptables v1.8.9 (nf_tables)") == (1, 8, 9)
    assert parse_version("ipset v7.17, protocol version: 7") == (7, 17)
    assert parse_version("garbage") is None
    assert parse_kernel_release("6.18.44-fc-v669") == (6, 18, 44)
    assert parse_kernel_release("5.4.0-150-generic") == (5, 4, 0)
    assert parse_kernel_release("6.1-rc1") == (6, 1, 0)


def test_detect_tools_with_a_fake_runner_and_missing_tools(tmp_path: Path) -> None:
    outputs = {"nft": "nftables v1.0.6 (Lester Gooch #5)", "iptables": "iptables v1.8.9 (legacy)",
               "ipset": "ipset v7.17, protocol version: 7"}
    asked = []

    def runner(argv: Sequence[str], **_: Any) -> Result:
        asked.append(argv[0])
        if argv[0] not in outputs:
            raise ToolMissingError(argv, "not found")
        return Result(list(argv), 0, outputs[argv[0]] if argv[1] == "--version" else "", "")

    tools = detect_tools(runner, proc_root=tmp_path)
    assert "ipvsadm" not in asked            # no IPVS: ipvsadm would try to modprobe ip_vs
    assert tools == ToolVersions(nft="1.0.6", iptables="1.8.9", iptables_backend="legacy", ipset="7.17",
                                 ipvsadm=None, nft_usable=True, iptables_nat=True)
    assert tools.as_status() == {"nft": "1.0.6", "iptables": "1.8.9", "iptablesBackend": "legacy",
                                 "ipset": "7.17"}


def test_an_error_message_is_not_a_version(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")

    def runner(argv: Sequence[str], **_: Any) -> Result:
        if argv[0] == "ipvsadm":
            return Result(list(argv), 2, "", "modprobe: FATAL: Module ip_vs not found in directory "
                          "/lib/modules/6.18.44-fc-v669\nCan't initialize ipvs: Protocol not available")
        if argv[0] == "nft":
            return Result(list(argv), 0, "garbage 9.9.9", "")
        return Result(list(argv), 0, "ipset v7.17, protocol version: 7" if argv[0] == "ipset" else "", "")

    tools = detect_tools(runner, proc_root=tmp_path)
    assert tools.ipvsadm is None and tools.nft is None and tools.ipset == "7.17"

    def good(argv: Sequence[str], **_: Any) -> Result:
        out = "ipvsadm v1.31 2019/12/24 (compiled with popt and IPVS v1.2.1)" if argv[0] == "ipvsadm" else ""
        return Result(list(argv), 0, out, "")

    assert detect_tools(good, proc_root=tmp_path).ipvsadm == "1.31"


def _autoload_kernel(tmp_path: Path, *, disabled: str = "0", modprobe: str = "/sbin/modprobe",
                     conntrack_loaded: bool = True) -> Path:
    """ipvs-no-mh (ip_vs_mh installed only) on a kernel that may load modules on demand."""
    import shutil

    root = tmp_path / "k"
    shutil.copytree(FIX / "proc" / "ipvs-no-mh", root / "proc")
    shutil.copytree(FIX / "sys" / "ipvs-no-mh", root / "sys")
    (root / "proc" / "sys" / "kernel" / "modules_disabled").write_text(disabled + "\n")
    (root / "proc" / "sys" / "kernel" / "modprobe").write_text(modprobe + "\n")
    if not conntrack_loaded:
        modules = root / "proc" / "modules"
        modules.write_text("".join(line + "\n" for line in modules.read_text().splitlines()
                                   if not line.startswith("nf_conntrack ")))
    return root


def _check_at(root: Path, *args: Any, **kw: Any) -> PreflightReport:
    kw.setdefault("tools", GOOD_TOOLS)
    return check(*args, proc_root=root / "proc", sys_root=root / "sys", modules_root=root / "sys" / "lib-modules",
                 **kw)


def test_an_installed_scheduler_is_accepted_when_the_kernel_loads_it_on_first_use(tmp_path: Path) -> None:
    # Observed in the QEMU guest (tests/vm): kube-proxy's dummy virtual server makes the kernel
    # load ip_vs and ip_vs_<scheduler> itself.
    report = _check_at(_autoload_kernel(tmp_path), "ipvs", "mh")
    assert report.ok, report.message()
    assert report.on_demand == ["ip_vs_mh"] and report.details()["onDemand"] == ["ip_vs_mh"]
    assert "ip_vs_mh installed, not loaded: the kernel loads them when kube-proxy creates its first virtual " \
           "server" in report.message()
    assert report.modules["ip_vs_mh"] == "loadable"


def test_without_on_demand_loading_an_installed_scheduler_is_still_refused(tmp_path: Path) -> None:
    variants: tuple[dict[str, Any], ...] = ({"disabled": "1"}, {"modprobe": ""})
    for i, kw in enumerate(variants):
        report = _check_at(_autoload_kernel(tmp_path / str(i), **kw), "ipvs", "mh")
        assert [m.what for m in report.missing] == ["kernel module ip_vs_mh"], kw
        assert "installed but not loaded" in report.missing[0].why and not report.on_demand


def test_an_installed_nf_conntrack_is_not_accepted_on_demand(tmp_path: Path) -> None:
    # kube-proxy writes nf_conntrack sysctls before it touches IPVS: on a fresh kernel it exits.
    report = _check_at(_autoload_kernel(tmp_path, conntrack_loaded=False), "ipvs", "rr")
    assert [m.what for m in report.missing] == ["kernel module nf_conntrack"]
    assert "modprobe nf_conntrack" in report.missing[0].fix


def test_a_scheduler_the_kernel_lacks_is_refused_even_with_on_demand_loading(tmp_path: Path) -> None:
    root = _autoload_kernel(tmp_path)
    dep = next((root / "sys" / "lib-modules").glob("*/modules.dep"))
    dep.write_text("".join(line + "\n" for line in dep.read_text().splitlines() if "ip_vs_twos" not in line))
    report = _check_at(root, "ipvs", "twos")
    assert [m.what for m in report.missing] == ["kernel module ip_vs_twos"]
    assert "neither it loaded, built in nor installed" in report.missing[0].why


def test_versions_are_asked_once_per_agent_and_the_kernel_checks_every_time(tmp_path: Path) -> None:
    outputs = {"nft": "nftables v1.0.6 (Lester Gooch #5)", "iptables": "iptables v1.8.9 (nf_tables)"}
    asked: list[str] = []
    flaky = {"ipset": 1}  # ipset's first --version times out: nothing lasting is learnt from that

    def runner(argv: Sequence[str], **_: Any) -> Result:
        asked.append(" ".join(argv))
        if argv[0] == "ipset" and flaky["ipset"]:
            flaky["ipset"] -= 1
            raise CommandError(argv, "timed out after 10s")
        if argv[0] == "ipset":
            return Result(list(argv), 0, "ipset v7.17, protocol version: 7", "")
        if argv[0] not in outputs:
            raise ToolMissingError(argv, "not found")
        return Result(list(argv), 0, outputs[argv[0]] if argv[1] == "--version" else "", "")

    cache = VersionCache()
    first = detect_tools(runner, proc_root=tmp_path, versions=cache)
    assert first.ipset is None and first.nft == "1.0.6"
    asked.clear()
    again = detect_tools(runner, proc_root=tmp_path, versions=cache)
    # Only ipset's version is asked again (its first answer was a timeout); the kernel is asked every time.
    assert sorted(asked) == ["ipset --version", "iptables -w 5 -t nat -S POSTROUTING", "nft list tables"]
    assert again == ToolVersions(nft="1.0.6", iptables="1.8.9", iptables_backend="nf_tables", ipset="7.17",
                                 nft_usable=True, iptables_nat=True)
    asked.clear()
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")  # IPVS appeared (ip_vs loaded): ipvsadm is asked, and kept missing
    assert detect_tools(runner, proc_root=tmp_path, versions=cache).ipvsadm is None
    assert "ipvsadm --version" in asked and "ipset --version" not in asked
    asked.clear()
    detect_tools(runner, proc_root=tmp_path, versions=cache)
    assert sorted(asked) == ["iptables -w 5 -t nat -S POSTROUTING", "nft list tables"]
