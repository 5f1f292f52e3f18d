"""Rendered revisions and patches against a real API server.

Proves what unit tests cannot: the API server accepts the rendered ConfigMap
and DaemonSet as they are, applies the affinity patch and its guarded inverse
(JSON patch `test` operations included), and the operator's server-side
apply of a revision (controller/kube.py) writes nothing when it is applied
again unchanged, i.e. the fields the server defaults never cause an update
loop, while a changed rendering is written and an immutable selector change
is a delete and create.

Everything happens in a namespace of its own, on objects whose node
selectors match no node, so no kube-proxy pod is started and the cluster's
real baseline is never touched.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.kube import ClusterAPI
from proxyshift.render import affinity_patch_pair, render_revision, undo_baseline_affinity_patch

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NEVER = {"proxyshift.io/e2e-never-schedule": "true"}


@pytest.fixture(scope="module")
def k8s(kubeconfig: Path) -> Iterator[tuple[Any, Any, str]]:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    namespace = f"proxyshift-e2e-render-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]  # the client sends a dict as it is
    try:
        yield core, apps, namespace
    finally:
        core.delete_namespace(namespace)


def _load(which: str, kind: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / which / f"kube-proxy-{kind}.yaml").read_text())


def _in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"] = {k: v for k, v in obj["metadata"].items()
                       if k in ("name", "labels", "annotations")} | {"namespace": namespace}
    obj.pop("status", None)
    return obj


def _rendered(which: str, namespace: str, mode: str = "nftables") -> Any:
    cm, ds = _load(which, "configmap"), _load(which, "daemonset")
    cm["metadata"]["namespace"] = ds["metadata"]["namespace"] = namespace
    policy = ProxyPolicy.model_validate({"metadata": {"name": f"e2e-{which}"},
                                         "spec": {"nodeSelector": {}, "mode": mode}})
    return render_revision(policy, cm, ds)


def _applied_by_proxyshift(obj: Any) -> bool:
    return any(m.manager == "proxyshift" and m.operation == "Apply" for m in obj.metadata.managed_fields or [])


@pytest.mark.parametrize("which", ["baseline", "kubeadm"])
def test_rendered_objects_are_applied_and_do_not_churn(which: str, k8s: tuple[Any, Any, str]) -> None:
    core, apps, namespace = k8s
    api = ClusterAPI(core.api_client)
    api.namespace = namespace
    rev = _rendered(which, namespace, mode="ipvs")
    cm_name, ds_name = rev.configmap["metadata"]["name"], rev.daemonset["metadata"]["name"]
    def settled() -> Any:
        """The DaemonSet once its controller has written the status of its generation (that write is a
        new resourceVersion too, and not the apply's)."""
        deadline = time.monotonic() + 60
        while True:
            ds = apps.read_namespaced_daemon_set(ds_name, namespace)
            if (ds.status and ds.status.observed_generation == ds.metadata.generation) or time.monotonic() > deadline:
                return ds
            time.sleep(0.5)

    cm_rv = api.apply_configmap(rev.configmap)
    api.apply_daemonset(rev.daemonset)  # nodeSelector: a revision no node carries
    first = settled()
    assert _applied_by_proxyshift(first) and _applied_by_proxyshift(core.read_namespaced_config_map(cm_name, namespace))

    # Applied again unchanged: the server defaults and nothing is written.
    assert api.apply_configmap(copy.deepcopy(rev.configmap)) == cm_rv
    assert api.apply_daemonset(copy.deepcopy(rev.daemonset)) == first.metadata.resource_version
    assert apps.read_namespaced_daemon_set(ds_name, namespace).metadata.generation == first.metadata.generation

    # A new baseline image: written, one new generation, and applying it again writes nothing.
    desired = copy.deepcopy(rev.daemonset)
    desired["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.k8s.io/kube-proxy:v1.99.0"
    new_rv = api.apply_daemonset(desired)
    after = settled()
    assert new_rv != first.metadata.resource_version and after.metadata.generation == first.metadata.generation + 1
    assert after.spec.template.spec.containers[0].image == "registry.k8s.io/kube-proxy:v1.99.0"
    assert api.apply_daemonset(copy.deepcopy(desired)) == after.metadata.resource_version

    # A field the rendering drops is removed: `proxyshift` applied it and no longer does.
    dropped = copy.deepcopy(desired)
    dropped["spec"]["template"]["spec"]["tolerations"] = []
    api.apply_daemonset(dropped)
    assert not apps.read_namespaced_daemon_set(ds_name, namespace).spec.template.spec.tolerations

    # The selector is immutable: the DaemonSet is deleted and created again.
    moved = copy.deepcopy(dropped)
    moved["spec"]["selector"]["matchLabels"]["proxyshift.io/e2e-selector"] = "moved"
    moved["spec"]["template"]["metadata"]["labels"]["proxyshift.io/e2e-selector"] = "moved"
    api.apply_daemonset(moved)
    recreated = apps.read_namespaced_daemon_set(ds_name, namespace)
    assert recreated.metadata.uid != first.metadata.uid
    assert recreated.spec.selector.match_labels["proxyshift.io/e2e-selector"] == "moved"


@pytest.mark.parametrize("user_affinity", [None, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}],
    ids=["no-affinity", "user-affinity"])
def test_affinity_patch_and_inverse_on_the_server(user_affinity: Any, k8s: tuple[Any, Any, str]) -> None:
    _, apps, namespace = k8s
    ds = _in_namespace(_load("kubeadm", "daemonset"), namespace)
    ds["metadata"]["name"] = f"baseline-{uuid.uuid4().hex[:6]}"
    ds["spec"]["template"]["spec"]["nodeSelector"] = NEVER
    if user_affinity:
        ds["spec"]["template"]["spec"]["affinity"] = user_affinity
    name = ds["metadata"]["name"]
    apps.create_namespaced_daemon_set(namespace, ds)

    def live() -> dict[str, Any]:
        return apps.api_client.sanitize_for_serialization(apps.read_namespaced_daemon_set(name, namespace))

    original = live()
    pair = affinity_patch_pair(original)
    assert pair is not None
    forward, inverse = pair
    apps.patch_namespaced_daemon_set(name, namespace, forward.patch)
    patched = live()
    terms = patched["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all({"key": "proxyshift.io/revision", "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms)
    assert affinity_patch_pair(patched) is None

    apps.patch_namespaced_daemon_set(name, namespace, inverse.patch)
    restored = live()
    assert restored["spec"]["template"]["spec"].get("affinity") == original["spec"]["template"]["spec"].get(
        "affinity")

    # The stateless undo, from the live object alone, after patching once more.
    apps.patch_namespaced_daemon_set(name, namespace, affinity_patch_pair(restored)[0].patch)  # type: ignore[index]
    undo = undo_baseline_affinity_patch(live())
    assert undo is not None
    apps.patch_namespaced_daemon_set(name, namespace, undo.patch)
    assert live()["spec"]["template"]["spec"].get("affinity") == original["spec"]["template"]["spec"].get("affinity")
