"""The behaviour probe against real namespaces and real netfilter rules (no cluster).

The topology (behaviour_topology.py) has a node with hand-written kube-proxy-shaped iptables rules,
two endpoints answering their names, and a pod behind the node with a veth, so pod traffic crosses
the node's PREROUTING chain as it does on a real node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import behaviour_topology as bt
import pytest

from proxyshift.agent.behaviour import run_behaviour
from proxyshift.api.behaviour import BehaviourCell, BehaviourMatrix, BehaviourParams, BehaviourTarget
from proxyshift.commands import Result, ToolMissingError, run
from tests.support.ps_netns import need_root

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def topo() -> Iterator[bt.Topology]:
    need_root()
    topology = bt.build()
    try:
        yield topology
    finally:
        topology.close()


@pytest.fixture(scope="module")
def pod_probe(topo: bt.Topology) -> str:
    return topo.start_probe_server()


def target(service: str, address: str | None, port: int = 80, **kw: Any) -> BehaviourTarget:
    return BehaviourTarget(service=service, kind=kw.pop("kind", "ClusterIP"), address=address, port=port, **kw)


def probe(topo: bt.Topology, targets: list[BehaviourTarget], *, runner: Callable[..., Result] | None = None,
          **kw: Any) -> BehaviourMatrix:
    # Plain `run`, as the agent has it: the tools start from the probe's thread, which is in the node.
    params = BehaviourParams(targets=targets, node_ips=[bt.NODE_IP], **kw)
    return topo.in_node(run_behaviour, params, mode="iptables", runner=runner or run)


def cells(matrix: BehaviourMatrix, service: str, path: str = "node") -> list[BehaviourCell]:
    return [c for c in matrix.cells if c.service == service and c.path == path]


def test_outcomes_are_classified(topo: bt.Topology) -> None:
    m = probe(topo, [target("d/tcp", bt.SVC_TCP), target("d/udp", bt.SVC_UDP, 53, protocol="UDP"),
                     target("d/none", bt.SVC_NO_ENDPOINTS, kind="NoEndpoints"), target("d/dead", bt.SVC_DEAD),
                     target("d/udp-none", bt.SVC_UDP, 54, protocol="UDP")])
    outcome = {c.service: c.outcome for c in m.cells}
    # d/udp-none: no rule, routed to ep-a's link and dropped there: a UDP request nobody answers.
    assert outcome == {"d/tcp": "answered", "d/udp": "answered", "d/none": "refused", "d/dead": "timeout",
                       "d/udp-none": "timeout"}, m.cells
    assert all(c.path == "node" and c.address_role == "clusterIP" for c in m.cells)
    assert m.mode == "iptables" and not m.truncated and m.pod_path_error is None


def test_udp_refused_is_icmp_port_unreachable(topo: bt.Topology) -> None:
    # The node's own address, a port nobody listens on: the kernel answers ICMP port unreachable.
    m = probe(topo, [target("d/udp-closed", bt.NODE_IP, 5999, protocol="UDP")])
    assert [c.outcome for c in m.cells] == ["refused"], m.cells


def test_identity_is_the_dnat_target_from_conntrack(topo: bt.Topology) -> None:
    m = probe(topo, [target("d/udp", bt.SVC_UDP, 53, protocol="UDP"), target("d/tcp", bt.SVC_TCP, attempts=8),
                     target("d/np", None, bt.NODE_PORT, kind="NodePort")])
    assert cells(m, "d/udp")[0].endpoints == [bt.EP_A]
    assert set(cells(m, "d/tcp")[0].endpoints) <= {bt.EP_A, bt.EP_B} and cells(m, "d/tcp")[0].endpoints
    nodeports = {c.address: c for c in cells(m, "d/np")}
    assert set(nodeports) == {bt.NODE_IP, *bt.NODE_OTHER, "127.0.0.1"}
    for address in (bt.NODE_IP, *bt.NODE_OTHER):
        assert nodeports[address].endpoints == [bt.EP_A], nodeports[address]
    assert nodeports[bt.NODE_IP].address_role == "nodeIP"
    assert {nodeports[a].address_role for a in bt.NODE_OTHER} == {"otherAddress"}
    # The rules leave 127.0.0.1 out (as nftables mode does): nothing listens there.
    assert nodeports["127.0.0.1"].address_role == "localhost" and nodeports["127.0.0.1"].outcome == "refused"


def test_identity_falls_back_to_the_payload_without_conntrack(topo: bt.Topology) -> None:
    def no_conntrack(argv: Sequence[str], **kw: Any) -> Result:
        if argv[0] == "conntrack":
            raise ToolMissingError(argv, "not found on PATH")
        return run(argv, **kw)

    m = probe(topo, [target("d/udp", bt.SVC_UDP, 53, protocol="UDP"),
                     target("d/np", None, bt.NODE_PORT, kind="NodePort", local_endpoints=[bt.EP_A])],
              runner=no_conntrack)
    assert cells(m, "d/udp")[0].endpoints == ["ep-a"]
    np_cell = next(c for c in cells(m, "d/np") if c.address == bt.NODE_IP)
    # A name is no address: locality is left unjudged rather than judged wrong.
    assert np_cell.endpoints == ["ep-a"] and np_cell.local is None and "locality not judged" in np_cell.detail


def test_stickiness_with_clientip_affinity_and_without(topo: bt.Topology) -> None:
    affinity = probe(topo, [target("d/aff", bt.SVC_AFFINITY, kind="Affinity", attempts=8)])
    assert affinity.cells[0].sticky is True and len(affinity.cells[0].endpoints) == 1, affinity.cells
    # Random choice over two endpoints: 8 in a row on one has odds 1/128; three probes all sticky, 1/2M.
    plain = [probe(topo, [target("d/tcp", bt.SVC_TCP, attempts=8)]).cells[0] for _ in range(3)]
    assert any(c.sticky is False for c in plain), plain
    assert all(c.outcome == "answered" for c in plain)


def test_locality(topo: bt.Topology) -> None:
    m = probe(topo, [target("d/np", None, bt.NODE_PORT, kind="ExternalLocal", local_endpoints=[bt.EP_A]),
                     target("d/tcp", bt.SVC_TCP, kind="InternalLocal", attempts=8, local_endpoints=[bt.EP_A])])
    assert all(c.local is True for c in cells(m, "d/np") if c.outcome == "answered")
    assert cells(m, "d/np")
    # ep-b is not local: 8 random picks over two endpoints reach it with odds 127/128; try three times.
    tcp = [cells(m, "d/tcp")[0]] + [
        cells(probe(topo, [target("d/tcp", bt.SVC_TCP, attempts=8, local_endpoints=[bt.EP_A])]), "d/tcp")[0]
        for _ in range(2)]
    assert any(c.local is False for c in tcp), tcp


def test_budget_holds_for_twenty_targets_with_dead_ones(topo: bt.Topology) -> None:
    targets = [target(f"d/dead{i}", bt.SVC_DEAD) for i in range(8)]
    targets += [target(f"d/tcp{i}", bt.SVC_TCP, attempts=2) for i in range(8)]
    targets += [target(f"d/none{i}", bt.SVC_NO_ENDPOINTS) for i in range(2)]
    targets += [target(f"d/np{i}", None, bt.NODE_PORT, kind="NodePort") for i in range(2)]
    started = time.monotonic()
    m = probe(topo, targets)
    wall = time.monotonic() - started
    print(f"\n20 targets, {len(m.cells)} cells, 8 dead: probe {m.duration_seconds:.3f} s, wall {wall:.3f} s")
    assert wall < 1.5 and m.duration_seconds is not None and m.duration_seconds <= 1.05
    assert {c.outcome for c in m.cells if c.service.startswith("d/dead")} == {"timeout"}
    assert {c.outcome for c in m.cells if c.service.startswith("d/tcp")} == {"answered"}


def test_budget_cuts_and_says_so(topo: bt.Topology) -> None:
    targets = [target(f"d/dead{i}", bt.SVC_DEAD, attempts=8) for i in range(4)]
    started = time.monotonic()
    m = probe(topo, targets, budget_seconds=0.4)
    wall = time.monotonic() - started
    assert m.truncated and wall < 0.7, (m.truncated, wall)


def test_pod_path_crosses_prerouting(topo: bt.Topology, pod_probe: str) -> None:
    before = topo.counter("nat", "PREROUTING", "-i veth-pod")
    m = probe(topo, [target("d/udp", bt.SVC_UDP, 53, protocol="UDP"), target("d/aff", bt.SVC_AFFINITY,
                                                                              kind="Affinity", attempts=4),
                     target("d/none", bt.SVC_NO_ENDPOINTS, kind="NoEndpoints"),
                     target("d/np", None, bt.NODE_PORT, kind="NodePort")], pod_probe=pod_probe)
    after = topo.counter("nat", "PREROUTING", "-i veth-pod")
    pod = [c for c in m.cells if c.path == "pod"]
    assert m.pod_path_error is None
    # nat sees a flow's first packet: one per new flow from the pod.
    print(f"\npod cells {len(pod)}; PREROUTING -i veth-pod counted {after - before} new flows")
    assert after - before >= len(pod) + 3  # the affinity cell made 4 flows
    by = {(c.service, c.address): c for c in pod}
    assert by[("d/udp", bt.SVC_UDP)].endpoints == [bt.EP_A]  # named by the node's conntrack, not the payload
    assert by[("d/aff", bt.SVC_AFFINITY)].sticky is True
    assert by[("d/none", bt.SVC_NO_ENDPOINTS)].outcome == "refused"
    assert not any(c.address_role == "localhost" for c in pod)  # a pod's 127.0.0.1 is its own
    assert {c.address for c in pod if c.service == "d/np"} == {bt.NODE_IP, *bt.NODE_OTHER}


def test_pod_path_error_keeps_the_node_cells(topo: bt.Topology) -> None:
    m = probe(topo, [target("d/udp", bt.SVC_UDP, 53, protocol="UDP")], pod_probe=f"{bt.POD_IP}:9")
    assert m.pod_path_error and "probe server" in m.pod_path_error
    assert [(c.path, c.outcome) for c in m.cells] == [("node", "answered")]


def test_the_one_shot_commands_for_a_person(topo: bt.Topology) -> None:
    env = {**os.environ, "PYTHONPATH": str(bt.ROOT / "operator")}
    params = BehaviourParams(targets=[target("d/udp", bt.SVC_UDP, 53, protocol="UDP"),
                                      target("d/none", bt.SVC_NO_ENDPOINTS, kind="NoEndpoints")])
    done = subprocess.run(["ip", "netns", "exec", topo.node.name, sys.executable, "-m", "proxyshift.cli", "agent",
                           "behaviour", "--params", params.model_dump_json(by_alias=True)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    matrix = BehaviourMatrix.model_validate(json.loads(done.stdout))
    assert [(c.service, c.outcome, c.endpoints) for c in matrix.cells] == [
        ("d/udp", "answered", [bt.EP_A]), ("d/none", "refused", [])]
    done = subprocess.run(["ip", "netns", "exec", topo.node.name, sys.executable, "-m", "proxyshift.cli", "agent",
                           "conntrack", "--service-cidr", bt.SERVICE_CIDR], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deletedTcp"] == 0
