"""The staged rollout iptables -> ipvs (rr, then an edit to wrr) -> nftables on a node in the QEMU guest.

The local cluster's control plane, the operator and the host pools (blue, green) run on the host as
always; one more node, pool `vm`, runs in a QEMU guest with a stock Debian kernel (IPVS), joined to
the cluster bridge by a tap device (localcluster.vmnodes, docs/localcluster.md "Nodes in the guest").
One policy moves pool vm node by node through the three modes while a continuous ClusterIP probe runs
from a host node (green) and from the guest node. After each stage: the node's /proxyMode, no kernel
object of the modes it left (kube-proxy's chains, kube-ipvs0, KUBE-* ipsets, IPVS virtual servers),
the agent's own leftovers empty, the policy Ready. The host pool loses no connection.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from vm_layer import VM_E2E_SUMMARY_KEY
from vm_node_checks import Stages, agent_leftovers, guest_cluster, ipvs_services, left, observed_mode, proxy_mode

from localcluster import network, workloads
from localcluster.vmnodes import VmNodes, VmNodesError
from tests.support.operator_harness import Harness, policy

pytestmark = pytest.mark.vm

VM_POOL = "vm"
POLICY = "vm-staged"
# Every step of a node (preflight, switch, gate, cleanup) has gate.timeout. In the guest the real
# kube-proxy's first ipvs sync took 23-64 s and each agent operation several seconds (docs/localcluster.md).
GATE_TIMEOUT = "5m"
STAGE_TIMEOUT = 600.0
NODE_UP_TIMEOUT = 300.0
# The behaviour probe's time on one node (default 1 s, attempts 0.25 s each): a Python client in the
# guest needed up to 1.9 s for four cells, and the pod path missed the default budget before the switch.
BEHAVIOUR_BUDGET = 10
# Nodes of pool vm in the guest (each one kube-proxy, agent, probe server and simulator more in 2 vCPUs
# of emulation); the stages run them one at a time (maxUnavailable 1).
GUEST_NODES = int(os.environ.get("PROXYSHIFT_VM_E2E_NODES", "1"))


@pytest.mark.timeout(2400)
def test_staged_iptables_ipvs_wrr_nftables_with_nodes_in_the_guest(
        cluster: Any, harness: Harness, test_service: Any, wait_for: Callable[..., Any],
        request: pytest.FixtureRequest) -> None:
    h = harness
    info, first = guest_cluster(cluster)
    plan = [(first + i, VM_POOL) for i in range(GUEST_NODES)]
    nodes = [network.node_name(i) for i, _ in plan]
    other = cluster.nodes[-1]  # green, on the host
    ip, port = test_service.cluster_ip, test_service.port
    run = Stages(h, POLICY, STAGE_TIMEOUT, "vm staged", request)

    host = with_guest = None
    with VmNodes(info, plan) as guest:
        run.timings["guest up"] = guest.boot_seconds
        run.say(f"guest nodes {', '.join(nodes)} up in {guest.boot_seconds:.1f}s (guest clock "
                f"{guest.clock_offset:+.2f}s against the host's)")
        for node in nodes:
            wait_for(lambda node=node: observed_mode(h, node) == "iptables", NODE_UP_TIMEOUT,
                     f"{node}'s agent to report iptables")
            wait_for(lambda node=node: guest.tcp_probe(node, ip, port, 1).failed == 0, NODE_UP_TIMEOUT,
                     f"{ip}:{port} to answer from {node}")
            assert proxy_mode(guest, node) == "iptables"
        run.timings["nodes ready"] = run.elapsed()
        run.say("kube-proxy (iptables) and agent ready on the guest's nodes; probes start")
        host_prober = workloads.ContinuousProber(other, ip, port).start()
        for node in nodes:
            guest.start_prober(node, ip, port, interval=0.1)
        try:
            run.stage("iptables -> ipvs rr", lambda: h.apply(policy(
                POLICY, "ipvs", pool=VM_POOL, ipvs={"scheduler": "rr"}, rollout={"maxUnavailable": 1},
                gate={"timeout": GATE_TIMEOUT, "minSyncs": 1, "behaviour": {"budgetSeconds": BEHAVIOUR_BUDGET}},
                deletionPolicy="Orphan")))
            for node in nodes:
                assert proxy_mode(guest, node) == "ipvs"
                services = ipvs_services(guest, node)
                assert any(f" {ip}:{port} " in f"{s} " and "-s rr" in s for s in services), services
                assert left(guest, node, "ipvs") == {}, f"iptables mode's objects left on {node}"
                assert agent_leftovers(h, node) == []

            run.stage("ipvs rr -> wrr", lambda: h.patch(POLICY, {"spec": {"ipvs": {"scheduler": "wrr"}}}))
            for node in nodes:
                assert proxy_mode(guest, node) == "ipvs"
                services = ipvs_services(guest, node)
                assert any(f" {ip}:{port} " in f"{s} " and "-s wrr" in s for s in services), services
                assert not any(s.endswith(" -s rr") or " -s rr " in s for s in services), services
                assert agent_leftovers(h, node) == []

            run.stage("ipvs -> nftables", lambda: h.patch(POLICY, {"spec": {"mode": "nftables", "ipvs": None}}))
            for node in nodes:
                assert proxy_mode(guest, node) == "nftables"
                assert left(guest, node, "nftables") == {}, f"iptables or ipvs mode's objects left on {node}"
                assert agent_leftovers(h, node) == []
            assert h.proxy_mode(other) == "iptables", "the host pool was not touched"
        finally:
            host = host_prober.stop()
            run.say(f"traffic to {ip}:{port} from {other} (green, host): {host.ok} ok, {host.failed} failed "
                    f"{dict(host.errors)}")
            with_guest = {}
            for node in nodes:
                try:
                    with_guest[node] = counts = guest.stop_prober(node)
                except VmNodesError as exc:  # the guest is gone: the test's own failure says why
                    run.say(f"no traffic count from {node}: {exc}")
                    continue
                run.say(f"traffic to {ip}:{port} from {node} (vm, switched): {counts.ok} ok, "
                        f"{counts.failed} failed {counts.errors}")
    total = run.elapsed()
    summary = (f"staged iptables -> ipvs rr -> wrr -> nftables, {len(nodes)} node(s) in the guest: {total:.0f} s ("
               + run.summary() + "); "
               + ", ".join(f"{n}: {c.ok} ok / {c.failed} failed" for n, c in with_guest.items())
               + f"; {other} (host): {host.ok} ok / {host.failed} failed connections")
    request.config.stash[VM_E2E_SUMMARY_KEY] = summary
    run.say(summary)
    assert host.ok > 0 and host.failed == 0, f"the host pool lost connections: {dict(host.errors)}"
    assert all(c.ok > 0 for c in with_guest.values()), "no connection from a switched node succeeded"
