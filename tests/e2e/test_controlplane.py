"""The control-plane half of the local cluster, on its own: build, up, serve, down.

Brings up a private control plane in a temporary state dir (no nodes) and
checks at module teardown that `down` left no process, file or port. If the
session's local cluster already holds the fixed ports, the serving checks run
on that cluster instead (see the `cp` fixture). Skipped for an external cluster:
it tests the local binaries.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from localcluster import baseline, build, controlplane, paths, state
from proxyshift.commands import run

pytestmark = [pytest.mark.e2e, pytest.mark.needs_free_ports]

PORTS = (paths.ETCD_CLIENT_PORT, paths.ETCD_PEER_PORT, paths.APISERVER_PORT,
         controlplane.CONTROLLER_MANAGER_PORT, controlplane.SCHEDULER_PORT)


def _port_busy(port: int) -> bool:
    # A bind test, not a connect: a SYN to 198.18.0.1 when the bridge is absent
    # would follow the default route off the machine.
    addresses = ["127.0.0.1"]
    if controlplane.can_bind(paths.BRIDGE_ADDRESS, 0):
        addresses.append(paths.BRIDGE_ADDRESS)
    return not all(controlplane.can_bind(address, port) for address in addresses)


def _processes_mentioning(state_dir: Path) -> set[int]:
    """Processes whose command line names the state dir (other users of the binaries may run meanwhile)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(state_dir).encode() in cmdline:
                pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    if os.environ.get("PROXYSHIFT_EXTERNAL_CLUSTER") == "1":
        pytest.skip("control-plane test needs the local binaries, not an external cluster")
    return build.build()


def _session_cluster_active(request: pytest.FixtureRequest) -> bool:
    """Whether this session's `cluster` fixture (tests/conftest.py) is already set up.

    pytest has no public API for it; on a pytest that changed the private one we
    answer False, and the caller skips rather than risk someone else's cluster.
    """
    try:
        defs = request._fixturemanager.getfixturedefs("cluster", request.node)
        if not defs:
            return False
        return defs[-1].cached_result is not None
    except (AttributeError, TypeError):
        return False


@dataclass
class ControlPlane:
    info: controlplane.ClusterInfo
    private: bool  # started by this module (so its `down` is checked here)
    node: str  # a Node pods may name in spec.nodeName


@pytest.fixture(scope="module")
def cp(bin_dir: Path, tmp_path_factory: pytest.TempPathFactory,
       request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """A private control plane in a temporary state dir, or the session's cluster if it already runs.

    Private is the point (this module checks `down`), but the session cluster
    holds the same fixed ports; when it is up first, the checks that do not
    tear anything down run on it instead and the `down` check is left to
    tests/e2e/test_localcluster.py.
    """
    if any(_port_busy(p) for p in PORTS):
        # Only a cluster this session already started may be borrowed: asking for
        # the `cluster` fixture otherwise would `down` someone else's cluster
        # (tests/conftest.py starts every session from a fresh one).
        if not _session_cluster_active(request):
            pytest.skip("another local cluster (not this session's) holds the control-plane ports")
        request.getfixturevalue("cluster")
        info = controlplane.load_info(paths.default_state_dir())
        if info is None:
            pytest.fail(f"ports {PORTS} are held, but not by the local cluster in {paths.default_state_dir()}")
        yield ControlPlane(info=info, private=False, node="ps-node-1")
        return
    state_dir = tmp_path_factory.mktemp("cp") / "cluster"
    started = time.monotonic()
    try:
        info = controlplane.up_controlplane(state_dir, bin_dir=bin_dir)
        print(f"\ncontrol plane up in {time.monotonic() - started:.1f}s")
        # No kubernetes.io/os label: the baseline DaemonSet must not target it.
        client.CoreV1Api(config.new_client_from_config(str(info.kubeconfig))).create_node(
            {"metadata": {"name": "cp-test-node"}})  # type: ignore[arg-type]  # the client sends a dict as it is
        yield ControlPlane(info=info, private=True, node="cp-test-node")
    finally:
        recorded = [r["pid"] for r in state.read_state(state_dir)["processes"]]
        controlplane.down(state_dir)
    # down leaves nothing: no process it started, no file, no port.
    assert _processes_mentioning(state_dir) == set()
    assert [(pid, state.start_ticks(pid), Path(f"/proc/{pid}/stat").read_text()[:80]) for pid in recorded
            if Path(f"/proc/{pid}").exists()] == []
    assert not state_dir.exists()
    assert not [p for p in PORTS if _port_busy(p)]


@pytest.fixture(scope="module")
def cluster_info(cp: ControlPlane) -> controlplane.ClusterInfo:
    return cp.info


@pytest.fixture(scope="module")
def api(cluster_info: controlplane.ClusterInfo) -> client.ApiClient:
    return config.new_client_from_config(str(cluster_info.kubeconfig))


def test_binaries_are_version_stamped(bin_dir: Path) -> None:
    assert run([str(bin_dir / "kube-apiserver"), "--version"]).stdout.strip() == "Kubernetes v1.37.2"
    client_version = json.loads(run([str(bin_dir / "kubectl"), "version", "--client", "-o", "json"]).stdout)
    assert client_version["clientVersion"]["gitVersion"] == "v1.37.2"
    assert "3.7.0" in run([str(bin_dir / "etcd"), "--version"]).stdout


def test_readyz(cluster_info: controlplane.ClusterInfo, api: client.ApiClient) -> None:
    status, body = controlplane.http_get(f"{cluster_info.api_url}/readyz",
                                         controlplane.admin_ssl_context(cluster_info.pki_dir))
    assert (status, body.strip()) == (200, "ok")
    version = client.VersionApi(api).get_code()
    assert version.git_version == "v1.37.2"


def test_validating_admission_policy_is_served_and_enforced(api: client.ApiClient) -> None:
    admission = client.AdmissionregistrationV1Api(api)
    admission.list_validating_admission_policy()
    # Here and below: the client sends a dict body as it is.
    admission.create_validating_admission_policy({  # type: ignore[arg-type]
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "no-forbidden-configmaps"},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"],
                                                         "resources": ["configmaps"]}]},
                 "validations": [{"expression": "object.metadata.name != 'forbidden'"}]},
    })
    admission.create_validating_admission_policy_binding({  # type: ignore[arg-type]  # a dict body
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "no-forbidden-configmaps"},
        "spec": {"policyName": "no-forbidden-configmaps", "validationActions": ["Deny"]},
    })
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + 30
    try:
        while True:  # the policy reaches the admission plugin through an informer
            try:
                core.create_namespaced_config_map(
                    "default", {"metadata": {"name": "forbidden"}})  # type: ignore[arg-type]  # a dict body
            except ApiException as exc:
                assert exc.status in (400, 403, 422), exc
                assert exc.body is not None and "no-forbidden-configmaps" in exc.body
                break
            core.delete_namespaced_config_map("forbidden", "default")
            assert time.monotonic() < deadline, "ValidatingAdmissionPolicy never took effect"
            time.sleep(0.5)
    finally:
        admission.delete_validating_admission_policy_binding("no-forbidden-configmaps")
        admission.delete_validating_admission_policy("no-forbidden-configmaps")


def test_baseline_objects(cp: ControlPlane, api: client.ApiClient) -> None:
    if cp.private:  # `localcluster up` installs it; the bare control plane does not
        for _ in range(2):  # the second apply proves it idempotent
            baseline.install(cp.info.kubeconfig, cp.info.bin_dir / "kubectl", env=controlplane.daemon_env())
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    cm = core.read_namespaced_config_map("kube-proxy", "kube-system")
    assert cm.data is not None and "mode: iptables" in cm.data["config.conf"]
    ds = apps.read_namespaced_daemon_set("kube-proxy", "kube-system")
    assert ds.spec is not None and ds.spec.template.spec is not None
    assert ds.spec.template.spec.containers[0].image == "registry.k8s.io/kube-proxy:v1.37.2"
    core.read_namespaced_service_account("kube-proxy", "kube-system")
    assert rbac.read_cluster_role_binding("kubeadm:node-proxier").role_ref.name == "system:node-proxier"
    rbac.read_namespaced_role("kube-proxy", "kube-system")
    rbac.read_namespaced_role_binding("kube-proxy", "kube-system")


def test_node_identity_is_held_to_its_own_node(cp: ControlPlane) -> None:
    if not cp.private:
        pytest.skip("creates Node objects: only on the private control plane")
    node_api = config.new_client_from_config(str(controlplane.node_kubeconfig(cp.info, "cp-node-a")))
    core = client.CoreV1Api(node_api)
    # A kubelet registers itself. The client sends a dict body as it is.
    core.create_node({"metadata": {"name": "cp-node-a"}})  # type: ignore[arg-type]
    with pytest.raises(ApiException) as refused:
        core.create_node({"metadata": {"name": "cp-node-b"}})  # type: ignore[arg-type]  # a dict body
    assert refused.value.status == 403


def _claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def _authenticated(api: client.ApiClient, token: str) -> bool:
    """Whether a TokenReview of `token` says it authenticates."""
    review = client.AuthenticationV1Api(api).create_token_review(
        {"spec": {"token": token}})  # type: ignore[arg-type]  # the client sends a dict body as it is
    assert review.status is not None
    return bool(review.status.authenticated)


def test_pod_bound_token(cp: ControlPlane, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    # Dict bodies: the client sends them as they are.
    pod = core.create_namespaced_pod("default", {  # type: ignore[arg-type]
        "metadata": {"name": "token-holder"},
        "spec": {"nodeName": cp.node, "containers": [{"name": "c", "image": "example.invalid/none"}]},
    })
    # The ServiceAccount admission plugin projected a token volume into the pod.
    assert pod.spec is not None and pod.metadata is not None
    assert any(v.projected for v in pod.spec.volumes or [])
    request = core.create_namespaced_service_account_token("default", "default", {  # type: ignore[arg-type]
        "spec": {"audiences": [controlplane.SA_ISSUER], "expirationSeconds": 3600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "token-holder",
                                    "uid": pod.metadata.uid}},
    })
    assert request.status is not None and request.status.token
    token = request.status.token
    claims = _claims(token)["kubernetes.io"]
    assert claims["pod"]["name"] == "token-holder"
    assert claims["node"]["name"] == cp.node
    review = client.AuthenticationV1Api(api).create_token_review(
        {"spec": {"token": token}})  # type: ignore[arg-type]  # a dict body
    assert review.status is not None and review.status.authenticated
    assert review.status.user is not None and review.status.user.extra is not None
    assert review.status.user.username == "system:serviceaccount:default:default"
    assert review.status.user.extra["authentication.kubernetes.io/node-name"] == [cp.node]
    # Deleting the pod invalidates the bound token.
    core.delete_namespaced_pod("token-holder", "default", grace_period_seconds=0)
    deadline = time.monotonic() + 20
    while _authenticated(api, token):
        assert time.monotonic() < deadline, "token still valid after its pod was deleted"
        time.sleep(0.5)
