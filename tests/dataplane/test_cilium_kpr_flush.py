"""The move back from Cilium's kube-proxy replacement removes what a stopped Cilium agent leaves on the node, and
nothing else (issue 19, the reverse move's cleanup).

The real agent (localcluster/cilium.py, confined to the node's netns, cgroup subtree and mount namespace) runs
once in a node namespace and is stopped: it leaves its cilium_host/cilium_net pair with the route through it and
its CILIUM_* chains with their jumps from the built-in chains. The user's own objects beside them look as much
like Cilium's as names can: a chain CILIUM_MINE jumped to from INPUT, a device cilium_mine, a device user0 with a
route of its own. `flush(["cilium-kpr"], "iptables")` in that namespace must remove exactly Cilium's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from localcluster import cilium
from proxyshift.agent.flush import flush
from proxyshift.modes.cilium_kpr import CILIUM_CHAINS
from tests.support.ps_netns import Netns, need_root

pytestmark = [pytest.mark.dataplane, pytest.mark.cilium]

NODE_IP, OUTSIDE_IP = "198.18.242.1", "198.18.242.2"
USER_ROUTE = "198.18.243.0/24"
NATIVE_CIDR = "198.18.0.0/15"


@pytest.fixture
def node() -> Iterator[Netns]:
    need_root()
    ns, outside = Netns(), Netns()
    try:
        ns.run(["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "ext0", "netns", outside.name])
        ns.run(["ip", "addr", "add", f"{NODE_IP}/24", "dev", "eth0"])
        outside.run(["ip", "addr", "add", f"{OUTSIDE_IP}/24", "dev", "ext0"])
        for where, link in ((ns, "eth0"), (ns, "lo"), (outside, "ext0")):
            where.run(["ip", "link", "set", link, "up"])
        yield ns
    finally:
        outside.delete()
        ns.delete()


def _links(ns: Netns) -> set[str]:
    return {str(link["ifname"]) for link in json.loads(ns.run(["ip", "-j", "link", "show"]).stdout)}


def _chains(ns: Netns) -> set[tuple[str, str]]:
    """(table, chain) of every user-defined chain in the namespace's iptables-save."""
    found, table = set(), ""
    for line in ns.save().splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":"):
            name, policy = line[1:].split()[:2]
            if policy == "-":  # a built-in chain has its policy here, a user-defined one "-"
                found.add((table, name))
    return found


def test_the_reverse_move_removes_only_what_cilium_left(agent_binary: Path, node: Netns) -> None:
    # The user's own objects, named as close to Cilium's as a name can be.
    node.restore("*filter\n:CILIUM_MINE - [0:0]\n:MYCHAIN - [0:0]\n-A INPUT -j CILIUM_MINE\n"
                 "-A CILIUM_MINE -p tcp --dport 9 -j ACCEPT\nCOMMIT\n")
    # A veth pair (this kernel has no dummy devices), like Cilium's own cilium_host/cilium_net.
    node.run(["ip", "link", "add", "cilium_mine", "type", "veth", "peer", "name", "user0"])
    for device in ("cilium_mine", "user0"):
        node.run(["ip", "link", "set", device, "up"])
    node.run(["ip", "route", "add", USER_ROUTE, "dev", "user0"])

    agent = cilium.start(node.name, node.name, ["eth0"], [], native_cidr=NATIVE_CIDR, agent=agent_binary)
    try:
        health = agent.wait_healthy()
        assert cilium.kpr_enabled(health), health.get("kube-proxy-replacement")
    finally:
        print(f"\ncilium-agent log tail:\n{agent.log_tail(10)}")
        agent.stop()

    # What the stopped agent left: its veth pair with a route through it, its chains and their jumps.
    left_links = _links(node) & {"cilium_host", "cilium_net"}
    left_chains = _chains(node) & CILIUM_CHAINS
    routes = json.loads(node.run(["ip", "-j", "route", "show", "dev", "cilium_host"]).stdout)
    print(f"left by the stopped agent: {sorted(left_links)}, {len(routes)} routes on cilium_host, "
          f"chains {sorted(c for _, c in left_chains)}")
    assert left_links == {"cilium_host", "cilium_net"}, _links(node)
    assert left_chains, "the stopped agent left no CILIUM_* chain: nothing to prove the flush on"
    assert routes, "no route through cilium_host"

    report = flush(["cilium-kpr"], "iptables", runner=node.run)
    print(report.message())
    assert report.ok, report.message()
    removed = {kind: n for step in report.steps for kind, n in step.removed.items()}
    assert removed.get("devices") == 1  # cilium_host; its veth peer goes with it
    assert removed.get("routes") == len(routes)
    assert removed.get("chains", 0) >= len(left_chains)

    # Cilium's objects are gone...
    assert not _links(node) & {"cilium_host", "cilium_net"}
    assert not _chains(node) & CILIUM_CHAINS
    saved = node.save()
    assert not any(f"-j {chain}" in saved for _, chain in CILIUM_CHAINS), saved
    # ... and the user's are where they were.
    assert {"cilium_mine", "user0", "eth0"} <= _links(node)
    assert {("filter", "CILIUM_MINE"), ("filter", "MYCHAIN")} <= _chains(node)
    assert "-A INPUT -j CILIUM_MINE" in saved and "-A CILIUM_MINE -p tcp -m tcp --dport 9 -j ACCEPT" in saved
    user_routes = json.loads(node.run(["ip", "-j", "route", "show", "dev", "user0"]).stdout)
    assert [r["dst"] for r in user_routes] == [USER_ROUTE]
    # Idempotent: a second flush finds nothing.
    again = flush(["cilium-kpr"], "iptables", runner=node.run)
    assert again.ok and again.total_removed() == 0, again.message()
