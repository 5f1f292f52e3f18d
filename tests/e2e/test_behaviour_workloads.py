"""Issue 13, item 1 on the local cluster: every Service kind the behaviour gate judges, seen through
the baseline iptables kube-proxy from each node's own namespace (OUTPUT) and from its pod namespace
(PREROUTING), plus the pod network itself.

What kube-proxy 1.37's iptables mode does, read in pkg/proxy/iptables/proxier.go and asserted here:
no usable endpoint -> filter REJECT (refused); internalTrafficPolicy Local on a node without a
local endpoint -> filter DROP (timeout); externalTrafficPolicy Local is short-circuited to every
endpoint for traffic from the node (src-type LOCAL) and from pods (the clusterCIDR 198.18.0.0/16,
which covers every client address of this cluster), so from these two paths it answers everywhere;
NodePorts answer on every local address (nodePortAddresses unset) and on 127.0.0.1
(localhostNodePorts defaults to true: kube-proxy sets route_localnet).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from behaviour_observe import ATTEMPT_TIMEOUT, Cell, expected_problems, observe, table

from localcluster import behaviour_workloads, podnet, workloads
from localcluster.behaviour_workloads import BehaviourWorkloads
from localcluster.container import run_in_netns

pytestmark = pytest.mark.e2e

SYNC_TIMEOUT = 60.0
PODNET_POD = "ps-podnet-check"
PODNET_PORT = 9090


@pytest.fixture(scope="module")
def behaviour(cluster: Any, kube: Any) -> Iterator[BehaviourWorkloads]:
    state_dir = cluster.require_local("the behaviour workloads")
    made = behaviour_workloads.create(state_dir, kube, nodes=list(cluster.nodes))
    yield made
    behaviour_workloads.delete(kube, made.namespace)


@pytest.fixture(scope="module")
def matrix(behaviour: BehaviourWorkloads) -> list[Cell]:
    """The matrix once kube-proxy has synced every Service on every node (it must, within a minute)."""
    deadline = time.monotonic() + SYNC_TIMEOUT
    while True:
        cells = observe(behaviour)
        problems = expected_problems(behaviour, cells)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(1.0)  # also lets the ICMP rate limit (1/s per peer, burst 6) refill for the REJECTs
    print("\n" + table(cells))
    assert not problems, "\n".join(problems)
    return cells


def test_workloads_describe_every_kind(behaviour: BehaviourWorkloads, kube: Any) -> None:
    kinds = {s.name: s.kind for s in behaviour.services}
    assert set(kinds.values()) == {"ClusterIP", "NodePort", "Affinity", "InternalLocal", "ExternalLocal",
                                   "NoEndpoints", None}
    headless = behaviour.service("headless")
    assert headless.cluster_ip == "None"
    assert behaviour.service("nodeport-tcp").node_port == behaviour_workloads.NODE_PORT
    assert behaviour.service("external-local").node_port == behaviour_workloads.LOCAL_NODE_PORT
    # Local policies have endpoints on only some nodes: the last node has none.
    last = behaviour.nodes[-1].name
    assert behaviour.local_endpoints("internal-local", last) == ()
    assert all(behaviour.local_endpoints("internal-local", n.name) for n in behaviour.nodes[:-1])
    body = kube.get(f"/apis/discovery.k8s.io/v1/namespaces/{behaviour.namespace}/endpointslices/internal-local-1")
    for entry in body["endpoints"]:
        name = entry["targetRef"]["name"]
        assert entry["nodeName"] == behaviour.endpoint(name).node and entry["hostname"] == name
        assert entry["addresses"] == [behaviour.endpoint(name).ip]
    assert kube.get_or_none(
        f"/apis/discovery.k8s.io/v1/namespaces/{behaviour.namespace}/endpointslices/no-endpoints-1") is None
    slice_ = kube.get(f"/apis/discovery.k8s.io/v1/namespaces/{behaviour.namespace}/endpointslices/not-ready-1")
    assert [e["conditions"]["ready"] for e in slice_["endpoints"]] == [False]


def test_second_address_is_local_but_not_in_the_node_object(behaviour: BehaviourWorkloads, kube: Any,
                                                            node_exec: Any) -> None:
    for node in behaviour.nodes:
        listed = {a["address"] for a in kube.get(f"/api/v1/nodes/{node.name}")["status"]["addresses"]}
        assert node.ip in listed and node.second_address not in listed
        local = node_exec(node.name, ["ip", "-4", "-o", "route", "show", "table", "local"]).stdout
        assert f"local {node.second_address} " in local


def test_clusterip_tcp_and_udp_answer_from_node_and_pod(behaviour: BehaviourWorkloads, matrix: list[Cell]) -> None:
    every = {e.name for e in behaviour.endpoints}
    for name in ("clusterip-tcp", "clusterip-udp"):
        cells = [c for c in matrix if c.service == name]
        assert {(c.node, c.path) for c in cells} == {(n.name, p) for n in behaviour.nodes for p in ("node", "pod")}
        assert all(c.outcome == "answered" and set(c.endpoints) <= every and c.endpoints for c in cells), cells


def test_nodeport_answers_on_node_ip_second_address_and_localhost(behaviour: BehaviourWorkloads,
                                                                  matrix: list[Cell], kube: Any,
                                                                  node_exec: Any) -> None:
    config = yaml.safe_load(kube.get("/api/v1/namespaces/kube-system/configmaps/kube-proxy")["data"]["config.conf"])
    # Both unset: iptables mode then serves NodePorts on every local address and on 127.0.0.1.
    assert config.get("nodePortAddresses") is None and (config.get("iptables") or {}).get("localhostNodePorts") is None
    svc = behaviour.service("nodeport-tcp")
    for node in behaviour.nodes:
        assert node_exec(node.name, ["sysctl", "-n", "net.ipv4.conf.all.route_localnet"]).stdout.strip() == "1"
        seen = {(c.path, c.address): c.outcome for c in matrix if c.service == svc.name and c.node == node.name
                and c.port == svc.node_port}
        assert seen == {("node", node.ip): "answered", ("node", node.second_address): "answered",
                        ("node", "127.0.0.1"): "answered", ("pod", node.ip): "answered",
                        ("pod", node.second_address): "answered"}


def test_client_ip_affinity_sticks(behaviour: BehaviourWorkloads, matrix: list[Cell]) -> None:
    cells = [c for c in matrix if c.service == "affinity"]
    assert len(cells) == 2 * len(behaviour.nodes)
    assert all(c.outcome == "answered" and len(c.endpoints) == 1 for c in cells), cells
    # And it is affinity, not chance: the plain Service spreads the same number of connections.
    node = behaviour.nodes[0]
    spread = workloads.tcp_probe(node.name, behaviour.service("clusterip-tcp").cluster_ip or "", 80, 20,
                                 timeout=ATTEMPT_TIMEOUT)
    assert spread.failed == 0 and len(spread.served_by) > 1, spread


def test_internal_traffic_policy_local(behaviour: BehaviourWorkloads, matrix: list[Cell]) -> None:
    svc = behaviour.service("internal-local")
    for node in behaviour.nodes:
        local = set(behaviour.local_endpoints(svc.name, node.name))
        for path in ("node", "pod"):
            (cell,) = [c for c in matrix if c.service == svc.name and c.node == node.name and c.path == path]
            if local:
                assert cell.outcome == "answered" and set(cell.endpoints) <= local, cell
            else:
                assert cell.outcome == "timeout", cell  # DROP, not REJECT: "has no local endpoints"
    # Enough connections to see a non-local endpoint if kube-proxy ever picked one.
    first = behaviour.nodes[0]
    many = workloads.tcp_probe(first.pod_netns, svc.cluster_ip or "", svc.port, 12, timeout=ATTEMPT_TIMEOUT)
    assert many.failed == 0 and set(many.served_by) <= set(behaviour.local_endpoints(svc.name, first.name)), many


def test_external_traffic_policy_local_is_short_circuited_for_node_and_pod(behaviour: BehaviourWorkloads,
                                                                           matrix: list[Cell]) -> None:
    svc = behaviour.service("external-local")
    last = behaviour.nodes[-1]
    assert behaviour.local_endpoints(svc.name, last.name) == ()
    cells = [c for c in matrix if c.service == svc.name and c.port == svc.node_port]
    assert cells and all(c.outcome == "answered" for c in cells), cells
    # On the node with no local endpoint too: node and pod sources go to the cluster-wide endpoints.
    assert any(c.node == last.name and c.endpoints for c in cells)


def test_services_without_ready_endpoints_are_refused(matrix: list[Cell]) -> None:
    for name in ("not-ready", "no-endpoints"):
        cells = [c for c in matrix if c.service == name]
        assert cells and all(c.outcome == "refused" for c in cells), cells


def _prerouting_services_packets(node_exec: Any, node: str) -> int:
    """Packets counted on the nat PREROUTING jump to KUBE-SERVICES (one per new connection)."""
    out = node_exec(node, ["iptables-save", "-c", "-t", "nat"]).stdout
    for line in out.splitlines()[:10_000]:
        match = re.match(r"\[(\d+):\d+\] -A PREROUTING .*-j KUBE-SERVICES$", line)
        if match:
            return int(match.group(1))
    raise AssertionError(f"no PREROUTING jump to KUBE-SERVICES on {node}")


def test_pod_traffic_crosses_prerouting_and_node_traffic_does_not(behaviour: BehaviourWorkloads,
                                                                  matrix: list[Cell], node_exec: Any) -> None:
    node = behaviour.nodes[0]
    svc = behaviour.service("clusterip-tcp")
    before = _prerouting_services_packets(node_exec, node.name)
    assert workloads.tcp_probe(node.name, svc.cluster_ip or "", svc.port, 5, timeout=ATTEMPT_TIMEOUT).ok == 5
    after_node = _prerouting_services_packets(node_exec, node.name)
    assert workloads.tcp_probe(node.pod_netns, svc.cluster_ip or "", svc.port, 5, timeout=ATTEMPT_TIMEOUT).ok == 5
    after_pod = _prerouting_services_packets(node_exec, node.name)
    print(f"\nPREROUTING -> KUBE-SERVICES on {node.name}: +{after_node - before} for 5 node connections, "
          f"+{after_pod - after_node} for 5 pod connections")
    assert after_pod - after_node >= 5
    assert after_node - before < 5


def test_pod_namespace_has_no_default_route(behaviour: BehaviourWorkloads, node_exec: Any) -> None:
    for node in behaviour.nodes:
        routes = node_exec(node.name, ["ip", "-n", node.pod_netns, "-4", "route", "show"]).stdout
        assert "default" not in routes
        index = behaviour.nodes.index(node) + 1
        assert str(podnet.pod_cidr(index)) in routes and "198.18.0.0/15 via " in routes


@pytest.fixture
def podnet_pod(cluster: Any, kube: Any) -> Iterator[str]:
    node = cluster.nodes[0]
    path = "/api/v1/namespaces/default/pods"
    kube.post(path, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": PODNET_POD, "namespace": "default", "labels": {"app": PODNET_POD}},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "serve", "image": "ghcr.io/proxyshift/localcluster:dev",
            "command": ["localcluster", "serve", "--listen", f"0.0.0.0:{PODNET_PORT}"],
            "ports": [{"name": "http", "containerPort": PODNET_PORT}],
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1}}]}})
    kube.post("/api/v1/namespaces/default/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": PODNET_POD, "namespace": "default"},
        "spec": {"selector": {"app": PODNET_POD}, "ports": [{"port": 80, "targetPort": "http"}]}})
    yield node
    for obj in (f"/api/v1/namespaces/default/services/{PODNET_POD}", f"{path}/{PODNET_POD}"):
        kube.delete(obj)


def test_pod_without_host_network_runs_in_the_pod_namespace(cluster: Any, kube: Any, podnet_pod: str,
                                                            wait_for: Any, behaviour: BehaviourWorkloads) -> None:
    node = behaviour.node(podnet_pod)
    pod_path = f"/api/v1/namespaces/default/pods/{PODNET_POD}"

    def ready() -> Any:
        pod = kube.get(pod_path)
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod if conditions.get("Ready") == "True" else None

    # Ready means the simulator's readiness probe reached the pod's own address from the node.
    pod = wait_for(ready, 60, f"pod {PODNET_POD} Ready")
    assert pod["status"]["podIP"] == node.pod_ip and pod["status"]["podIPs"] == [{"ip": node.pod_ip}]
    assert pod["status"]["hostIP"] == node.ip
    other = behaviour.nodes[1]
    assert workloads.http_get(other.name, f"http://{node.pod_ip}:{PODNET_PORT}/") == (200, f"{PODNET_POD}\n")

    # A selector Service over the pod: the endpointslice controller lists the pod address, and a pod
    # on another node reaches it through its node, kube-proxy's DNAT and the host-gw routes.
    def service_ip() -> str | None:
        svc = kube.get(f"/api/v1/namespaces/default/services/{PODNET_POD}")
        slices = kube.get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
                          labelSelector=f"kubernetes.io/service-name={PODNET_POD}")["items"]
        addresses = [a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]]
        return svc["spec"]["clusterIP"] if addresses == [node.pod_ip] else None

    cluster_ip = wait_for(service_ip, 30, "the pod's address in its Service's EndpointSlice")

    def from_other_pod() -> tuple[int, str] | None:
        def get() -> tuple[int, str] | None:
            import http.client

            conn = http.client.HTTPConnection(cluster_ip, 80, timeout=1)
            try:
                conn.request("GET", "/")
                resp = conn.getresponse()
                return resp.status, resp.read().decode()
            except OSError:
                return None
            finally:
                conn.close()

        return run_in_netns(other.pod_netns, get)

    assert wait_for(from_other_pod, 30, "the pod's Service from another node's pod") == (200, f"{PODNET_POD}\n")


@pytest.fixture
def podnet_daemonset(kube: Any) -> Iterator[str]:
    """A DaemonSet shaped like the pod-network probe server's: proxyshift image, no hostNetwork,
    a readiness probe on its port (tcpSocket here; the pod test above covers httpGet)."""
    name, path = "ps-podnet-ds", "/apis/apps/v1/namespaces/default/daemonsets"
    labels = {"app": "ps-podnet-ds"}
    kube.post(path, {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
            "terminationGracePeriodSeconds": 1, "containers": [{
                "name": "serve", "image": "ghcr.io/proxyshift/localcluster:dev",
                "command": ["localcluster", "serve", "--listen", f"0.0.0.0:{PODNET_PORT + 1}"],
                "ports": [{"name": "probe", "containerPort": PODNET_PORT + 1}],
                "readinessProbe": {"tcpSocket": {"port": "probe"}, "periodSeconds": 1}}]}}}})
    yield name
    kube.delete(f"{path}/{name}")
    pods = kube.get("/api/v1/namespaces/default/pods", labelSelector="app=ps-podnet-ds")["items"]
    for pod in pods:
        with contextlib.suppress(Exception):
            kube.delete(f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}")


def test_daemonset_without_host_network_gets_each_node_s_pod_address(behaviour: BehaviourWorkloads, kube: Any,
                                                                     podnet_daemonset: str, wait_for: Any) -> None:
    def ready_pods() -> dict[str, dict[str, Any]] | None:
        pods = kube.get("/api/v1/namespaces/default/pods", labelSelector=f"app={podnet_daemonset}")["items"]
        ready = {p["spec"].get("nodeName"): p for p in pods
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])}
        return ready if set(ready) >= {n.name for n in behaviour.nodes} else None

    pods = wait_for(ready_pods, 90, f"DaemonSet {podnet_daemonset} Ready on every node")
    for node in behaviour.nodes:
        pod = pods[node.name]
        assert pod["status"]["podIP"] == node.pod_ip and pod["status"]["hostIP"] == node.ip
        # The agent (hostNetwork, in the node) reaches the probe server at its pod address.
        status, body = workloads.http_get(node.name, f"http://{node.pod_ip}:{PODNET_PORT + 1}/")
        assert (status, body) == (200, f"{pod['metadata']['name']}\n")


KUBE_PROXY_CM = "/api/v1/namespaces/kube-system/configmaps/kube-proxy"


def _set_baseline_mode(kube: Any, cluster: Any, mode: str) -> None:
    config = yaml.safe_load(kube.get(KUBE_PROXY_CM)["data"]["config.conf"])
    config["mode"] = mode
    kube.merge_patch(KUBE_PROXY_CM, {"data": {"config.conf": yaml.safe_dump(config, sort_keys=False)}})
    cluster.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/kube-proxy")
    cluster.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=180s", timeout=200)


def _modes(behaviour: BehaviourWorkloads) -> set[str]:
    modes = set()
    for node in behaviour.nodes:
        try:
            modes.add(workloads.http_get(node.name, "http://127.0.0.1:10249/proxyMode", timeout=1.0)[1].strip())
        except OSError as exc:
            modes.add(type(exc).__name__)
    return modes


def _key(cell: Cell) -> tuple[str, str, str, str, int, str]:
    return (cell.node, cell.path, cell.service, cell.address, cell.port, cell.protocol)


def _judged(cell: Cell) -> tuple[str, bool | None]:
    """What the gate compares: the outcome and, with affinity, stickiness (not which endpoint)."""
    return cell.outcome, (len(cell.endpoints) == 1) if cell.service == "affinity" else None


def test_the_bed_shows_what_nftables_changes(behaviour: BehaviourWorkloads, matrix: list[Cell], kube: Any,
                                             cluster: Any, wait_for: Any) -> None:
    """The differences the gate must catch are real here: with the baseline switched to nftables
    (nodePortAddresses unset), NodePorts stop answering on 127.0.0.1 and on the second address,
    and every other cell of the matrix stays as it was."""
    before = {_key(c): c for c in matrix}
    nodeports = {s.node_port for s in behaviour.services if s.node_port}
    expected = {k for k, c in before.items() if c.port in nodeports and
                (c.address == "127.0.0.1" or c.address in {n.second_address for n in behaviour.nodes})}
    try:
        _set_baseline_mode(kube, cluster, "nftables")
        wait_for(lambda: _modes(behaviour) == {"nftables"}, 90, "/proxyMode nftables on every node")
        deadline = time.monotonic() + SYNC_TIMEOUT
        while True:
            after = {_key(c): c for c in observe(behaviour)}
            changed = {k for k in before if _judged(before[k]) != _judged(after[k])}
            problems = expected_problems(behaviour, list(after.values()), "nftables")
            if (changed == expected and not problems) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        print("\ncells nftables changed:\n" + table([after[k] for k in sorted(changed)]))
        assert changed == expected, (f"unexpected: {sorted(changed - expected)}; "
                                     f"unchanged but expected to change: {sorted(expected - changed)}")
        assert not problems, "\n".join(problems)
        assert all(after[k].outcome != "answered" for k in expected)
    finally:
        _set_baseline_mode(kube, cluster, "iptables")
        wait_for(lambda: _modes(behaviour) == {"iptables"}, 90, "/proxyMode back to iptables on every node")
