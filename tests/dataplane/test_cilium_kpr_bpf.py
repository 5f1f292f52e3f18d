"""A stopped Cilium's BPF attachments stay on a real node until the move back removes them (issue 19, Build 2).

    client: the node's cgroup and netns --- node (eth0 198.18.244.1, pspod0) --veth-- pod (listener :8080)
    the node's bpffs: /run/proxyshift-cilium/<node>/bpffs (localcluster.cilium.mount_bpffs), as its /sys/fs/bpf

On a real node Cilium pins its socket-LB cgroup links and its tcx links under the host's /sys/fs/bpf/cilium,
and they stay attached after the agent is gone. Here the node's bpffs outlives the agent in the same way
(`cilium.start(bpffs=...)`). The tests show, with bpftool and BPF_PROG_QUERY:

- after the agent stopped (its node's cgroup kept, as a real node's root cgroup stays), socket-LB is still
  attached at the node's cgroup and tcx on its eth0, and a client of the node is still translated by the dead
  agent's maps; a restarted agent finds its maps (the same map ids) and serves;
- `flush(["cilium-kpr"], "iptables")` for the node unpins Cilium's links: nothing of Cilium is attached any
  more, its Service is no longer translated, and a user's own pinned map and program in the same bpffs (outside
  cilium/) and a user's tc filter whose program is called like Cilium's are untouched;
- with legacy tc (`--enable-tcx=false`, as on kernels before 6.6) the stopped agent leaves cil_* tc filters on
  eth0, which no pin holds: the flush deletes those by their exact names and keeps the user's.

Wall time: about 30 s on 2 cores (three agent starts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import cilium_topology
import pytest

from localcluster import cilium, podnet
from localcluster.container import run_in_netns
from proxyshift.agent.flush import flush
from proxyshift.commands import run
from tests.support import bpf_attach
from tests.support.ps_netns import Netns

pytestmark = [pytest.mark.dataplane, pytest.mark.cilium]

NODE_IP, OUTSIDE_IP = "198.18.244.1", "198.18.244.2"
POD_INDEX = 203  # podnet's pod range 198.18.57.64/27, apart from test_cilium_kpr.py's
CLUSTER_IP = "198.19.244.10"
SERVICE_PORT, TARGET_PORT = 80, 8080
NATIVE_CIDR = "198.18.0.0/15"
CLANG = cilium.LLVM_BIN / "clang"
# A user's trivial tc program, named like Cilium's on purpose: it must survive by its own name.
USER_PROGRAM = """
struct __sk_buff;
__attribute__((section("tc"), used)) int cil_from_netdev(struct __sk_buff *skb) { return 0; }
char _license[] __attribute__((section("license"), used)) = "GPL";
"""


@pytest.fixture
def topology() -> Iterator[tuple[Netns, str]]:
    with cilium_topology.node_outside_pod(NODE_IP, OUTSIDE_IP, POD_INDEX) as (node, _, pod):
        yield node, pod


@pytest.fixture
def listener(topology: tuple[Netns, str], tmp_path: Path) -> Iterator[str]:
    with cilium_topology.pod_listener(topology[1], TARGET_PORT, tmp_path) as pod:
        yield pod


@pytest.fixture
def node_bpffs(topology: tuple[Netns, str]) -> Iterator[Path]:
    """The node's bpffs, outliving its agents; unpinned and unmounted with the node."""
    path = cilium.mount_bpffs(cilium.node_bpffs(topology[0].name))
    try:
        yield path
    finally:
        cilium.remove_bpffs(path)
        assert not cilium.bpffs_mounted(path)


@pytest.fixture
def user_program(tmp_path: Path) -> Path:
    """A trivial tc program's object file, compiled with the clang the agent uses."""
    source, obj = tmp_path / "user.c", tmp_path / "user.o"
    source.write_text(USER_PROGRAM)
    run([str(CLANG), "-O2", "-target", "bpf", "-c", str(source), "-o", str(obj)], timeout=60)
    return obj


def _pins(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


def _cgroup_attach_types(cgroup: Path) -> set[str]:
    return {str(p["attach_type"]) for p in bpf_attach.cgroup_tree(cilium.cgroup2_mount()).get(str(cgroup), [])}


def _map_id(pin: Path) -> int:
    return int(json.loads(run(["bpftool", "-j", "map", "show", "pinned", str(pin)], timeout=30).stdout)["id"])


def _tc_names(node: Netns, device: str) -> list[str]:
    names = []
    for direction in ("ingress", "egress"):
        out = node.run(["tc", "-j", "filter", "show", "dev", device, direction]).stdout
        names += [str(f["options"]["bpf_name"]) for f in json.loads(out or "[]") if "bpf_name" in f.get("options", {})]
    return names


def _user_objects(node: Netns, bpffs: Path, obj: Path) -> None:
    """The user's own pins beside Cilium's folder, and a legacy tc filter on eth0 running the pinned program."""
    (bpffs / "mine").mkdir()
    run(["bpftool", "map", "create", str(bpffs / "mine" / "map"), "type", "hash", "key", "4", "value", "4",
         "entries", "8", "name", "user_map"], timeout=30)
    run(["bpftool", "prog", "load", str(obj), str(bpffs / "mine" / "prog"), "type", "classifier"], timeout=30)
    node.run(["tc", "qdisc", "replace", "dev", "eth0", "clsact"])
    node.run(["tc", "filter", "add", "dev", "eth0", "egress", "pref", "7", "bpf", "da", "object-pinned",
              str(bpffs / "mine" / "prog")])


def _user_objects_intact(node: Netns, bpffs: Path) -> None:
    assert {"mine/map", "mine/prog"} <= _pins(bpffs), _pins(bpffs)
    run(["bpftool", "map", "show", "pinned", str(bpffs / "mine" / "map")], timeout=30)
    run(["bpftool", "prog", "show", "pinned", str(bpffs / "mine" / "prog")], timeout=30)
    user_filters = [n for n in _tc_names(node, "eth0") if not n.startswith("cil_")]
    assert len(user_filters) == 1, _tc_names(node, "eth0")


def test_a_stopped_ciliums_links_stay_attached_until_the_flush_unpins_them(
        agent_binary: Path, topology: tuple[Netns, str], listener: str, node_bpffs: Path, user_program: Path) -> None:
    node, pod = topology
    service = cilium.Service("echo", CLUSTER_IP, SERVICE_PORT, TARGET_PORT, (podnet.pod_ip(POD_INDEX),))
    devices = ["eth0", podnet.POD_NODE_LINK]
    agent = cilium.start(node.name, node.name, devices, [service], native_cidr=NATIVE_CIDR, agent=agent_binary,
                         bpffs=node_bpffs)
    cgroup = agent.cgroup
    try:
        try:
            agent.wait_healthy()
            print(f"\ncilium-agent healthy after {agent.healthy_after:.1f}s with the node's bpffs")
            assert cilium.dial(cgroup, node.name, CLUSTER_IP, SERVICE_PORT).payload == pod
            services_map = node_bpffs / "tc" / "globals" / "cilium_lb4_services_v2"
            first_map = _map_id(services_map)
        finally:
            agent.stop(keep_cgroup=True)
        pins = _pins(node_bpffs / "cilium")
        links = sorted(p for p in pins if "/links/" in f"/{p}")
        print(f"pinned by the stopped agent under cilium/: {len(pins)}, links: {links}")
        assert {"socketlb/links/cgroup/cil_sock4_connect", "devices/eth0/links/cil_from_netdev"} <= set(links)

        # Stopped, as on a real node: socket-LB stays at the node's cgroup, tcx on eth0, and the dead agent's
        # maps still translate the node's connects.
        assert "cgroup_inet4_connect" in _cgroup_attach_types(cgroup)
        assert {"eth0/ingress", "eth0/egress"} <= set(run_in_netns(node.name, bpf_attach.host_tcx))
        stale = cilium.dial(cgroup, node.name, CLUSTER_IP, SERVICE_PORT)
        assert (stale.outcome, stale.payload) == ("answered", pod), stale

        # A restarted agent finds its maps in the node's bpffs (the same map) and serves.
        again = cilium.start(node.name, node.name, devices, [service], native_cidr=NATIVE_CIDR, agent=agent_binary,
                             bpffs=node_bpffs, cgroup_exists=True)
        try:
            again.wait_healthy()
            reused = _map_id(services_map) == first_map
            print(f"restarted agent healthy after {again.healthy_after:.1f}s; its Service map reused: {reused}")
            assert reused
            assert cilium.dial(cgroup, node.name, CLUSTER_IP, SERVICE_PORT).payload == pod
        finally:
            print(f"cilium-agent log tail:\n{again.log_tail(10)}")
            again.stop(keep_cgroup=True)

        _user_objects(node, node_bpffs, user_program)
        links = sorted(p for p in _pins(node_bpffs / "cilium") if "/links/" in f"/{p}")
        report = flush(["cilium-kpr"], "iptables", runner=node.run, bpffs=node_bpffs)
        print(report.message())
        assert report.ok, report.message()
        removed = {kind: n for step in report.steps for kind, n in step.removed.items()}
        assert removed.get("link pins") == len(links), (removed, links)

        # Nothing of Cilium is attached any more: not at the node's cgroup, not on its devices; its Service is
        # no longer translated (the ClusterIP is routed nowhere in the node).
        assert not (node_bpffs / "cilium").exists()
        assert _cgroup_attach_types(cgroup) == set()
        assert run_in_netns(node.name, bpf_attach.host_tcx) == {}
        after = cilium.dial(cgroup, node.name, CLUSTER_IP, SERVICE_PORT, timeout=3.0)
        assert after.outcome != "answered", after
        # The user's pins and tc filter are where they were; Cilium's maps in iproute2's tc/globals stay.
        _user_objects_intact(node, node_bpffs)
        assert services_map.exists()
        second = flush(["cilium-kpr"], "iptables", runner=node.run, bpffs=node_bpffs)
        assert second.ok and second.total_removed() == 0, second.message()
    finally:
        cilium.remove_cgroup(cgroup)


def test_legacy_tc_filters_of_a_stopped_cilium_go_and_a_users_stay(
        agent_binary: Path, topology: tuple[Netns, str], node_bpffs: Path, user_program: Path) -> None:
    node, _ = topology
    agent = cilium.start(node.name, node.name, ["eth0"], [], native_cidr=NATIVE_CIDR, agent=agent_binary,
                         bpffs=node_bpffs, extra_flags=["--enable-tcx=false"])
    try:
        agent.wait_healthy()
    finally:
        print(f"\ncilium-agent log tail:\n{agent.log_tail(5)}")
        agent.stop()  # its cgroup goes: socket-LB with it; the tc filters stay on eth0, held by no pin
    left = _tc_names(node, "eth0")
    print(f"tc filters on eth0 after the stop: {left}")
    assert {"cil_from_netdev-eth0", "cil_to_netdev-eth0"} <= set(left), left
    _user_objects(node, node_bpffs, user_program)

    report = flush(["cilium-kpr"], "iptables", runner=node.run, bpffs=node_bpffs)
    print(report.message())
    assert report.ok, report.message()
    removed = {kind: n for step in report.steps for kind, n in step.removed.items()}
    assert removed.get("tc filters") == len([n for n in left if n.startswith("cil_")]), removed
    assert not [n for n in _tc_names(node, "eth0") if n.startswith("cil_")]
    _user_objects_intact(node, node_bpffs)
