"""Preflight against this machine's real kernel and tools: no IPVS here, nftables fine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxyshift.agent.preflight import check

pytestmark = pytest.mark.dataplane


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run nft/iptables")


def test_ipvs_is_refused_here_with_the_module_list() -> None:
    if Path("/proc/net/ip_vs").exists() or Path("/sys/module/ip_vs").exists():
        pytest.skip("this kernel has IPVS")
    report = check("ipvs", "mh")
    assert not report.ok
    missing = report.details()["missingModules"]
    assert missing[:2] == ["ip_vs", "ip_vs_mh"]
    assert "ip_vs" in report.message()


def test_nftables_is_accepted_here() -> None:
    report = check("nftables")
    assert report.ok, report.message()
    assert report.tools.nft_usable is True
    assert report.kernel_release == Path("/proc/sys/kernel/osrelease").read_text().strip()


def test_iptables_is_accepted_here() -> None:
    report = check("iptables")
    assert report.ok, report.message()
    assert report.tools.iptables_nat is True
