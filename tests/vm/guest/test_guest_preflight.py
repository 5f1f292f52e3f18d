"""Preflight on a real kernel with IPVS modules (the guest's Debian 6.1), against the real kube-proxy.

The positive twins of tests/dataplane/test_agent_preflight_host.py (which, on
the host kernel without IPVS, proves the refusal).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from guest_helpers import loaded_modules, unload_ipvs

from proxyshift.agent.preflight import check
from proxyshift.commands import run
from tests.support.kube_proxy_runner import KubeProxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.vm_guest

RELEASE = Path("/proc/sys/kernel/osrelease").read_text().strip()
MODULES = Path("/lib/modules") / RELEASE


def _conntrack_loaded() -> None:
    # As on any node that ran iptables rules; preflight refuses an nf_conntrack that is only installed
    # (kube-proxy writes its sysctls before anything loads it: see agent/preflight.py).
    run(["modprobe", "nf_conntrack"])


def test_installed_ipvs_modules_pass_and_the_real_kube_proxy_gets_them_loaded(netns: Netns, tmp_path: Path) -> None:
    unload_ipvs()
    _conntrack_loaded()
    assert not {"ip_vs", "ip_vs_sh"} & loaded_modules()
    assert (MODULES / "kernel/net/netfilter/ipvs/ip_vs_sh.ko").exists()
    report = check("ipvs", "sh")
    assert report.ok, report.message()
    assert report.on_demand == ["ip_vs", "ip_vs_sh"] and report.modules["ip_vs_sh"] == "loadable"
    assert "the kernel loads them when kube-proxy creates its first virtual server" in report.message()

    # What the message promises, shown: kube-proxy starts in ipvs mode and the kernel loaded both.
    kp = KubeProxy(netns, tmp_path / "kp", "ipvs", services=3, scheduler="sh", conntrack_sysctls=False)
    try:
        answer = kp.wait_synced(1, timeout=240)
    finally:
        kp.stop()
    assert answer["facts"]["proxyMode"] == "ipvs"
    assert {"ip_vs", "ip_vs_sh"} <= loaded_modules()
    after = check("ipvs", "sh")
    assert after.ok and after.on_demand == [] and after.modules["ip_vs_sh"] == "present"


def test_a_scheduler_this_kernel_lacks_is_refused_and_kube_proxy_exits_on_it(netns: Netns, tmp_path: Path) -> None:
    # twos came with Linux 6.2: the guest's 6.1 has no ip_vs_twos at all.
    assert not list(MODULES.rglob("ip_vs_twos.ko*"))
    report = check("ipvs", "twos")
    assert not report.ok
    assert report.details()["missingModules"] == ["ip_vs_twos"]
    assert "neither it loaded, built in nor installed" in report.message()

    kp = KubeProxy(netns, tmp_path / "kp", "ipvs", services=3, scheduler="twos", conntrack_sysctls=False)
    try:
        deadline = time.monotonic() + 120
        while kp.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        exited = kp.proc.poll()
    finally:
        kp.stop()
    log = (tmp_path / "kp" / "kube-proxy.log").read_text()
    assert exited not in (None, 0), log[-2000:]
    assert "can't use the IPVS proxier" in log


def test_a_scheduler_missing_from_the_modules_tree_is_refused(tmp_path: Path) -> None:
    # A modules tree the test controls: this kernel's, minus ip_vs_mh.
    unload_ipvs()
    tree = tmp_path / "modules" / RELEASE
    tree.mkdir(parents=True)
    shutil.copy(MODULES / "modules.builtin", tree)
    dep = (MODULES / "modules.dep").read_text().splitlines()
    (tree / "modules.dep").write_text("".join(f"{line}\n" for line in dep if "/ip_vs_mh.ko" not in line))
    report = check("ipvs", "mh", modules_root=tmp_path / "modules")
    assert [m.what for m in report.missing] == ["kernel module ip_vs_mh"]
    assert "neither it loaded, built in nor installed" in report.missing[0].why
    assert check("ipvs", "mh").ok  # the real tree has it


def test_load_modules_runs_modprobe_and_says_so() -> None:
    unload_ipvs()
    _conntrack_loaded()
    report = check("ipvs", "lc", load_modules=True)
    assert report.ok, report.message()
    assert report.loaded == ["ip_vs", "ip_vs_lc"] and report.on_demand == []
    assert {"ip_vs", "ip_vs_lc"} <= loaded_modules() and Path("/proc/net/ip_vs").exists()
    assert "loaded ip_vs, ip_vs_lc with modprobe" in report.message()
