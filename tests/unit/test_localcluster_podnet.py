"""The pod network's addressing (podnet) and the UDP half of the test listener: pure, no root."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from localcluster import listener, network, paths, podnet
from localcluster.nodesim import config, podspec
from localcluster.nodesim import pod as sim_pod

pytestmark = pytest.mark.unit

NODE_INDICES = st.integers(min_value=1, max_value=network.MAX_NODES)
TAKEN = {
    "nodes": ipaddress.IPv4Network("198.18.0.0/24"),
    "endpoints": ipaddress.IPv4Network("198.18.1.0/24"),
    "second addresses": podnet.SECOND_ADDRESS_NETWORK,
    "services": ipaddress.IPv4Network(paths.SERVICE_CIDR),
}


def test_every_node_index_has_a_pod_range() -> None:
    assert podnet.MAX_POD_NODES >= network.MAX_NODES
    assert podnet.pod_cidr(1) == ipaddress.IPv4Network("198.18.32.0/27")
    assert podnet.pod_cidr(2) == ipaddress.IPv4Network("198.18.32.32/27")
    assert podnet.pod_cidr(network.MAX_NODES) == ipaddress.IPv4Network("198.18.56.224/27")
    assert (podnet.pod_gateway(1), podnet.pod_ip(1), podnet.second_address(1)) == \
        ("198.18.32.1", "198.18.32.2", "198.18.2.11")
    for bad in (0, podnet.MAX_POD_NODES + 1):
        with pytest.raises(ValueError):
            podnet.pod_cidr(bad)


@given(NODE_INDICES)
def test_a_pod_range_collides_with_nothing_else_of_the_layout(index: int) -> None:
    cidr = podnet.pod_cidr(index)
    assert cidr.subnet_of(podnet.POD_RANGE) and cidr.subnet_of(ipaddress.IPv4Network(paths.CLUSTER_CIDR))
    # Inside the bridge's /16 (so kube-proxy's clusterCIDR counts pods as local) but on no one's link.
    assert cidr.subnet_of(ipaddress.IPv4Network(f"{paths.BRIDGE_ADDRESS}/{paths.BRIDGE_PREFIX}", strict=False))
    for what, network_ in TAKEN.items():
        assert not cidr.overlaps(network_), what
    pod, gateway = ipaddress.IPv4Address(podnet.pod_ip(index)), ipaddress.IPv4Address(podnet.pod_gateway(index))
    assert pod in cidr and gateway in cidr and pod != gateway


@given(NODE_INDICES, NODE_INDICES)
def test_pod_ranges_and_second_addresses_are_distinct_per_node(a: int, b: int) -> None:
    if a != b:
        assert not podnet.pod_cidr(a).overlaps(podnet.pod_cidr(b))
        assert podnet.second_address(a) != podnet.second_address(b)
    second = ipaddress.IPv4Address(podnet.second_address(a))
    assert second in podnet.SECOND_ADDRESS_NETWORK
    node = ipaddress.IPv4Address(network.node_ip(a))
    assert second != node and second.packed[-1] == node.packed[-1]  # same last octet: easy to read


def test_pod_namespace_is_found_with_its_node_but_is_not_a_node() -> None:
    netns = podnet.pod_netns("ps-node-3")
    assert netns == "ps-node-3-pod" and podnet.is_pod_netns(netns)
    # Teardown finds it by the node prefix; node enumeration (digits after the prefix) skips it.
    assert netns.startswith(network.NODE_PREFIX)
    assert not netns[len(network.NODE_PREFIX):].isdigit()


def test_host_gw_routes_point_each_pod_range_at_its_node() -> None:
    ips = {i: network.node_ip(i) for i in (1, 2, 3)}
    assert podnet.host_gw_routes([1, 2, 3], ips, skip=2) == [
        "route replace 198.18.32.0/27 via 198.18.0.11", "route replace 198.18.32.64/27 via 198.18.0.13"]
    assert podnet.host_gw_routes([], ips) == []


def test_field_refs_give_a_pod_its_pod_address_and_the_node_address_as_host() -> None:
    pod = {"metadata": {"name": "p", "namespace": "n"}, "spec": {"nodeName": "ps-node-1"}}
    assert podspec.field_value(pod, "status.podIP", "198.18.0.11", "198.18.32.2") == "198.18.32.2"
    assert podspec.field_value(pod, "status.hostIP", "198.18.0.11", "198.18.32.2") == "198.18.0.11"
    assert podspec.field_value(pod, "status.podIP", "198.18.0.11") == "198.18.0.11"  # hostNetwork


def test_udp_answer_names_the_endpoint_and_echoes_a_bounded_request() -> None:
    assert listener.udp_answer("ps-ep-2", b"q1") == b"ps-ep-2\nq1"
    big = listener.udp_answer("ps-ep-2", b"x" * 4000)
    assert big == b"ps-ep-2\n" + b"x" * listener.UDP_ECHO_LIMIT


def test_udp_answerer_answers_every_datagram_on_loopback() -> None:
    async def exchange() -> list[bytes]:
        loop = asyncio.get_running_loop()
        server, _ = await loop.create_datagram_endpoint(lambda: listener.UDPAnswerer("ps-ep-9"),
                                                        local_addr=("127.0.0.1", 0))
        port = server.get_extra_info("sockname")[1]
        answers: asyncio.Queue[bytes] = asyncio.Queue()

        class Client(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: object) -> None:
                answers.put_nowait(data)

        client, _ = await loop.create_datagram_endpoint(Client, remote_addr=("127.0.0.1", port))
        try:
            got = []
            for request in (b"a", b"b"):
                client.sendto(request)
                got.append(await asyncio.wait_for(answers.get(), 2))
            return got
        finally:
            client.close()
            server.close()

    assert asyncio.run(exchange()) == [b"ps-ep-9\na", b"ps-ep-9\nb"]


def _worker(host_network: bool | None, pod_netns: str = "ps-node-1-pod", *, ports: tuple[int, ...] = (),
            name: str = "p", sim: object | None = None) -> sim_pod.PodWorker:
    cfg = config.SimConfig(node="ps-node-1", node_ip="198.18.0.11", pool="p", kubeconfig=Path("k"),
                            bin_dir=Path("b"), state_dir=Path("/nonexistent"), api_host="198.18.0.1", api_port=6443,
                            kubelet_version="v1.37.2", backoff_base=1.0, backoff_max=2.0, pod_netns=pod_netns,
                            pod_ip="198.18.32.2" if pod_netns else "")
    container = {"name": "c", "image": "x", "ports": [{"containerPort": p} for p in ports]}
    spec: dict[str, object] = {"nodeName": "ps-node-1", "containers": [container]}
    if host_network is not None:
        spec["hostNetwork"] = host_network
    pod = {"metadata": {"name": name, "namespace": "n", "uid": f"{name}-0123456789"}, "spec": spec}
    sim = sim or SimpleNamespace(cfg=cfg, workers={})
    worker = sim_pod.PodWorker(sim, pod)  # type: ignore[arg-type]  # sim: a stand-in with cfg and workers
    sim.workers[worker.uid] = worker  # type: ignore[attr-defined]  # as above
    return worker


def _running(worker: sim_pod.PodWorker) -> sim_pod.PodWorker:
    worker.runs[0].proc = SimpleNamespace(poll=lambda: None)  # type: ignore[assignment]  # a process still running
    return worker


def test_a_port_taken_in_the_shared_pod_namespace_is_refused_with_a_reason() -> None:
    sim = SimpleNamespace(cfg=_worker(False).cfg, workers={})
    operator = _running(_worker(False, ports=(8080, 8081), name="operator", sim=sim))
    _running(_worker(True, ports=(9090,), name="agent", sim=sim))  # hostNetwork: its own (the node's) namespace
    probe = _worker(False, ports=(8081, 9090), name="probe", sim=sim)
    with pytest.raises(podspec.PodError, match=r"8081/TCP already declared by pod n/operator") as err:
        probe._check_shared_ports()
    assert err.value.reason == "PortConflict"
    _worker(False, ports=(9091,), name="other", sim=sim)._check_shared_ports()  # no overlap: fine
    operator.finished = True
    probe._check_shared_ports()  # the holder is gone


@pytest.mark.parametrize(("host_network", "netns", "ip"), [
    (True, "ps-node-1", "198.18.0.11"),
    (False, "ps-node-1-pod", "198.18.32.2"),
    (None, "ps-node-1-pod", "198.18.32.2"),  # unset means false, as in the API
])
def test_a_pod_runs_in_the_namespace_its_host_network_says(host_network: bool | None, netns: str, ip: str) -> None:
    worker = _worker(host_network)
    assert (worker.netns, worker.pod_ip) == (netns, ip)


def test_without_a_pod_namespace_every_pod_runs_in_the_node() -> None:
    worker = _worker(False, pod_netns="")
    assert (worker.netns, worker.pod_ip) == ("ps-node-1", "198.18.0.11")


@pytest.mark.parametrize(("image", "command", "argv"), [
    ("ghcr.io/proxyshift/proxyshift:dev", ["proxyshift", "agent"], ["-m", "proxyshift.cli", "agent"]),
    ("ghcr.io/proxyshift/localcluster:dev", ["localcluster", "serve"], ["-m", "localcluster.cli", "serve"]),
    ("ghcr.io/proxyshift/localcluster:dev", [], ["-m", "localcluster.cli"]),
])
def test_each_python_image_runs_its_own_cli(image: str, command: list[str], argv: list[str]) -> None:
    worker = _worker(False)
    assert worker._argv({"name": "c", "image": image, "command": command}, {})[1:] == argv


def test_an_image_does_not_run_the_other_images_cli() -> None:
    worker = _worker(False)
    with pytest.raises(podspec.PodError, match="runs only the proxyshift CLI"):
        worker._argv({"name": "c", "image": "ghcr.io/proxyshift/proxyshift:dev", "command": ["localcluster"]}, {})
    with pytest.raises(podspec.PodError, match="runs only the localcluster CLI"):
        worker._argv({"name": "c", "image": "ghcr.io/proxyshift/localcluster:dev", "command": ["proxyshift"]}, {})

