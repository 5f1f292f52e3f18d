"""Issue 3's "Show" list on the local cluster: real control plane, three network-namespace nodes,
the baseline kube-proxy DaemonSet placed by the real scheduler and run by the node simulator.

Order matters inside this module: the nftables test switches the baseline and
switches it back; the `down` test is moved to the very end of the session by
tests/conftest.py (marker `localcluster_down`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import network, podnet
from localcluster.nodesim import volumes
from proxyshift.commands import run

pytestmark = pytest.mark.e2e

NODES = ["ps-node-1", "ps-node-2", "ps-node-3"]
POOLS = {"ps-node-1": "blue", "ps-node-2": "blue", "ps-node-3": "green"}
PROXY_MODE_URL = "http://127.0.0.1:10249/proxyMode"
DS_PATH = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy"
CM_PATH = "/api/v1/namespaces/kube-system/configmaps/kube-proxy"


@pytest.fixture(autouse=True)
def _local_cluster_only(cluster: Any) -> None:
    # Every test here is about the local cluster's own nodes (ps-node-*, their namespaces).
    cluster.require_local("this local-cluster test")


def kube_proxy_pods(kube: Any) -> dict[str, dict[str, Any]]:
    """node -> the live (not terminating) kube-proxy pod on it."""
    pods = kube.get("/api/v1/namespaces/kube-system/pods", labelSelector="k8s-app=kube-proxy")["items"]
    return {p["spec"]["nodeName"]: p for p in pods
            if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")}


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def container_pid(cluster: Any, pod: dict[str, Any], container: str = "kube-proxy") -> int | None:
    """The pid the node simulator recorded for a container (None when it is not running)."""
    meta = pod["metadata"]
    return network.container_pid(cluster.state_dir, pod["spec"]["nodeName"], meta["namespace"], meta["name"],
                                 container)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def proxy_modes(node_http_get: Any) -> dict[str, str]:
    modes = {}
    for node in NODES:
        try:
            status, body = node_http_get(node, PROXY_MODE_URL)
            modes[node] = body.strip() if status == 200 else f"HTTP {status}"
        except OSError as exc:
            modes[node] = f"{type(exc).__name__}"
    return modes


def set_mode(kube: Any, cluster: Any, mode: str) -> None:
    """Switch the baseline ConfigMap's mode and `kubectl rollout restart` the DaemonSet."""
    config = yaml.safe_load(kube.get(CM_PATH)["data"]["config.conf"])
    config["mode"] = mode
    kube.merge_patch(CM_PATH, {"data": {"config.conf": yaml.safe_dump(config, sort_keys=False)}})
    cluster.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/kube-proxy")
    cluster.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=180s",
                    timeout=200)


def assert_connections_from_every_node(tcp_probe: Any, service: Any, count: int = 20) -> None:
    for node in NODES:
        result = tcp_probe(node, service.cluster_ip, service.port, count)
        assert result.failed == 0, f"{node} -> {service.cluster_ip}:{service.port}: {result}"
        # kube-proxy spreads connections at random: 20 tries all on one of two endpoints is ~2e-6.
        assert set(result.served_by) == set(service.endpoints), f"{node}: {result.served_by}"


def test_three_nodes_ready_in_their_pools(cluster: Any, kube: Any) -> None:
    nodes = {n["metadata"]["name"]: n for n in kube.get("/api/v1/nodes")["items"]}
    assert set(NODES) <= set(nodes)
    for name in NODES:
        node = nodes[name]
        assert node["metadata"]["labels"]["pool"] == POOLS[name]
        assert node["metadata"]["labels"]["kubernetes.io/os"] == "linux"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", f"{name} is not Ready"
        # The not-ready taint admission puts on new nodes is lifted: ordinary pods schedule here.
        assert not node["spec"].get("taints"), node["spec"]["taints"]
        ip = network.node_ip(network.node_index(name))
        assert {"type": "InternalIP", "address": ip} in node["status"]["addresses"]
        lease = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}")
        assert lease["spec"]["holderIdentity"] == name


def test_baseline_kube_proxy_ready_on_every_node(cluster: Any, kube: Any, wait_for: Any) -> None:
    def all_ready() -> bool:
        status = kube.get(DS_PATH)["status"]
        return status.get("desiredNumberScheduled") == 3 and status.get("numberReady") == 3

    wait_for(all_ready, 120, "the kube-proxy DaemonSet Ready on 3 nodes")
    pods = kube_proxy_pods(kube)
    assert sorted(pods) == NODES
    for node, pod in pods.items():
        assert is_ready(pod) and pod["status"]["phase"] == "Running"
        assert pod["status"]["podIP"] == network.node_ip(network.node_index(node))
        # Placed by the real scheduler: the DaemonSet controller leaves nodeName empty and
        # the scheduler's binding sets it and the PodScheduled condition.
        assert pod["spec"]["schedulerName"] == "default-scheduler"
        scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert scheduled and scheduled[0]["status"] == "True"
        events = kube.get("/apis/events.k8s.io/v1/namespaces/kube-system/events",
                          fieldSelector=f"regarding.name={pod['metadata']['name']}")["items"]
        assert any(e.get("reason") == "Scheduled" and e.get("reportingController") == "default-scheduler"
                   for e in events), f"no Scheduled event from default-scheduler for {pod['metadata']['name']}"
        # ... and run by the simulator, as the real binary inside that node's namespace.
        pid = container_pid(cluster, pod)
        assert pid is not None
        assert Path(f"/proc/{pid}/exe").resolve().name == "kube-proxy"
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{node}").st_ino
        # Its service-account token came from the TokenRequest API, bound to this pod on this node.
        claims = token_claims(cluster, pod)["kubernetes.io"]
        assert claims["pod"] == {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        assert claims["node"]["name"] == node
        assert claims["serviceaccount"]["name"] == "kube-proxy"
        # `kubectl logs` reaches the simulator's slice of the kubelet API inside the node.
        logs = cluster.kubectl("-n", "kube-system", "logs", pod["metadata"]["name"], "--tail=200").stdout
        assert "kube-proxy" in logs or "proxier" in logs, logs[-500:]


def token_claims(cluster: Any, pod: dict[str, Any]) -> dict[str, Any]:
    """The claims of the projected token the simulator wrote for a pod (no signature check needed)."""
    meta = pod["metadata"]
    pod_dir = (network.node_dir(cluster.state_dir, pod["spec"]["nodeName"]) / "pods" /
               f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}")
    (token_file,) = pod_dir.glob("volumes/kube-api-access-*/token")
    payload = token_file.read_text().split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_proxy_mode_is_iptables_on_every_node(node_http_get: Any, wait_for: Any) -> None:
    wait_for(lambda: set(proxy_modes(node_http_get).values()) == {"iptables"}, 60,
             "/proxyMode to answer iptables on every node")


def test_clusterip_connections_from_every_node(test_service: Any, tcp_probe: Any, wait_for: Any) -> None:
    # kube-proxy programs a new Service within its sync period; wait for the first success.
    wait_for(lambda: all(tcp_probe(n, test_service.cluster_ip, test_service.port, 1).ok for n in NODES), 60,
             f"{test_service.cluster_ip} reachable from every node")
    assert_connections_from_every_node(tcp_probe, test_service)


def test_many_services_through_real_rules(cluster: Any, kube: Any, test_service: Any, wait_for: Any) -> None:
    """A hundred Services over the same two listeners, each reachable by its own ClusterIP."""
    from localcluster import workloads

    endpoints = [workloads.Endpoint(name, network.endpoint_ip(int(name.rsplit("-", 1)[1])), (8080,))
                 for name in test_service.endpoints]
    started = time.monotonic()
    services = workloads.create_services(kube, endpoints, 100, prefix="ps-many")
    created = time.monotonic() - started
    try:
        assert len({s.cluster_ip for s in services}) == 100
        assert all(s.cluster_ip.startswith("198.19.") for s in services)

        def all_reachable() -> bool:
            results = workloads.tcp_probe_services("ps-node-3", services, 1, timeout=1.0)
            return all(r.ok == 1 for r in results.values())

        wait_for(all_reachable, 60, "all 100 ClusterIPs reachable from ps-node-3")
        print(f"\n100 Services + EndpointSlices created in {created:.1f}s")
    finally:
        workloads.delete_services(kube, services)


def test_nothing_routes_out_of_a_node(node_exec: Any, tcp_probe: Any) -> None:
    """No default route anywhere; outside 198.18.0.0/15 is unreachable; an unused ClusterIP dies inside."""
    for node in NODES:
        routes = node_exec(node, ["ip", "-4", "route", "show", "table", "all"]).stdout
        assert "default" not in routes, f"{node} has a default route:\n{routes}"
        outside = tcp_probe(node, "192.0.2.1", 80, 1, timeout=1.0)  # the host's own gateway
        assert outside.failed == 1 and "OSError: Network is unreachable" in outside.errors, outside
    unused = tcp_probe("ps-node-1", "198.19.255.254", 80, 1, timeout=1.0)
    assert unused.failed == 1, unused


def test_nftables_after_configmap_switch_and_rollout_restart(
        cluster: Any, kube: Any, test_service: Any, tcp_probe: Any, node_http_get: Any, node_exec: Any,
        continuous_prober: Any, wait_for: Any) -> None:
    before = {n: p["metadata"]["uid"] for n, p in kube_proxy_pods(kube).items()}
    # Connections keep going from one node through the switch (a plain restart is not a safe
    # migration: the count of failures here is what proxyshift exists to avoid).
    prober = continuous_prober("ps-node-2", test_service.cluster_ip, test_service.port, interval=0.1)
    try:
        set_mode(kube, cluster, "nftables")
        after = kube_proxy_pods(kube)
        assert all(after[n]["metadata"]["uid"] != before[n] for n in NODES), "rollout restart replaced no pod"
        wait_for(lambda: set(proxy_modes(node_http_get).values()) == {"nftables"}, 90,
                 "/proxyMode to answer nftables on every node")
        wait_for(lambda: all(tcp_probe(n, test_service.cluster_ip, test_service.port, 1).ok for n in NODES), 60,
                 "the ClusterIP reachable again in nftables mode")
        assert_connections_from_every_node(tcp_probe, test_service)
        for node in NODES:
            table = node_exec(node, ["nft", "list", "table", "ip", "kube-proxy"]).stdout
            assert test_service.cluster_ip in table, f"{node}: ClusterIP not in nft table kube-proxy"
        result = prober.stop()
        print(f"\nconnections during the unmanaged iptables->nftables restart: {result.ok} ok, "
              f"{result.failed} failed {dict(result.errors)}")
        assert result.ok > 0
    finally:
        set_mode(kube, cluster, "iptables")
    wait_for(lambda: set(proxy_modes(node_http_get).values()) == {"iptables"}, 90,
             "/proxyMode back to iptables on every node")


def test_deleted_pod_is_stopped_on_its_node(cluster: Any, kube: Any, wait_for: Any) -> None:
    pod = kube_proxy_pods(kube)["ps-node-3"]
    pid = container_pid(cluster, pod)
    assert pid is not None and alive(pid)
    meta = pod["metadata"]
    kube.delete(f"/api/v1/namespaces/kube-system/pods/{meta['name']}")  # default grace: the simulator finalises
    wait_for(lambda: not alive(pid), 30, f"kube-proxy pid {pid} to stop after its pod was deleted")
    wait_for(lambda: kube.get_or_none(f"/api/v1/namespaces/kube-system/pods/{meta['name']}") is None, 30,
             "the deleted pod to be finalised")
    # The DaemonSet replaces it, and the simulator runs the replacement.
    replacement = wait_for(lambda: (p := kube_proxy_pods(kube).get("ps-node-3")) and is_ready(p) and p, 60,
                           "a Ready replacement kube-proxy pod on ps-node-3")
    assert replacement["metadata"]["uid"] != meta["uid"]
    new_pid = container_pid(cluster, replacement)
    assert new_pid is not None and new_pid != pid


def test_crashed_kube_proxy_is_restarted(cluster: Any, kube: Any, node_http_get: Any, wait_for: Any) -> None:
    pod = kube_proxy_pods(kube)["ps-node-1"]
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    pid = container_pid(cluster, pod)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        current = kube.get(f"/api/v1/namespaces/kube-system/pods/{pod['metadata']['name']}")
        status = current["status"]["containerStatuses"][0]
        return current if status["restartCount"] == restarts + 1 and status["ready"] else None

    current = wait_for(restarted, 60, "kube-proxy restarted (restartCount + 1, Ready)")
    status = current["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 137
    assert "running" in status["state"]
    new_pid = container_pid(cluster, current)
    assert new_pid is not None and new_pid != pid
    wait_for(lambda: node_http_get("ps-node-1", PROXY_MODE_URL)[1].strip() == "iptables", 30,
             "the restarted kube-proxy to answer /proxyMode")


def test_unknown_image_stays_pending_with_a_reason(cluster: Any, kube: Any, wait_for: Any) -> None:
    name = "ps-unknown-image"
    kube.post("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": "ps-node-2", "containers": [{"name": "c", "image": "docker.io/library/busybox:1"}]}})
    try:
        def reason() -> str | None:
            pod = kube.get(f"/api/v1/namespaces/default/pods/{name}")
            statuses = pod["status"].get("containerStatuses") or []
            waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
            return waiting.get("reason") if pod["status"].get("phase") == "Pending" else None

        assert wait_for(reason, 30, "an ImageNotSupported reason") == "ImageNotSupported"
    finally:
        kube.delete(f"/api/v1/namespaces/default/pods/{name}")
    wait_for(lambda: kube.get_or_none(f"/api/v1/namespaces/default/pods/{name}") is None, 30,
             "the unsupported pod to be finalised")


def test_simulator_restart_adopts_nothing_and_reruns_pods(cluster: Any, kube: Any, wait_for: Any) -> None:
    """A killed simulator leaves its containers; the next one clears them and runs the pods again."""
    pod = kube_proxy_pods(kube)["ps-node-2"]
    old_pid = container_pid(cluster, pod)
    simulator = network.simulator_pid(cluster.state_dir, "ps-node-2")
    assert simulator is not None
    os.kill(simulator, signal.SIGKILL)
    info = nodesim_cluster_info(cluster)
    network.create_nodes(cluster.state_dir, info, {"blue": 2, "green": 1})
    wait_for(lambda: old_pid is None or not alive(old_pid), 30, "the orphaned kube-proxy to be killed")
    wait_for(lambda: (p := kube_proxy_pods(kube).get("ps-node-2")) and container_pid(cluster, p) and is_ready(p),
             60, "kube-proxy running again on ps-node-2")


def nodesim_cluster_info(cluster: Any) -> Any:
    from localcluster import controlplane

    info = controlplane.load_info(cluster.state_dir)
    assert info is not None
    return info


def test_configmap_volume_follows_the_configmap(cluster: Any, kube: Any, wait_for: Any) -> None:
    """A running kube-proxy's mounted ConfigMap is rewritten in place when the ConfigMap changes."""
    pod = kube_proxy_pods(kube)["ps-node-1"]
    meta = pod["metadata"]
    volume = (network.node_dir(cluster.state_dir, "ps-node-1") / "pods" /
              f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}" / "volumes" / "kube-proxy")
    marker = f"written-{time.time_ns()}"
    kube.merge_patch(CM_PATH, {"data": {"e2e-marker": marker}})
    try:
        wait_for(lambda: (volume / "e2e-marker").exists() and (volume / "e2e-marker").read_text() == marker,
                 volumes.VOLUME_REFRESH_SECONDS * 3, "the new ConfigMap key in the pod's volume")
        # The container sees it through its bind mount, not only the host folder.
        pid = container_pid(cluster, pod)
        assert pid is not None
        assert Path(f"/proc/{pid}/root/var/lib/kube-proxy/e2e-marker").read_text() == marker
    finally:
        kube.merge_patch(CM_PATH, {"data": {"e2e-marker": None}})
    wait_for(lambda: not (volume / "e2e-marker").exists(), volumes.VOLUME_REFRESH_SECONDS * 3,
             "the removed key to leave the volume")


def test_probes_run_inside_the_node(cluster: Any, kube: Any, wait_for: Any) -> None:
    """readinessProbe gates Ready, a failing livenessProbe restarts the container, both from inside the node."""

    def patch_probes(readiness: dict[str, Any] | None, liveness: dict[str, Any] | None) -> None:
        kube.strategic_patch(DS_PATH, {"spec": {"template": {"spec": {"containers": [
            {"name": "kube-proxy", "readinessProbe": readiness, "livenessProbe": liveness}]}}}})

    healthz = {"httpGet": {"path": "/healthz", "port": 10256}, "periodSeconds": 1, "failureThreshold": 1}
    try:
        patch_probes(healthz, None)
        cluster.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=120s",
                        timeout=150)
        pods = kube_proxy_pods(kube)
        assert all(p["spec"]["containers"][0].get("readinessProbe") and is_ready(p) for p in pods.values())

        # Nothing listens on 10999 inside a node: never Ready, and restarted by the liveness probe.
        nowhere = {"tcpSocket": {"port": 10999}, "periodSeconds": 1, "failureThreshold": 2}
        old = {p["metadata"]["uid"] for p in pods.values()}
        patch_probes({**nowhere, "httpGet": None}, nowhere)  # a strategic merge would keep httpGet

        def stuck_pod() -> dict[str, Any] | None:
            for pod in kube_proxy_pods(kube).values():
                statuses = pod["status"].get("containerStatuses") or []
                if pod["metadata"]["uid"] not in old and statuses and statuses[0]["restartCount"] >= 1:
                    return pod
            return None

        pod = wait_for(stuck_pod, 60, "a new kube-proxy pod restarted by its failing livenessProbe")
        assert not is_ready(pod)
        ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ContainersNotReady"
    finally:
        patch_probes(None, None)
        cluster.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=120s",
                        timeout=150)


def test_proxyshift_image_runs_the_cli_with_env_and_volumes(cluster: Any, kube: Any, wait_for: Any) -> None:
    name = "ps-cli-version"
    kube.post("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "nodeSelector": {"pool": "green"}, "containers": [{
            "name": "cli", "image": "ghcr.io/proxyshift/proxyshift:dev", "command": ["proxyshift"],
            "args": ["$(FLAG)"],
            "env": [{"name": "FLAG", "value": "--version"},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            # Like the agent's DaemonSet: an emptyDir over /tmp, where the state dir (and so
            # every other volume's source) lives on the host.
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
            "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}]}})
    try:
        def finished() -> dict[str, Any] | None:
            pod = kube.get(f"/api/v1/namespaces/default/pods/{name}")
            return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

        pod = wait_for(finished, 60, "the proxyshift CLI pod to finish")
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
        assert pod["spec"]["nodeName"] == "ps-node-3"  # the only green node: the scheduler placed it
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
        # The projected service-account volume was materialised even though the CLI ignores it.
        assert any(v.get("projected") for v in pod["spec"]["volumes"])
        log = network.node_dir(cluster.state_dir, "ps-node-3") / "logs" / f"{name}_cli.log"
        from proxyshift import __version__

        assert __version__ in log.read_text()
    finally:
        kube.delete(f"/api/v1/namespaces/default/pods/{name}")
    # A finished pod is finalised on deletion too (nothing runs, the simulator still deletes it).
    wait_for(lambda: kube.get_or_none(f"/api/v1/namespaces/default/pods/{name}") is None, 30,
             "the finished pod to be finalised")


def test_a_node_can_join_and_leave(cluster: Any, kube: Any, wait_for: Any) -> None:
    """create_nodes with a bigger plan adds a node (the DaemonSet follows); remove_node takes it away."""
    info = nodesim_cluster_info(cluster)
    try:
        names = network.create_nodes(cluster.state_dir, info, {"blue": 2, "green": 1, "red": 1})
        assert names == [*NODES, "ps-node-4"]
        node = kube.get("/api/v1/nodes/ps-node-4")
        assert node["metadata"]["labels"]["pool"] == "red"
        wait_for(lambda: (p := kube_proxy_pods(kube).get("ps-node-4")) and is_ready(p), 60,
                 "kube-proxy Ready on the new node")
        # The new node's pod range is routed (host-gw) from the nodes that were there before it.
        assert f"{podnet.pod_cidr(4)} via {network.node_ip(4)}" in run(["ip", "-n", "ps-node-1", "route"]).stdout
    finally:
        network.remove_node(cluster.state_dir, info, "ps-node-4")
    assert kube.get_or_none("/api/v1/nodes/ps-node-4") is None
    assert not {"ps-node-4", podnet.pod_netns("ps-node-4")} & set(network.list_namespaces())
    for netns in ("ps-node-1", *network.endpoint_namespaces()):
        assert str(podnet.pod_cidr(4)) not in run(["ip", "-n", netns, "route"]).stdout, netns
    wait_for(lambda: kube.get(DS_PATH)["status"].get("desiredNumberScheduled") == 3, 60,
             "the DaemonSet back to 3 nodes")


@pytest.mark.localcluster_down
def test_down_leaves_nothing_behind(cluster: Any, host_snapshot: Any) -> None:
    """Runs last in the session (tests/conftest.py moves it): `down`, then compare with the host before `up`."""
    assert cluster.before is not None
    result = cluster.down()
    assert result.returncode == 0, result.stderr
    after = host_snapshot(cluster.state_dir)
    print(f"\nbefore up: {cluster.before}\nafter down: {after}")
    assert after["namespaces"] == cluster.before["namespaces"] == []
    assert after["interfaces"] == cluster.before["interfaces"] == []
    assert after["routes"] == cluster.before["routes"] == []
    assert after["processes"] == [], after["processes"]
    assert after["mounts"] == []
    assert not cluster.state_dir.exists()
    leftovers = [p for p in after["host_paths"] if p not in cluster.before["host_paths"]]
    assert leftovers == []
