"""JSON patches: the baseline DaemonSet's one-time affinity (and its undo); the immutable selector of a
revision DaemonSet, the one change server-side apply cannot make."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from proxyshift.api.policy import ProxyPolicy
from proxyshift.render import (
    LABEL_REVISION,
    affinity_patch_pair,
    baseline_affinity_patch,
    needs_recreate,
    render_revision,
    undo_baseline_affinity_patch,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OURS = {"key": LABEL_REVISION, "operator": "DoesNotExist"}
ZONE = {"key": "zone", "operator": "In", "values": ["a", "b"]}
HOST = {"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}


def daemonset(affinity: Any = ..., which: str = "kubeadm") -> dict[str, Any]:
    ds = yaml.safe_load((FIXTURES / which / "kube-proxy-daemonset.yaml").read_text())
    if affinity is not ...:
        ds["spec"]["template"]["spec"]["affinity"] = copy.deepcopy(affinity)
    return ds


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


PREFERRED = {"preferredDuringSchedulingIgnoredDuringExecution": [
    {"weight": 1, "preference": {"matchExpressions": [ZONE]}}]}

# Baseline shapes: (id, affinity value or ... for "no affinity key").
SHAPES: list[tuple[str, Any]] = [
    ("none", ...),
    ("null", None),
    ("empty", {}),
    ("pod-affinity-only", {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}),
    ("empty-node-affinity", {"nodeAffinity": {}}),
    ("preferred-only", {"nodeAffinity": copy.deepcopy(PREFERRED)}),
    ("one-term", required({"matchExpressions": [ZONE]})),
    ("two-terms", required({"matchExpressions": [ZONE]}, {"matchExpressions": [HOST]})),
    ("fields-only-term", required({"matchFields": [HOST]})),
    ("with-empty-term", required({"matchExpressions": [ZONE]}, {})),
    ("required-and-preferred", {"nodeAffinity": {
        **required({"matchExpressions": [ZONE]})["nodeAffinity"], **PREFERRED}}),
]


def terms_of(ds: dict[str, Any]) -> list[dict[str, Any]]:
    return ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


@pytest.mark.parametrize(("shape", "affinity"), SHAPES, ids=[s for s, _ in SHAPES])
def test_forward_adds_the_expression_to_every_real_term(shape: str, affinity: Any) -> None:
    ds = daemonset(affinity)
    patch = baseline_affinity_patch(ds)
    assert patch is not None
    patched = patch.apply(ds)
    for term in terms_of(patched):
        if term.get("matchExpressions") or term.get("matchFields"):
            assert OURS in term["matchExpressions"]
        else:
            assert term == {}  # an empty term matches nothing; it must stay that way
    # Everything outside the pod's affinity is untouched.
    strip = lambda d: {**d, "spec": {**d["spec"], "template": {"spec": {  # noqa: E731
        k: v for k, v in d["spec"]["template"]["spec"].items() if k != "affinity"}}}}
    assert strip(patched) == strip(ds)
    if shape == "required-and-preferred":
        assert patched["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"] == PREFERRED[
            "preferredDuringSchedulingIgnoredDuringExecution"]


@pytest.mark.parametrize(("shape", "affinity"), SHAPES, ids=[s for s, _ in SHAPES])
def test_patch_is_idempotent(shape: str, affinity: Any) -> None:
    ds = daemonset(affinity)
    patched = baseline_affinity_patch(ds).apply(ds)  # type: ignore[union-attr]  # every shape needs the patch
    assert baseline_affinity_patch(patched) is None
    assert affinity_patch_pair(patched) is None


@pytest.mark.parametrize(("shape", "affinity"), SHAPES, ids=[s for s, _ in SHAPES])
def test_recorded_inverse_restores_exactly(shape: str, affinity: Any) -> None:
    ds = daemonset(affinity)
    pair = affinity_patch_pair(ds)
    assert pair is not None
    forward, inverse = pair
    assert inverse.apply(forward.apply(ds)) == ds


@pytest.mark.parametrize(("shape", "affinity"), SHAPES, ids=[s for s, _ in SHAPES])
def test_stateless_undo_restores_the_same_scheduling(shape: str, affinity: Any) -> None:
    ds = daemonset(affinity)
    patched = baseline_affinity_patch(ds).apply(ds)  # type: ignore[union-attr]  # every shape needs the patch
    undo = undo_baseline_affinity_patch(patched)
    assert undo is not None
    restored = undo.apply(patched)
    if shape in ("null", "empty", "empty-node-affinity"):
        # null/{} containers are indistinguishable from absent ones after an API round trip.
        before = ds["spec"]["template"]["spec"].get("affinity") or {}
        after = restored["spec"]["template"]["spec"].get("affinity") or {}
        assert {k: v for k, v in before.items() if v} == after
    else:
        assert restored == ds
    assert undo_baseline_affinity_patch(restored) is None


def test_inverse_refuses_a_daemonset_that_changed_underneath() -> None:
    ds = daemonset(required({"matchExpressions": [ZONE]}))
    forward, inverse = affinity_patch_pair(ds)  # type: ignore[misc]  # this DaemonSet has a pair
    live = forward.apply(ds)
    # Someone else appended an expression after ours: index-based removal would hit theirs.
    terms_of(live)[0]["matchExpressions"].insert(0, HOST)
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        inverse.apply(live)
    # The stateless undo still removes exactly ours.
    undone = undo_baseline_affinity_patch(live).apply(live)  # type: ignore[union-attr]
    assert terms_of(undone)[0]["matchExpressions"] == [HOST, ZONE]


def test_patches_are_plain_json_for_the_api_server() -> None:
    forward, inverse = affinity_patch_pair(daemonset())  # type: ignore[misc]  # this DaemonSet has a pair
    for patch in (forward, inverse):
        assert all(op["path"].startswith("/spec/template/spec/affinity") for op in patch.patch)
        assert jsonpatch.JsonPatch.from_string(patch.to_string()) == patch


# ---- the immutable selector of a revision DaemonSet -------------------------------------------


def rendered(**spec: Any) -> Any:
    cm = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-configmap.yaml").read_text())
    body = {"nodeSelector": {}, "mode": "nftables", **spec}
    return render_revision(ProxyPolicy.model_validate({"metadata": {"name": "blue"}, "spec": body}), cm, daemonset())


def as_server_returns(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server hands back: server metadata, defaults, status."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u-1", resourceVersion="7", generation=1, creationTimestamp="2026-01-01T00:00:00Z")
    live["metadata"]["annotations"]["deprecated.daemonset.template.generation"] = "1"
    if live["kind"] == "DaemonSet":
        pod = live["spec"]["template"]["spec"]
        pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default-scheduler")
        pod["containers"][0]["terminationMessagePolicy"] = "File"
        pod["volumes"][0]["configMap"]["defaultMode"] = 420
        live["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "now"
        live["status"] = {"numberReady": 3}
    return live


def test_only_a_selector_change_needs_recreate() -> None:
    desired = rendered().daemonset
    live = as_server_returns(desired)
    other = copy.deepcopy(desired)
    other["spec"]["selector"]["matchLabels"]["tier"] = "node"
    assert needs_recreate(live, other) and not needs_recreate(live, desired)
    image = copy.deepcopy(desired)
    image["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.k8s.io/kube-proxy:v1.34.0"
    assert not needs_recreate(live, image)  # any other change is the apply's
