"""The requests ClusterAPI sends for the objects the operator manages: server-side apply under the field
manager `proxyshift`, through the real kubernetes client over a fake ApiClient (no server).

Also the managedFields arithmetic of render/apply.py that keeps the ProxyNode spec's replace semantics
when another manager owns spec fields."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from kubernetes import client

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.kube import ClusterAPI
from proxyshift.controller.rest import Collection
from proxyshift.render import FIELD_MANAGER, foreign_spec_owners, render_revision, take_spec_ownership
from proxyshift.render.apply import union_fields

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
APPLY = "application/apply-patch+yaml"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    body: Any


class Response:
    """What the kubernetes client reads from urllib3's response."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = "OK" if status < 300 else "Error"
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}
        self.response = self  # what a call with _preload_content=False hands back

    def read(self) -> bytes:
        return self.data

    def getheaders(self) -> dict[str, str]:
        return self.headers

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


Answer = Callable[[Request], tuple[int, Any]]


@dataclass
class FakeApiClient(client.ApiClient):
    answer: Answer = field(default=lambda r: (200, r.body))
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        conf = client.Configuration()
        conf.host = "https://apiserver.invalid"
        super().__init__(conf)

    # Returns the fake's Response, which has what the client reads of a RESTResponse.
    def call_api(self, method: str, url: str,  # type: ignore[override]
                 header_params: dict[str, str] | None = None, body: Any = None,
                 post_params: Any = None, _request_timeout: Any = None) -> Response:
        parts = urlsplit(url)
        request = Request(method, parts.path, parse_qs(parts.query), (header_params or {}).get("Content-Type"),
                          copy.deepcopy(body))
        self.requests.append(request)
        status, answer = self.answer(request)
        return Response(status, answer)


def with_rv(body: dict[str, Any], rv: str = "42", **meta: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["metadata"].update(resourceVersion=rv, **meta)
    return out


def rendered() -> Any:
    cm = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-configmap.yaml").read_text())
    ds = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-daemonset.yaml").read_text())
    policy = ProxyPolicy.model_validate({"metadata": {"name": "blue"},
                                         "spec": {"nodeSelector": {}, "mode": "nftables"}})
    return render_revision(policy, cm, ds)


def assert_apply(request: Request, path: str, *, force: bool) -> None:
    assert (request.method, request.path, request.content_type) == ("PATCH", path, APPLY)
    assert request.query["fieldManager"] == [FIELD_MANAGER]
    assert request.query["force"] == [str(force).lower()]


# ---- revision objects ----


def test_revision_objects_are_applied_whole_under_the_field_manager() -> None:
    fake = FakeApiClient(answer=lambda r: (200, with_rv(r.body)))
    api = ClusterAPI(fake)
    rev = rendered()
    assert api.apply_configmap(rev.configmap) == "42"
    assert api.apply_daemonset(rev.daemonset) == "42"
    cm_req, ds_req = fake.requests
    name = rev.daemonset["metadata"]["name"]
    assert_apply(cm_req, f"/api/v1/namespaces/kube-system/configmaps/{name}", force=True)
    assert_apply(ds_req, f"/apis/apps/v1/namespaces/kube-system/daemonsets/{name}", force=True)
    # The body is the whole rendering, apiVersion and kind included, as rendered (pure rendering unchanged).
    assert cm_req.body == rev.configmap and cm_req.body["kind"] == "ConfigMap"
    assert ds_req.body == rev.daemonset and (ds_req.body["apiVersion"], ds_req.body["kind"]) == ("apps/v1", "DaemonSet")


def test_a_refused_selector_change_deletes_and_creates_the_daemonset() -> None:
    rev = rendered()
    name = rev.daemonset["metadata"]["name"]
    live = with_rv(rev.daemonset)
    live["spec"]["selector"]["matchLabels"]["tier"] = "old"
    state = {"applies": 0, "deleted": False}

    def answer(r: Request) -> tuple[int, Any]:
        if r.method == "PATCH":
            state["applies"] += 1
            if state["applies"] == 1:
                return 422, {"kind": "Status", "code": 422, "reason": "Invalid",
                             "message": "spec.selector: Invalid value: field is immutable"}
            return 200, with_rv(r.body, "43")
        if r.method == "DELETE":
            state["deleted"] = True
            return 200, {"kind": "Status", "status": "Success"}
        if state["deleted"]:
            return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
        return 200, live

    fake = FakeApiClient(answer=answer)
    assert ClusterAPI(fake).apply_daemonset(rev.daemonset) == "43"
    methods = [r.method for r in fake.requests]
    assert methods == ["PATCH", "GET", "DELETE", "GET", "PATCH"]
    assert fake.requests[2].path.endswith(f"/daemonsets/{name}")
    assert_apply(fake.requests[-1], f"/apis/apps/v1/namespaces/kube-system/daemonsets/{name}", force=True)


def test_another_refusal_is_not_a_recreate() -> None:
    rev = rendered()

    def answer(r: Request) -> tuple[int, Any]:
        if r.method == "PATCH":
            return 422, {"kind": "Status", "code": 422, "reason": "Invalid", "message": "bad toleration"}
        return 200, with_rv(rev.daemonset)

    fake = FakeApiClient(answer=answer)
    with pytest.raises(client.ApiException) as refused:
        ClusterAPI(fake).apply_daemonset(rev.daemonset)
    assert refused.value.status == 422
    assert [r.method for r in fake.requests] == ["PATCH", "GET"]


# ---- ProxyNodes ----

PN_PATH = "/apis/proxyshift.io/v1alpha1/proxynodes/n1"
OURS_ENTRY = {"manager": "proxyshift", "operation": "Apply", "apiVersion": "proxyshift.io/v1alpha1",
              "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {"f:app.kubernetes.io/managed-by": {}}},
                                                      "f:spec": {"f:policy": {}, "f:revision": {}}}}


def test_the_proxynode_spec_is_applied_with_its_identity() -> None:
    fake = FakeApiClient(answer=lambda r: (200, with_rv(r.body, managedFields=[OURS_ENTRY])))
    spec = {"policy": "blue", "revision": "blue-abc", "migration": None, "operation": None}
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", spec) == "42"
    (request,) = fake.requests
    assert_apply(request, PN_PATH, force=True)
    assert request.body == {
        "apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode",
        "metadata": {"name": "n1", "labels": {"app.kubernetes.io/managed-by": "proxyshift"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}]},
        "spec": {"policy": "blue", "revision": "blue-abc"},  # None: left out, so removed if applied before
    }


def test_an_apply_that_creates_the_proxynode_answers_201() -> None:
    fake = FakeApiClient(answer=lambda r: (201, with_rv(r.body, "5", managedFields=[OURS_ENTRY])))
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", {"policy": "blue"}) == "5"
    assert [r.method for r in fake.requests] == ["PATCH"]


def test_spec_fields_of_another_manager_are_taken_over_and_applied_again() -> None:
    theirs = {"manager": "OpenAPI-Generator", "operation": "Update", "apiVersion": "proxyshift.io/v1alpha1",
              "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:migration": {"f:toRevision": {}}}}}
    agent = {"manager": "proxyshift-agent", "operation": "Update", "subresource": "status",
             "fieldsV1": {"f:status": {"f:heartbeat": {}}}}
    applies: list[int] = []

    def answer(r: Request) -> tuple[int, Any]:
        if r.content_type == APPLY:
            applies.append(1)
            managed = [OURS_ENTRY, theirs, agent] if len(applies) == 1 else [OURS_ENTRY, agent]
            return 200, with_rv(r.body, str(41 + len(applies)), managedFields=managed)
        return 200, with_rv({"metadata": {}}, "50")

    fake = FakeApiClient(answer=answer)
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", {"policy": "blue"}) == "43"
    first, takeover, again = fake.requests
    assert first.content_type == again.content_type == APPLY and again.body == first.body
    assert (takeover.method, takeover.path, takeover.content_type) == ("PATCH", PN_PATH, "application/json-patch+json")
    test, replace = takeover.body
    assert test == {"op": "test", "path": "/metadata/resourceVersion", "value": "42"}
    assert replace["path"] == "/metadata/managedFields"
    managers = {(e["manager"], e["operation"]): e for e in replace["value"]}
    assert set(managers) == {("proxyshift", "Apply"), ("proxyshift-agent", "Update")}  # theirs owned only spec
    assert managers[("proxyshift", "Apply")]["fieldsV1"]["f:spec"] == {
        "f:policy": {}, "f:revision": {}, "f:migration": {"f:toRevision": {}}}


def test_a_merge_into_the_spec_is_one_apply_guarded_by_the_resource_version() -> None:
    live = {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode",
            "metadata": {"name": "n1", "resourceVersion": "7", "managedFields": [OURS_ENTRY]},
            "spec": {"policy": "green", "revision": "green-1"}}

    def answer(r: Request) -> tuple[int, Any]:
        return (200, live) if r.method == "GET" else (200, with_rv(r.body, "8", managedFields=[OURS_ENTRY]))

    fake = FakeApiClient(answer=answer)
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", {"policy": "blue"}, replace=False) == "8"
    get, apply = fake.requests
    assert get.method == "GET"
    assert_apply(apply, PN_PATH, force=True)
    assert apply.body["metadata"]["resourceVersion"] == "7"
    assert apply.body["spec"] == {"policy": "blue", "revision": "green-1"}


def test_an_empty_merge_into_an_existing_proxynode_writes_nothing() -> None:
    live = {"metadata": {"name": "n1", "resourceVersion": "7"}, "spec": {"policy": "green"}}
    fake = FakeApiClient(answer=lambda r: (200, live))
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", {}, replace=False) == "7"
    assert [r.method for r in fake.requests] == ["GET"]


def test_a_missing_proxynode_is_created_without_a_spec_before_a_merge() -> None:
    created: dict[str, Any] = {}

    def answer(r: Request) -> tuple[int, Any]:
        if r.method == "GET":
            return (200, created) if created else (404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if r.method == "POST":
            created.update(with_rv(r.body, "3"))
            return 201, created
        return 200, with_rv(r.body, "4", managedFields=[OURS_ENTRY])

    fake = FakeApiClient(answer=answer)
    assert ClusterAPI(fake).ensure_proxynode("n1", "uid-1", {"policy": "blue"}, replace=False) == "4"
    get, post, apply = fake.requests
    assert get.method == "GET"
    assert (post.method, post.query["fieldManager"], post.body["spec"]) == ("POST", [FIELD_MANAGER], {})
    assert post.body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert apply.body["spec"] == {"policy": "blue"} and apply.body["metadata"]["resourceVersion"] == "3"


# ---- managedFields arithmetic (pure) ----


def test_union_of_field_sets() -> None:
    a: dict[str, Any] = {"f:spec": {"f:policy": {}, "f:migration": {"f:phase": {}}}}
    b: dict[str, Any] = {"f:spec": {"f:migration": {"f:toRevision": {}}, "f:operation": {".": {}, "f:id": {}}}}
    assert union_fields(a, b) == {"f:spec": {"f:policy": {}, "f:migration": {"f:phase": {}, "f:toRevision": {}},
                                             "f:operation": {".": {}, "f:id": {}}}}
    assert a == {"f:spec": {"f:policy": {}, "f:migration": {"f:phase": {}}}}  # inputs untouched


def test_nothing_to_take_when_only_proxyshift_owns_the_spec() -> None:
    status = {"manager": "agent", "operation": "Update", "subresource": "status", "fieldsV1": {"f:status": {}}}
    assert take_spec_ownership([OURS_ENTRY, status], "proxyshift.io/v1alpha1") is None
    assert foreign_spec_owners([OURS_ENTRY, status]) == []
    # proxyshift's own create (operation Update) counts as another manager: only Apply removes what it drops.
    created = {"manager": "proxyshift", "operation": "Update", "fieldsV1": {"f:spec": {"f:policy": {}},
                                                                            "f:metadata": {"f:labels": {}}}}
    assert foreign_spec_owners([OURS_ENTRY, created]) == ["proxyshift (Update)"]
    taken = take_spec_ownership([created], "proxyshift.io/v1alpha1")
    assert taken is not None
    assert {(e["manager"], e["operation"]): e["fieldsV1"] for e in taken} == {
        ("proxyshift", "Update"): {"f:metadata": {"f:labels": {}}},
        ("proxyshift", "Apply"): {"f:spec": {"f:policy": {}}},
    }


# ---- built-in kinds as JSON (controller/rest.py), without the client's typed API classes ----


def test_node_patches_are_strategic_merges_and_a_label_is_removed_with_null() -> None:
    fake = FakeApiClient(answer=lambda r: (200, {"metadata": {"name": "n1", "resourceVersion": "7"}}))
    api = ClusterAPI(fake)
    assert api.set_node_label("n1", "proxyshift.io/revision", None) == "7"
    assert api.set_unschedulable("n1", False) == "7"
    label, schedulable = fake.requests
    assert (label.method, label.path, label.content_type) == ("PATCH", "/api/v1/nodes/n1",
                                                               "application/strategic-merge-patch+json")
    assert label.body == {"metadata": {"labels": {"proxyshift.io/revision": None}}}
    assert schedulable.body == {"spec": {"unschedulable": None}}


def test_the_replacement_label_rides_in_the_revision_label_patch() -> None:
    fake = FakeApiClient(answer=lambda r: (200, {"metadata": {"name": "n1", "resourceVersion": "8"}}))
    ClusterAPI(fake).set_node_label("n1", "proxyshift.io/revision", "blue-1",
                                    with_labels={"proxyshift.io/kube-proxy-replacement": "cilium"})
    (patch,) = fake.requests
    assert patch.body == {"metadata": {"labels": {"proxyshift.io/revision": "blue-1",
                                                  "proxyshift.io/kube-proxy-replacement": "cilium"}}}


def test_a_cilium_node_config_is_applied_server_side_and_its_missing_kind_is_no_error_on_delete() -> None:
    fake = FakeApiClient(answer=lambda r: (200, {"metadata": {"name": "proxyshift-b-1", "resourceVersion": "9"}}))
    api = ClusterAPI(fake)
    desired = {"apiVersion": "cilium.io/v2", "kind": "CiliumNodeConfig",
               "metadata": {"name": "proxyshift-b-1", "namespace": "kube-system"}, "spec": {}}
    assert api.apply_node_config(desired) == "9"
    (apply,) = fake.requests
    assert (apply.method, apply.path) == ("PATCH", "/apis/cilium.io/v2/namespaces/kube-system/ciliumnodeconfigs/"
                                                   "proxyshift-b-1")
    assert apply.content_type == "application/apply-patch+yaml"
    fake.answer = lambda r: (404, {"kind": "Status", "message": "the server could not find the requested resource"})
    api.delete_node_config("cilium.io/v2", "CiliumNodeConfig", "proxyshift-b-1")  # no CRD, nothing to delete


def test_an_error_answer_is_an_api_exception_with_its_status() -> None:
    fake = FakeApiClient(answer=lambda r: (404, {"kind": "Status", "message": "configmaps \"x\" not found"}))
    assert ClusterAPI(fake).read_configmap("x") is None  # 404 on a read: absent
    fake.answer = lambda r: (409, {"kind": "Status", "message": "conflict"})
    with pytest.raises(client.ApiException) as caught:
        ClusterAPI(fake).set_node_label("n1", "k", "v")
    assert caught.value.status == 409 and "conflict" in str(caught.value.body)


def test_an_event_is_posted_as_json_with_what_is_known_of_its_object() -> None:
    fake = FakeApiClient(answer=lambda r: (201, r.body))
    ClusterAPI(fake).emit_event(kind="Node", name="n1", uid=None, namespace=None, reason="Migrated",
                                message="now running nftables", api_version="v1")
    (req,) = fake.requests
    assert (req.method, req.path) == ("POST", "/api/v1/namespaces/default/events")
    assert req.body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert req.body["metadata"] == {"generateName": "n1.", "namespace": "default"}
    assert (req.body["reason"], req.body["type"], req.body["count"]) == ("Migrated", "Normal", 1)
    assert req.body["source"] == {"component": "proxyshift"} and req.body["firstTimestamp"].endswith("Z")


def test_a_drain_evicts_only_what_it_must_and_counts_what_is_left() -> None:
    def pod(name: str, **meta: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "apps", **meta}, "status": {"phase": "Running"}}

    listed = [pod("web"), pod("proxy", ownerReferences=[{"kind": "DaemonSet", "name": "kube-proxy"}]),
              pod("static", annotations={"kubernetes.io/config.mirror": "x"}),
              pod("going", deletionTimestamp="2026-12-03T07:00:00Z"), pod("pdb")]

    def answer(r: Request) -> tuple[int, Any]:
        if r.method == "GET":
            return 200, {"items": listed}
        return (429, {"kind": "Status", "message": "budget"}) if "/pdb/" in r.path else (201, {})

    fake = FakeApiClient(answer=answer)
    remaining, blocked = ClusterAPI(fake).evict_pods("n1")
    assert (remaining, blocked) == (3, ["apps/pdb: disruption budget"])
    listing, *evictions = fake.requests
    assert listing.path == "/api/v1/pods" and listing.query == {"fieldSelector": ["spec.nodeName=n1"]}
    assert [(e.method, e.path) for e in evictions] == [("POST", "/api/v1/namespaces/apps/pods/web/eviction"),
                                                      ("POST", "/api/v1/namespaces/apps/pods/pdb/eviction")]
    assert evictions[0].body == {"apiVersion": "policy/v1", "kind": "Eviction",
                                 "metadata": {"name": "web", "namespace": "apps"}}


def test_a_collection_lists_and_watches_with_the_client_s_argument_names() -> None:
    fake = FakeApiClient(answer=lambda r: (200, {"items": [], "metadata": {"resourceVersion": "9"}}))
    pods = Collection("/api/v1/namespaces/kube-system/pods").for_client(fake)
    answer = pods.list(label_selector="k8s-app=kube-proxy", limit=500, _continue="tok", _preload_content=False,
                       _request_timeout=(10, 120))
    assert json.loads(answer.data)["metadata"]["resourceVersion"] == "9"
    pods.list(watch=True, resource_version="9", allow_watch_bookmarks=True, timeout_seconds=300,
              _preload_content=False)
    listing, watching = fake.requests
    assert listing.query == {"labelSelector": ["k8s-app=kube-proxy"], "limit": ["500"], "continue": ["tok"]}
    assert watching.query == {"watch": ["true"], "resourceVersion": ["9"], "allowWatchBookmarks": ["true"],
                              "timeoutSeconds": ["300"]}
    with pytest.raises(TypeError):
        pods.list(pretty=True, _preload_content=False)


def test_the_operator_imports_none_of_the_client_s_typed_api_classes_for_built_in_kinds() -> None:
    # Each costs tens of MB of pydantic validators in the operator (controller/rest.py); run apart so that
    # what other tests imported does not count.
    code = ("import sys\n"
            "import proxyshift.controller.handlers, proxyshift.controller.main\n"
            "from proxyshift.controller.fleet import Fleet\n"
            "from proxyshift.controller.kube import ClusterAPI\n"
            "from proxyshift.controller.settings import CONFIG\n"
            "from proxyshift.controller.wakeups import Wakers\n"
            "ClusterAPI()\n"
            "Fleet(Wakers()).build(CONFIG)\n"
            "print(sorted(m for m in sys.modules if m.startswith('kubernetes.client.api.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['kubernetes.client.api.custom_objects_api']"
