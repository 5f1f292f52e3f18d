"""The rule hold against real kube-proxy binaries: it keeps ClusterIPs working through the new
kube-proxy's startup cleanup of the old mode, and its release leaves nothing behind.

In a fresh namespace a real kube-proxy programs 5 Services (fed by fake_apiserver.py:
ClusterIPs 198.19.0.10+, endpoints 198.18.16.x:8080). The endpoint addresses are made
local and a listener answers on :8080, so a connect to a ClusterIP succeeds exactly when
something DNATs it; the ClusterIP range itself is routed to lo, where an un-NATed SYN dies.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxyshift.agent import hold
from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.nftables import list_tables
from tests.support.kube_proxy_runner import KubeProxy, find_kube_proxy
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

TOOLS = [IptablesTool("ipv4", "nft"), IptablesTool("ipv6", "nft")]
NODE_IP = "198.18.0.11"
CLUSTER_IP = "198.19.0.10"
LISTENER = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 8080)); s.listen(64)\nwhile True:\n    c, _ = s.accept(); c.close()\n")
CONNECT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 80), timeout=1).close()\n"
           "    print('ok')\nexcept OSError as e:\n    print(f'failed: {e}')\n")


@pytest.fixture(autouse=True)
def _binary() -> None:
    if find_kube_proxy() is None:
        pytest.skip("no kube-proxy binary (build the local cluster or set PROXYSHIFT_KUBE_PROXY)")


@pytest.fixture
def node(netns: Netns) -> Iterator[Netns]:
    netns.run(["ip", "link", "set", "lo", "up"])
    netns.run(["ip", "route", "add", "local", "198.18.16.0/20", "dev", "lo"])
    netns.run(["ip", "route", "add", "198.19.0.0/16", "dev", "lo"])
    listener = subprocess.Popen(["ip", "netns", "exec", netns.name, sys.executable, "-c", LISTENER])
    try:
        time.sleep(0.3)
        yield netns
    finally:
        listener.kill()
        listener.wait(timeout=10)


def connects(ns: Netns) -> bool:
    out = ns.run([sys.executable, "-c", CONNECT, CLUSTER_IP], timeout=15).stdout.strip()
    return out == "ok"


def start(ns: Netns, workdir: Path, mode: str) -> KubeProxy:
    # KubeProxy adds the node IP to lo; a second kube-proxy in the same namespace adds it again.
    ns.run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo"], check=False)
    return KubeProxy(ns, workdir, mode, services=5)


def synced_then_stopped(ns: Netns, workdir: Path, mode: str) -> None:
    kp = start(ns, workdir, mode)
    try:
        kp.wait_synced(1)
    finally:
        kp.stop()  # as at a switch: the old kube-proxy goes, its rules stay in the kernel


def test_iptables_hold_dnats_through_the_cleanup_and_goes_without_a_trace(node: Netns, tmp_path: Path) -> None:
    synced_then_stopped(node, tmp_path / "old", "iptables")
    assert connects(node), "the real iptables kube-proxy's rules should DNAT the ClusterIP"
    before = node.save()

    report = hold.install("iptables", runner=node.run, iptables_tools=TOOLS)
    assert report.ok and report.changed, report.message()
    assert hold.present(runner=node.run, iptables_tools=TOOLS)
    # What kube-proxy's startup cleanup in nftables mode does to iptables mode's chains:
    assert flush(["iptables"], "nftables", runner=node.run, iptables_tools=TOOLS).ok
    assert not any(line.startswith(":KUBE-SVC-") for line in node.save().splitlines())
    assert connects(node), "with kube-proxy's chains gone the hold must still DNAT the ClusterIP"

    # The real thing: a new kube-proxy in nftables mode starts (and cleans up), syncs, and the hold goes.
    new = start(node, tmp_path / "new", "nftables")
    try:
        new.wait_synced(1)
        assert connects(node)
        released = hold.release(runner=node.run, iptables_tools=TOOLS)
        assert released.ok and released.changed, released.message()
        assert connects(node), "kube-proxy's own nftables rules carry the traffic after the release"
    finally:
        new.stop()
    after = node.save()
    assert "PSHOLD-" not in after and not hold.present(runner=node.run, iptables_tools=TOOLS)
    # Nothing of the hold remains: what is left is what the flush left of the original dump.
    kept = {line for line in before.splitlines() if line.startswith("-A ") and "KUBE-" not in line}
    assert kept <= set(after.splitlines())


def test_nftables_hold_dnats_through_the_cleanup_and_goes_without_a_trace(node: Netns, tmp_path: Path) -> None:
    synced_then_stopped(node, tmp_path / "old", "nftables")
    assert connects(node)
    original = node.run(["nft", "list", "table", "ip", "kube-proxy"]).stdout

    report = hold.install("nftables", runner=node.run, iptables_tools=TOOLS)
    assert report.ok and report.changed, report.message()
    copy = node.run(["nft", "list", "table", "ip", hold.NFT_HOLD_TABLE]).stdout
    assert copy.replace(f"table ip {hold.NFT_HOLD_TABLE} {{", "table ip kube-proxy {", 1) == original
    assert flush(["nftables"], "iptables", runner=node.run, iptables_tools=TOOLS).ok
    assert ("ip", "kube-proxy") not in list_tables(node.run)
    assert connects(node), "with kube-proxy's table gone the hold must still DNAT the ClusterIP"

    new = start(node, tmp_path / "new", "iptables")
    try:
        new.wait_synced(1)
        # The new kube-proxy's cleanup removed the `kube-proxy` tables, never the hold.
        assert ("ip", hold.NFT_HOLD_TABLE) in list_tables(node.run)
        released = hold.release(runner=node.run, iptables_tools=TOOLS)
        assert released.ok and released.changed, released.message()
        assert connects(node)
    finally:
        new.stop()
    assert all(name != hold.NFT_HOLD_TABLE for _, name in list_tables(node.run))


def test_without_a_hold_the_cleanup_leaves_the_clusterip_dead(node: Netns, tmp_path: Path) -> None:
    # The control for the two tests above: the gap the hold exists for is real.
    synced_then_stopped(node, tmp_path / "old", "iptables")
    assert connects(node)
    assert flush(["iptables"], "nftables", runner=node.run, iptables_tools=TOOLS).ok
    assert not connects(node)
