"""The control-plane half of the local cluster, on its own: build, up, serve, down.

Brings up a private control plane in a temporary state dir (no nodes), so it
needs no network namespaces; it is skipped when another local cluster holds
the ports, or when the e2e run targets an external cluster.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from proxyshift.commands import run
from proxyshift.localcluster import baseline, build, controlplane, paths, state

pytestmark = pytest.mark.e2e

PORTS = (paths.ETCD_CLIENT_PORT, paths.ETCD_PEER_PORT, paths.APISERVER_PORT,
         controlplane.CONTROLLER_MANAGER_PORT, controlplane.SCHEDULER_PORT)


def _port_busy(port: int) -> bool:
    # A bind test, not a connect: a SYN to 198.18.0.1 when the bridge is absent
    # would follow the default route off the machine.
    addresses = ["127.0.0.1"]
    if controlplane.can_bind(paths.BRIDGE_ADDRESS, 0):
        addresses.append(paths.BRIDGE_ADDRESS)
    return not all(controlplane.can_bind(address, port) for address in addresses)


def _processes_using(bin_dir: Path) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                exe = os.readlink(proc / "exe")
            except OSError:
                continue
            if exe.startswith(str(bin_dir)):
                pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    if os.environ.get("PROXYSHIFT_EXTERNAL_CLUSTER") == "1":
        pytest.skip("control-plane test needs the local binaries, not an external cluster")
    return build.build()


@pytest.fixture(scope="module")
def cluster(bin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ClusterInfo]:
    busy = [p for p in PORTS if _port_busy(p)]
    if busy:
        pytest.skip(f"another cluster holds ports {busy}")
    state_dir = tmp_path_factory.mktemp("cp") / "cluster"
    before = _processes_using(bin_dir)
    started = time.monotonic()
    try:
        info = controlplane.up_controlplane(state_dir, bin_dir=bin_dir)
        print(f"\ncontrol plane up in {time.monotonic() - started:.1f}s")
        yield info
    finally:
        recorded = [r["pid"] for r in state.read_state(state_dir)["processes"]]
        controlplane.down(state_dir)
    # down leaves nothing: no process it started, no file, no port.
    assert _processes_using(bin_dir) - before == set()
    assert not any(Path(f"/proc/{pid}").exists() for pid in recorded)
    assert not state_dir.exists()
    assert not [p for p in PORTS if _port_busy(p)]


@pytest.fixture(scope="module")
def api(cluster: controlplane.ClusterInfo) -> client.ApiClient:
    return config.new_client_from_config(str(cluster.kubeconfig))


def test_binaries_are_version_stamped(bin_dir: Path) -> None:
    assert run([str(bin_dir / "kube-apiserver"), "--version"]).stdout.strip() == "Kubernetes v1.37.2"
    client_version = json.loads(run([str(bin_dir / "kubectl"), "version", "--client", "-o", "json"]).stdout)
    assert client_version["clientVersion"]["gitVersion"] == "v1.37.2"
    assert "3.7.0" in run([str(bin_dir / "etcd"), "--version"]).stdout


def test_readyz(cluster: controlplane.ClusterInfo) -> None:
    status, body = controlplane.http_get(f"{cluster.api_url}/readyz",
                                         controlplane.admin_ssl_context(cluster.pki_dir))
    assert (status, body.strip()) == (200, "ok")
    version = client.VersionApi(config.new_client_from_config(str(cluster.kubeconfig))).get_code()
    assert version.git_version == "v1.37.2"


def test_validating_admission_policy_is_served_and_enforced(api: client.ApiClient) -> None:
    admission = client.AdmissionregistrationV1Api(api)
    admission.list_validating_admission_policy()
    admission.create_validating_admission_policy({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "no-forbidden-configmaps"},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"],
                                                         "resources": ["configmaps"]}]},
                 "validations": [{"expression": "object.metadata.name != 'forbidden'"}]},
    })
    admission.create_validating_admission_policy_binding({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "no-forbidden-configmaps"},
        "spec": {"policyName": "no-forbidden-configmaps", "validationActions": ["Deny"]},
    })
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + 30
    while True:  # the policy reaches the admission plugin through an informer
        try:
            core.create_namespaced_config_map("default", {"metadata": {"name": "forbidden"}})
        except ApiException as exc:
            assert exc.status in (400, 403, 422), exc
            assert "no-forbidden-configmaps" in exc.body
            break
        core.delete_namespaced_config_map("forbidden", "default")
        assert time.monotonic() < deadline, "ValidatingAdmissionPolicy never took effect"
        time.sleep(0.5)


def test_baseline_objects(cluster: controlplane.ClusterInfo, api: client.ApiClient) -> None:
    baseline.install(cluster.kubeconfig, cluster.bin_dir / "kubectl", env=controlplane.daemon_env())
    baseline.install(cluster.kubeconfig, cluster.bin_dir / "kubectl", env=controlplane.daemon_env())  # idempotent
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    cm = core.read_namespaced_config_map("kube-proxy", "kube-system")
    assert "mode: iptables" in cm.data["config.conf"]
    ds = apps.read_namespaced_daemon_set("kube-proxy", "kube-system")
    assert ds.spec.template.spec.containers[0].image == "registry.k8s.io/kube-proxy:v1.37.2"
    core.read_namespaced_service_account("kube-proxy", "kube-system")
    assert rbac.read_cluster_role_binding("kubeadm:node-proxier").role_ref.name == "system:node-proxier"
    rbac.read_namespaced_role("kube-proxy", "kube-system")
    rbac.read_namespaced_role_binding("kube-proxy", "kube-system")


def _claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_pod_bound_token(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_node({"metadata": {"name": "cp-test-node", "labels": {"kubernetes.io/os": "linux"}}})
    pod = core.create_namespaced_pod("default", {
        "metadata": {"name": "token-holder"},
        "spec": {"nodeName": "cp-test-node", "containers": [{"name": "c", "image": "example.invalid/none"}]},
    })
    # The ServiceAccount admission plugin projected a token volume into the pod.
    assert any(v.projected for v in pod.spec.volumes)
    request = core.create_namespaced_service_account_token("default", "default", {
        "spec": {"audiences": [controlplane.SA_ISSUER], "expirationSeconds": 3600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "token-holder",
                                    "uid": pod.metadata.uid}},
    })
    token = request.status.token
    claims = _claims(token)["kubernetes.io"]
    assert claims["pod"]["name"] == "token-holder"
    assert claims["node"]["name"] == "cp-test-node"
    review = client.AuthenticationV1Api(api).create_token_review({"spec": {"token": token}})
    assert review.status.authenticated
    assert review.status.user.username == "system:serviceaccount:default:default"
    assert review.status.user.extra["authentication.kubernetes.io/node-name"] == ["cp-test-node"]
    # Deleting the pod invalidates the bound token.
    core.delete_namespaced_pod("token-holder", "default", grace_period_seconds=0)
    deadline = time.monotonic() + 20
    while client.AuthenticationV1Api(api).create_token_review({"spec": {"token": token}}).status.authenticated:
        assert time.monotonic() < deadline, "token still valid after its pod was deleted"
        time.sleep(0.5)
