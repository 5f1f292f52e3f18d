"""bench/harness/write_floor.plan: audit events in, the write floor's replay plan out (pure, no API server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.harness import write_floor as wf

pytestmark = pytest.mark.unit

OP = "proxyshift-operator"


def event(verb: str, uri: str, ref: dict[str, Any], body: Any = None, code: int = 200, user: str = OP,
          stage: str = "ResponseComplete") -> dict[str, Any]:
    ev: dict[str, Any] = {"stage": stage, "verb": verb, "requestURI": uri, "objectRef": ref,
                          "user": {"username": user}, "responseStatus": {"code": code}}
    if body is not None:
        ev["requestObject"] = body
    return ev


PN = {"resource": "proxynodes", "apiGroup": "proxyshift.io", "apiVersion": "v1alpha1", "name": "n1"}
PN_URI = "/apis/proxyshift.io/v1alpha1/proxynodes/n1"
APPLY = {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode", "metadata": {"name": "n1"},
         "spec": {"operation": {"id": "a", "type": "Preflight"}}}
NODE = {"resource": "nodes", "apiGroup": "", "apiVersion": "v1", "name": "n1"}
POLICY = {"resource": "proxypolicies", "apiGroup": "proxyshift.io", "apiVersion": "v1alpha1", "name": "p"}
POLICY_URI = "/apis/proxyshift.io/v1alpha1/proxypolicies/p"
DS = {"resource": "daemonsets", "apiGroup": "apps", "apiVersion": "v1", "namespace": "kube-system",
      "name": "kube-proxy-r1"}
DS_URI = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy-r1"
EVENTS = {"resource": "events", "apiGroup": "", "apiVersion": "v1", "namespace": "default"}


def body(w: wf.Write) -> Any:
    assert w.body is not None
    return json.loads(w.body)


def test_patches_keep_uri_body_and_content_type_and_become_real_writes() -> None:
    events = [
        event("patch", PN_URI + "?fieldManager=proxyshift&force=true", PN, APPLY),
        event("patch", "/api/v1/nodes/n1", NODE, {"metadata": {"labels": {"proxyshift.io/revision": "r1"}}}),
        event("patch", POLICY_URI + "/status", {**POLICY, "subresource": "status"}, {"status": {"phase": "Rolling"}}),
        event("patch", POLICY_URI, POLICY, {"metadata": {"finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]}}),
        event("patch", "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy", {**DS, "name": "kube-proxy"},
              [{"op": "add", "path": "/spec/template/spec/affinity", "value": {}}]),
    ]
    p = wf.plan(events, OP)
    assert [(w.method, w.uri, w.content_type) for w in p.writes] == [
        ("PATCH", PN_URI + "?fieldManager=proxyshift&force=true", wf.APPLY_PATCH),
        ("PATCH", "/api/v1/nodes/n1", wf.STRATEGIC_PATCH),
        ("PATCH", POLICY_URI + "/status", wf.MERGE_PATCH),
        ("PATCH", POLICY_URI, wf.MERGE_PATCH),
        ("PATCH", "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy", wf.JSON_PATCH),
    ]
    applied = body(p.writes[0])
    assert applied["spec"] == APPLY["spec"]
    assert applied["metadata"]["annotations"] == {wf.FLOOR_ANNOTATION: "1"}
    assert body(p.writes[1])["metadata"]["labels"] == {"proxyshift.io/revision": "r1"}
    # Every dict body carries its own annotation value: no replayed write can be a no-op.
    values = {body(w)["metadata"]["annotations"][wf.FLOOR_ANNOTATION] for w in p.writes[:4]}
    assert len(values) == 4
    assert body(p.writes[4]) == events[4]["requestObject"]  # a JSON patch is replayed as it was
    assert p.kinds() == {"patch proxynodes": 1, "patch nodes": 1, "patch proxypolicies/status": 1,
                         "patch proxypolicies": 1, "patch daemonsets": 1}
    assert not p.skipped


def test_a_status_patch_is_in_the_same_chain_as_its_object_and_keeps_its_order() -> None:
    status = {**POLICY, "subresource": "status"}
    events = [event("patch", POLICY_URI, POLICY, {"metadata": {"finalizers": ["f"]}}),
              event("patch", PN_URI + "?fieldManager=proxyshift&force=true", PN, APPLY),
              event("patch", POLICY_URI + "/status", status, {"status": {"phase": "Rolling"}}),
              event("patch", POLICY_URI + "/status", status, {"status": {"phase": "Ready"}})]
    chains = wf.plan(events, OP).chains()
    assert [[w.kind for w in c] for c in chains] == [
        ["patch proxypolicies", "patch proxypolicies/status", "patch proxypolicies/status"], ["patch proxynodes"]]
    assert [body(w).get("status") for w in chains[0]] == [None, {"phase": "Rolling"}, {"phase": "Ready"}]


def test_creates_are_creates_again_under_new_names_and_deletes_follow_them() -> None:
    created_ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "kube-proxy-r1"}, "spec": {}}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-proxy-r1"}, "data": {"a": "b"}}
    ev_body = {"metadata": {"generateName": "n1.", "namespace": "default"}, "reason": "Migrated"}
    events = [
        event("patch", DS_URI + "?fieldManager=proxyshift&force=true", DS, created_ds, code=201),
        event("create", "/api/v1/namespaces/kube-system/configmaps", {**DS, "resource": "configmaps", "apiGroup": ""},
              cm, code=201),
        event("create", "/api/v1/namespaces/default/events", EVENTS, ev_body, code=201),
        event("patch", DS_URI + "?fieldManager=proxyshift&force=true", DS, created_ds),
        event("delete", DS_URI, DS),
        event("delete", "/api/v1/namespaces/kube-system/configmaps/kube-proxy-r1",
              {**DS, "resource": "configmaps", "apiGroup": ""}),
        event("delete", "/api/v1/namespaces/kube-system/configmaps/other", {**DS, "resource": "configmaps"}),
    ]
    p = wf.plan(events, OP)
    first = p.writes[0]
    assert first.uri == "/apis/apps/v1/namespaces/kube-system/daemonsets/bench-floor-1-kube-proxy-r1" \
        "?fieldManager=proxyshift&force=true"
    assert body(first)["metadata"]["name"] == "bench-floor-1-kube-proxy-r1"
    assert (p.writes[1].method, p.writes[1].uri) == ("POST", "/api/v1/namespaces/kube-system/configmaps")
    assert body(p.writes[1])["metadata"]["name"] == "bench-floor-2-kube-proxy-r1"
    assert body(p.writes[1])["data"] == {"a": "b"}
    assert body(p.writes[2])["metadata"]["generateName"] == "n1."  # Events keep their generateName
    assert "name" not in body(p.writes[2])["metadata"]
    # A later apply to the original goes to the original; the deletes go to the copies.
    assert p.writes[3].uri.startswith(DS_URI + "?")
    assert [(w.method, w.uri) for w in p.writes[4:]] == [
        ("DELETE", "/apis/apps/v1/namespaces/kube-system/daemonsets/bench-floor-1-kube-proxy-r1"),
        ("DELETE", "/api/v1/namespaces/kube-system/configmaps/bench-floor-2-kube-proxy-r1")]
    assert p.skipped == {"delete of an object the replay did not create: delete configmaps": 1}


def test_only_the_users_successful_completed_writes_count() -> None:
    events = [
        event("patch", PN_URI, PN, APPLY, stage="ResponseStarted"),
        event("patch", PN_URI, PN, APPLY, user="someone-else"),
        event("get", PN_URI, PN),
        event("list", "/apis/proxyshift.io/v1alpha1/proxynodes", {"resource": "proxynodes"}),
        event("patch", PN_URI, PN, APPLY, code=409),
        event("deletecollection", "/api/v1/namespaces/default/events", EVENTS),
        event("update", PN_URI, PN, {**APPLY, "metadata": {"name": "n1", "resourceVersion": "7"}}),
    ]
    p = wf.plan(events, OP)
    assert [(w.method, w.kind) for w in p.writes] == [("PUT", "update proxynodes")]
    meta = body(p.writes[0])["metadata"]
    assert "resourceVersion" not in meta and wf.FLOOR_ANNOTATION in meta["annotations"]
    assert p.skipped == {"failed in the rollout: patch proxynodes": 1, "not replayed: deletecollection events": 1}


def test_an_unchanged_reapply_stays_a_no_op_and_json_patches_lose_their_resource_version_test() -> None:
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "kube-proxy-r1"}, "spec": {}}
    base = {**DS, "name": "kube-proxy"}
    base_uri = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy"
    events = [
        event("patch", DS_URI + "?fieldManager=proxyshift&force=true", DS, ds),
        event("patch", DS_URI + "?fieldManager=proxyshift&force=true", DS, ds),
        event("patch", POLICY_URI, POLICY, [{"op": "test", "path": "/metadata/resourceVersion", "value": "6"},
                                            {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}]),
        event("patch", base_uri, base, [{"op": "add", "path": "/metadata/annotations/a~1b", "value": "x"}]),
    ]
    p = wf.plan(events, OP)
    assert [w.repeat for w in p.writes] == [False, True, False, False]
    assert wf.FLOOR_ANNOTATION in body(p.writes[0])["metadata"]["annotations"]
    assert body(p.writes[1]) == ds  # replayed exactly as it was: it changed nothing then either
    assert body(p.writes[2]) == [{"op": "add", "path": "/metadata/finalizers", "value": ["f"]}]
    assert body(p.writes[3]) == [{"op": "add", "path": "/metadata/annotations/a~1b", "value": "x"},
                                 {"op": "add", "path": "/metadata/annotations/bench.proxyshift.io~1write-floor",
                                  "value": "4"}]
