"""Cilium's kube-proxy replacement confined to one simulated node (issue 19, the first slice).

    client in X (198.18.240.2) --veth-- node (eth0 198.18.240.1, pspod0) --veth-- pod (listener :8080)
                                        cgroup proxyshift-cilium-<node>: the agent, the node's clients

The real agent (the pinned `cilium-agent` tool) runs in the node's network namespace, cgroup v2
subtree and a private mount namespace (localcluster/cilium.py), with a ClusterIP and a NodePort
Service from its lb state file. The test proves that KPR serves them there and that nothing of it
reaches the host: no BPF program attached at any cgroup outside the node's subtree or in the host's
network namespace while it runs, the host's sysctls it would set unchanged, and nothing left after
it stops (no process, cgroup, mount, namespace or program).

Wall time: about 7 s on 2 cores (the agent is healthy 4-5 s after its start, bpf_host compiled by
clang-19 in about 1.4 s of that); it prints the agent's start-to-healthy time and resident memory.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cilium_topology
import pytest

from localcluster import cilium, podnet
from localcluster.container import run_in_netns
from proxyshift.agent.behaviour import dial_tcp
from proxyshift.agent.cilium_api import CiliumAPI, read_replacement
from proxyshift.api.policy import GateSettings
from proxyshift.api.replacement import frontend_key
from proxyshift.commands import run
from proxyshift.planner.gate import evaluate_replacement_gate
from tests.support import bpf_attach
from tests.support.ps_netns import Netns

pytestmark = [pytest.mark.dataplane, pytest.mark.cilium]

NODE_IP, OUTSIDE_IP = "198.18.240.1", "198.18.240.2"
POD_INDEX = 200  # podnet's pod range 198.18.56.224/27: gateway .225 in the node, the pod .226
CLUSTER_IP = "198.19.240.10"
SERVICE_PORT, TARGET_PORT, NODE_PORT = 80, 8080, 30080
NATIVE_CIDR = "198.18.0.0/15"


def _mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


def _program_ids() -> set[int]:
    return {int(p["id"]) for p in json.loads(run(["bpftool", "-j", "prog", "show"], timeout=60).stdout or "[]")}


@pytest.fixture
def topology() -> Iterator[tuple[Netns, Netns, str]]:
    with cilium_topology.node_outside_pod(NODE_IP, OUTSIDE_IP, POD_INDEX) as found:
        yield found


@pytest.fixture
def listener(topology: tuple[Netns, Netns, str], tmp_path: Path) -> Iterator[str]:
    with cilium_topology.pod_listener(topology[2], TARGET_PORT, tmp_path) as pod:
        yield pod


def test_kpr_serves_the_node_and_touches_nothing_of_the_host(agent_binary: Path, topology: tuple[Netns, Netns, str],
                                                            listener: str) -> None:
    node, outside, pod = topology
    cgroup_root = cilium.cgroup2_mount()
    before = bpf_attach.host_snapshot(cgroup_root)
    sysctls = {path: Path(path).read_text() for path in cilium.HOST_SYSCTLS}
    mounts_before = _mounts()
    service = cilium.Service("echo", CLUSTER_IP, SERVICE_PORT, TARGET_PORT, (podnet.pod_ip(POD_INDEX),),
                             node_port=NODE_PORT)

    test_start = time.monotonic()
    # The pod's veth is a Cilium device too: the pod is no Cilium endpoint (no bpf_lxc), so its replies
    # to an external NodePort client must cross bpf_host there to be reverse-NATed, as a remote
    # backend's replies do on a real node.
    agent = cilium.start(node.name, node.name, ["eth0", podnet.POD_NODE_LINK], [service],
                         native_cidr=NATIVE_CIDR, agent=agent_binary)
    agent_pid = agent.proc.pid
    agent_programs: set[int] = set()
    try:
        health = agent.wait_healthy()
        print(f"\ncilium-agent healthy after {agent.healthy_after:.1f}s, RSS {agent.rss_bytes() / 2**20:.0f} MiB")
        assert cilium.kpr_enabled(health), health.get("kube-proxy-replacement")

        # The agent's cgroup root is the node's subtree: its socket-LB programs are attached there.
        during = bpf_attach.host_snapshot(cgroup_root)
        attached = during["cgroups"]
        assert isinstance(attached, dict)
        assert str(agent.cgroup) in attached, f"no socket-LB at the node's cgroup {agent.cgroup}: {attached}"
        attach_types = {p["attach_type"] for p in attached[str(agent.cgroup)]}
        assert "cgroup_inet4_connect" in attach_types, attach_types
        in_node = {path for path in attached if path == str(agent.cgroup) or path.startswith(f"{agent.cgroup}/")}
        outside_node = {path: progs for path, progs in attached.items() if path not in in_node}
        assert outside_node == before["cgroups"], f"BPF attached outside the node's cgroup: {outside_node}"
        assert during["root_cgroup"] == before["root_cgroup"], during["root_cgroup"]
        assert during["net"] == before["net"], f"BPF in the host's network namespace: {during['net']}"
        assert during["tcx"] == before["tcx"], f"tcx programs in the host's network namespace: {during['tcx']}"
        # ... and its tc programs are the node's (on eth0 there, by tcx on this kernel).
        node_tcx = run_in_netns(node.name, bpf_attach.host_tcx)
        node_tc = json.loads(node.run(["bpftool", "-j", "net", "show"]).stdout)
        assert any(k.startswith("eth0/") for k in node_tcx) or node_tc[0]["tc"], (node_tcx, node_tc)
        agent_programs |= {int(p["id"]) for path in in_node for p in attached[path]}
        agent_programs |= {i for ids in node_tcx.values() for i in ids}
        # Its devices, routes and iptables chains are the node's, not the host's.
        assert "cilium_" not in run(["ip", "-o", "link", "show"]).stdout
        assert "cilium_host" in node.run(["ip", "-o", "link", "show"]).stdout
        assert "CILIUM" not in run(["iptables-save"], timeout=120).stdout
        assert {path: Path(path).read_text() for path in cilium.HOST_SYSCTLS} == sysctls
        assert _mounts() == mounts_before, "the agent's mounts leaked into the host's mount namespace"

        frontends = {entry["spec"]["frontend-address"]["ip"] + ":" + str(entry["spec"]["frontend-address"]["port"])
                     for entry in cilium.api_get(agent.socket_path, "/v1/service")}
        # Cilium lists a NodePort once, on 0.0.0.0 (its maps expand it to the node's addresses).
        assert {f"{CLUSTER_IP}:{SERVICE_PORT}", f"0.0.0.0:{NODE_PORT}"} <= frontends, frontends

        # The proxyshift agent's own reading of this agent, and the gate on it: Ok, replacing kube-proxy, the
        # Service in its table, and (seconds after health turned Ok) its host endpoint ready.
        asked = [frontend_key(CLUSTER_IP, SERVICE_PORT, "TCP")]
        facts = read_replacement(CiliumAPI(agent.socket_path), asked)
        deadline = time.monotonic() + 120
        while facts.host_endpoint != "ready" and time.monotonic() < deadline:
            time.sleep(0.2)
            facts = read_replacement(CiliumAPI(agent.socket_path), asked)
        print(f"host endpoint ready {time.monotonic() - test_start:.1f}s after the agent's start")
        assert facts.host_endpoint == "ready" and facts.error is None, facts
        verdict = evaluate_replacement_gate(facts, GateSettings(), "Cilium", 1, None)
        assert verdict.passed, verdict

        # A client of the node (its cgroup and netns) reaches the pod's listener through both Services.
        cluster_ip = cilium.dial(agent.cgroup, node.name, CLUSTER_IP, SERVICE_PORT)
        assert (cluster_ip.outcome, cluster_ip.payload) == ("answered", pod), cluster_ip
        node_port = cilium.dial(agent.cgroup, node.name, NODE_IP, NODE_PORT)
        assert (node_port.outcome, node_port.payload) == ("answered", pod), node_port
        # The same connect from the node's netns but the host's cgroup is not translated: socket-LB
        # is confined to the node's cgroup (and the ClusterIP is routed nowhere in the node).
        bare = run_in_netns(node.name, dial_tcp, CLUSTER_IP, SERVICE_PORT, 3.0)
        assert bare.outcome != "answered", bare
        # From outside the node, the NodePort is served by the tc programs on its eth0.
        external = run_in_netns(outside.name, dial_tcp, NODE_IP, NODE_PORT, 5.0)
        assert (external.outcome, external.payload) == ("answered", pod), external
    finally:
        print(f"cilium-agent log tail:\n{agent.log_tail(15)}")
        agent.stop()

    # After the stop: no process, no cgroup, no mount, no program left; the node's netns is the fixture's.
    assert not Path(f"/proc/{agent_pid}").exists()
    assert not agent.cgroup.exists()
    assert not agent.workdir.exists()
    assert _mounts() == mounts_before
    after = bpf_attach.host_snapshot(cgroup_root)
    assert after == before, after
    node.delete()
    run(["ip", "netns", "del", pod], check=False)
    # The programs the agent attached (ids, so another user's programs never count) are freed once
    # their cgroup, their links' namespace and the agent's bpffs are gone.
    deadline = time.monotonic() + 30
    while (leftover := agent_programs & _program_ids()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftover, f"programs of the agent still loaded: {sorted(leftover)}"
    print(f"test wall time {time.monotonic() - test_start:.1f}s")


def test_launcher_refuses_to_start_the_agent_at_the_hosts_root_cgroup(netns: Netns) -> None:
    # The guard the confinement rests on: given the machine's root cgroup for the node's, the launcher
    # must not exec (the command here would only have printed).
    result = run([sys.executable, "-m", "localcluster.cilium", "confine", "--cgroup", str(cilium.cgroup2_mount()),
                  "--netns", netns.name, "--", "/bin/echo", "started"], check=False, timeout=30)
    assert result.returncode == 1, result
    assert "started" not in result.stdout
    assert "is the host's root cgroup" in result.stderr
