"""The operator's writes to the Kubernetes API, one method per idempotent step.

Synchronous `kubernetes` client calls, run by the rollout loop in a worker
thread. Every method can be called again after a crash with the same
arguments and leaves the same result: apply-to-value, patch-to-value,
delete-if-present.

The objects the operator manages (revision ConfigMaps and DaemonSets, ProxyNode specs) are written with
server-side apply under the field manager `proxyshift` (render/apply.py says why). The baseline
DaemonSet is not ours: its one-time affinity stays a JSON patch with `test` operations, which changes
exactly that and records its exact undo, where an apply would make `proxyshift` a co-owner of the
baseline's fields.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

import jsonpatch
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from proxyshift import render
from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.controller.rest import STRATEGIC_MERGE, Rest
from proxyshift.controller.settings import CONFIG

log = logging.getLogger(__name__)

PROXYNODES = "proxynodes"
JSON_PATCH = "application/json-patch+json"
PROXYPOLICIES = "proxypolicies"
# The OpenAPI v3 document of our group is about 160 KB with both CRDs; a far larger one is not parsed.
OPENAPI_READ_LIMIT = 16 * 1024 * 1024
OPENAPI_TIMEOUT = 30.0


# force on revision objects: they are ours alone (named after the revision, only the operator's
# ServiceAccount may write them, config/admission). A field another manager set there (a person's
# `kubectl edit`, or the create and strategic-merge patch of an operator from before apply) must still
# follow the rendering, so the operator takes it over instead of failing on the conflict.
REVISION_FORCE = True


def _apply_options(*, force: bool) -> dict[str, Any]:
    """The keyword arguments of a server-side apply through the kubernetes client's patch_* methods."""
    return {"field_manager": render.FIELD_MANAGER, "force": force, "_content_type": render.APPLY_PATCH}


def _rest_apply_options(*, force: bool) -> dict[str, Any]:
    """The query and body type of a server-side apply through rest.Rest."""
    return {"query": {"fieldManager": render.FIELD_MANAGER, "force": force}, "content_type": render.APPLY_PATCH}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ignore(status: int, exc: ApiException) -> None:
    if exc.status != status:
        raise exc


class ClusterAPI:
    """Access to the objects the operator reads and writes: custom resources through the client's
    CustomObjectsApi, built-in kinds as JSON through controller/rest.py (not the typed CoreV1Api and
    AppsV1Api, whose import alone costs ~87 MB of memory)."""

    def __init__(self, api_client: client.ApiClient | None = None, namespace: str = CONFIG.kube_proxy_namespace
                 ) -> None:
        self.api_client = api_client or client.ApiClient()
        self.rest = Rest(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.namespace = namespace  # kube-proxy's: its baseline and the revision objects live there

    def _configmap_path(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps/{name}"

    def _daemonset_path(self, name: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/daemonsets/{name}"

    # ---- nodes ----

    def set_node_label(self, node: str, key: str, value: str | None,
                       with_labels: Mapping[str, str | None] | None = None) -> str:
        """Returns the Node's new resourceVersion. A merge patch with null removes the label. `with_labels` go in
        the same patch, so the node never carries one of them without the others."""
        labels = {**(with_labels or {}), key: value}
        patched = self.rest.json("PATCH", f"/api/v1/nodes/{node}", body={"metadata": {"labels": labels}},
                                 content_type=STRATEGIC_MERGE)
        return str(patched["metadata"]["resourceVersion"])

    def set_unschedulable(self, node: str, unschedulable: bool) -> str:
        patched = self.rest.json("PATCH", f"/api/v1/nodes/{node}",
                                 body={"spec": {"unschedulable": unschedulable or None}}, content_type=STRATEGIC_MERGE)
        return str(patched["metadata"]["resourceVersion"])

    def evict_pods(self, node: str) -> tuple[int, list[str]]:
        """Evict the node's pods except DaemonSet and mirror pods; PDBs are honoured by the API.

        Returns (pods still to go, messages of evictions a PodDisruptionBudget refused).
        """
        pods = self.rest.json("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"}).get("items")
        remaining = 0
        blocked: list[str] = []
        for pod in pods or []:
            meta = pod.get("metadata") or {}
            name, namespace = str(meta.get("name")), str(meta.get("namespace"))
            if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
                continue
            if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            remaining += 1
            if meta.get("deletionTimestamp"):
                continue
            body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
            try:
                self.rest.call("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", body=body).read()
            except ApiException as exc:
                if exc.status == 429:
                    blocked.append(f"{namespace}/{name}: disruption budget")
                elif exc.status != 404:
                    raise
        return remaining, blocked

    # ---- ProxyNodes ----

    def get_proxynode(self, name: str) -> dict[str, Any] | None:
        try:
            # The custom-objects API types every answer `object`: it is the decoded JSON, a dict here.
            return cast(dict[str, Any], self.custom.get_cluster_custom_object(API_GROUP, API_VERSION, PROXYNODES, name))
        except ApiException as exc:
            _ignore(404, exc)
            return None

    def ensure_proxynode(self, name: str, node_uid: str | None, spec: dict[str, Any], *, replace: bool = True) -> str:
        """Write the ProxyNode's spec (replace it, or merge into it), creating the ProxyNode if missing.

        Returns the resulting resourceVersion.
        """
        if replace:
            return self.apply_proxynode_spec(name, node_uid, spec)
        for _ in range(5):
            live = self.get_proxynode(name)
            if live is None:
                # Created without a spec: an apply of `spec` here could race a SetMigration's apply of the
                # whole spec and, applied last, drop its fields (both are the manager `proxyshift`).
                live = self._create_proxynode(name, node_uid)
            live_spec = live.get("spec") or {}
            # A merge patch's rules: None removes the field.
            merged = {k: v for k, v in {**live_spec, **spec}.items() if v is not None}
            if merged == live_spec:
                return str(live["metadata"]["resourceVersion"])
            try:
                # The resourceVersion makes this read-merge-apply one step: a spec written meanwhile is a 409.
                return self.apply_proxynode_spec(name, node_uid, merged,
                                                 resource_version=str(live["metadata"]["resourceVersion"]))
            except ApiException as exc:
                _ignore(409, exc)
        raise RuntimeError(f"ProxyNode {name}: its spec kept changing under a merge, five times in a row")

    def _create_proxynode(self, name: str, node_uid: str | None) -> dict[str, Any]:
        try:
            return cast(dict[str, Any], self.custom.create_cluster_custom_object(
                API_GROUP, API_VERSION, PROXYNODES, self._proxynode_body(name, node_uid, {}),
                field_manager=render.FIELD_MANAGER))
        except ApiException as exc:
            _ignore(409, exc)  # created meanwhile (by a peer or the inventory)
        live = self.get_proxynode(name)
        if live is None:
            raise RuntimeError(f"ProxyNode {name} was created and is gone again")
        return live

    @staticmethod
    def _proxynode_body(name: str, node_uid: str | None, spec: dict[str, Any],
                        resource_version: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "ProxyNode",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "proxyshift"}},
            "spec": {k: v for k, v in spec.items() if v is not None},
        }
        if node_uid:
            # Owned by the Node: deleting the Node garbage-collects its ProxyNode.
            body["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}
            ]
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
        return body

    def apply_proxynode_spec(self, name: str, node_uid: str | None, spec: dict[str, Any],
                             resource_version: str | None = None) -> str:
        """Server-side apply of the whole spec (None leaves a field out): a field the planner dropped, e.g. an
        old toRevision inside migration or an old operation's params, is removed because `proxyshift`
        applied it before and applies it no more. Returns the resulting resourceVersion."""
        body = self._proxynode_body(name, node_uid, spec, resource_version)
        applied = self._apply_proxynode(name, body)
        meta = applied["metadata"]
        owned = render.take_spec_ownership(meta.get("managedFields"), body["apiVersion"])
        if owned is None:
            return str(meta["resourceVersion"])
        # Another manager owns spec fields, so a field this apply left out may have stayed: hand its
        # ownership to `proxyshift` (only if nothing changed meanwhile) and apply again, which removes it.
        log.info("ProxyNode %s: taking over the spec fields of %s", name,
                 ", ".join(render.foreign_spec_owners(meta.get("managedFields"))))
        takeover = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
                    {"op": "replace", "path": "/metadata/managedFields", "value": owned}]
        try:
            self.custom.patch_cluster_custom_object(API_GROUP, API_VERSION, PROXYNODES, name, takeover,
                                                    _content_type=JSON_PATCH)
        except ApiException as exc:
            # 409 (a write came between, the resourceVersion test failed, a 422 on some servers): the
            # next SetMigration applies and tries again.
            if exc.status not in (409, 422):
                raise
            return str(meta["resourceVersion"])
        return str(self._apply_proxynode(name, body)["metadata"]["resourceVersion"])

    def _apply_proxynode(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        # force: the operator alone owns the spec (the agent writes only the status subresource); a
        # person's `kubectl edit` or the pre-apply operator's own patches must not block the rollout.
        # Read raw: the client maps only a 200 answer of a custom-object patch to its body, and an apply
        # that creates the ProxyNode answers 201.
        answer = self.custom.patch_cluster_custom_object(API_GROUP, API_VERSION, PROXYNODES, name, body,
                                                         _preload_content=False, **_apply_options(force=True))
        # With _preload_content=False the answer is urllib3's response, which the client types `object`.
        return cast(dict[str, Any], json.loads(cast(Any, answer).data))

    def unserved_resources(self, *, with_peering: bool) -> list[str]:
        """The custom resources the operator needs that the API server does not serve (their CRD is missing)."""
        wanted = [(API_GROUP, API_VERSION, PROXYPOLICIES), (API_GROUP, API_VERSION, PROXYNODES)]
        if with_peering:
            wanted.append(("kopf.dev", "v1", "clusterkopfpeerings"))
        served: dict[tuple[str, str], set[str]] = {}
        for group, version in dict.fromkeys((g, v) for g, v, _ in wanted):
            try:
                listed = self.custom.get_api_resources(group, version)
                served[(group, version)] = {r.name for r in listed.resources or []}
            except ApiException as exc:
                _ignore(404, exc)  # the group/version is not served at all
                served[(group, version)] = set()
        return [f"{plural}.{group}/{version}" for group, version, plural in wanted
                if plural not in served[(group, version)]]

    def served_openapi(self, group: str = API_GROUP, version: str = API_VERSION) -> dict[str, Any] | None:
        """The API server's OpenAPI v3 document of proxyshift's group and version (api/schema_drift.py reads the
        served CRD schemas in it); None when the API server publishes none or does not let the operator read
        it, so the caller can say the schemas went unchecked."""
        try:
            answer = self.rest.call("GET", f"/openapi/v3/apis/{group}/{version}", timeout=OPENAPI_TIMEOUT)
        except ApiException as exc:
            if exc.status in (403, 404):
                log.warning("cannot read the served CRD schemas (/openapi/v3, HTTP %s): not checked against this "
                            "version's", exc.status)
                return None
            raise
        data = answer.read()  # the client has read it whole already; the bound is on what is parsed
        if len(data) > OPENAPI_READ_LIMIT:
            log.warning("the API server's OpenAPI v3 document of %s/%s is over %d bytes: the served CRD schemas "
                        "are not checked", group, version, OPENAPI_READ_LIMIT)
            return None
        document = json.loads(data)
        return document if isinstance(document, dict) else None

    def ensure_peering(self, name: str) -> None:
        body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
        try:
            self.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
        except ApiException as exc:
            _ignore(409, exc)

    # ---- policies ----

    def patch_policy_status(self, name: str, status: dict[str, Any]) -> None:
        try:
            self.custom.patch_cluster_custom_object_status(
                API_GROUP, API_VERSION, PROXYPOLICIES, name, {"status": status}
            )
        except ApiException as exc:
            _ignore(404, exc)

    # ---- revisions and the baseline (namespace kube-system) ----

    def read_configmap(self, name: str) -> dict[str, Any] | None:
        try:
            return self.rest.json("GET", self._configmap_path(name))
        except ApiException as exc:
            _ignore(404, exc)
            return None

    def read_daemonset(self, name: str) -> dict[str, Any] | None:
        try:
            return self.rest.json("GET", self._daemonset_path(name))
        except ApiException as exc:
            _ignore(404, exc)
            return None

    def apply_configmap(self, desired: dict[str, Any]) -> str:
        """Server-side apply of the rendered ConfigMap (creates it if missing). Returns its resourceVersion;
        an unchanged rendering writes nothing and keeps it."""
        applied = self.rest.json("PATCH", self._configmap_path(desired["metadata"]["name"]), body=desired,
                                 **_rest_apply_options(force=REVISION_FORCE))
        return str(applied["metadata"]["resourceVersion"])

    def apply_daemonset(self, desired: dict[str, Any]) -> str:
        """Server-side apply of the rendered DaemonSet (creates it if missing). Returns its resourceVersion;
        an unchanged rendering writes nothing: no new generation, no rollout.

        The one change apply cannot make is the immutable selector (refused, 422): then the DaemonSet
        is deleted and created again, its pods replaced by the new one's.
        """
        name = desired["metadata"]["name"]
        try:
            return self._apply_daemonset(desired)
        except ApiException as exc:
            if exc.status != 422:
                raise
            live = self.read_daemonset(name)
            if live is None or not render.needs_recreate(live, desired):
                raise
        log.warning("DaemonSet %s/%s: its selector changed with the baseline's; deleting and creating it again",
                    self.namespace, name)
        # Foreground: the new DaemonSet must not find the old one's pods still there under the same name.
        self.rest.call("DELETE", self._daemonset_path(name), query={"propagationPolicy": "Foreground"}).read()
        for _ in range(60):
            if self.read_daemonset(name) is None:
                break
            time.sleep(1)
        return self._apply_daemonset(desired)

    def _apply_daemonset(self, desired: dict[str, Any]) -> str:
        applied = self.rest.json("PATCH", self._daemonset_path(desired["metadata"]["name"]), body=desired,
                                 **_rest_apply_options(force=REVISION_FORCE))
        return str(applied["metadata"]["resourceVersion"])

    def _object_path(self, api_version: str, kind: str, name: str) -> str:
        # A custom resource's plural is its kind in lower case plus "s" (CiliumNodeConfig: ciliumnodeconfigs).
        return f"/apis/{api_version}/namespaces/{self.namespace}/{kind.lower()}s/{name}"

    def apply_node_config(self, desired: dict[str, Any]) -> str:
        """Server-side apply of a replacement's per-node config (a CiliumNodeConfig) in the revisions' namespace.
        A 404 means the cluster does not serve the kind (Cilium's CRDs are not installed)."""
        path = self._object_path(desired["apiVersion"], desired["kind"], desired["metadata"]["name"])
        applied = self.rest.json("PATCH", path, body=desired, **_rest_apply_options(force=REVISION_FORCE))
        return str(applied["metadata"]["resourceVersion"])

    def delete_node_config(self, api_version: str, kind: str, name: str) -> None:
        """Gone already, or a kind the cluster does not serve: nothing to delete either way (404)."""
        try:
            self.rest.call("DELETE", self._object_path(api_version, kind, name)).read()
        except ApiException as exc:
            _ignore(404, exc)

    def delete_configmap(self, name: str) -> None:
        try:
            self.rest.call("DELETE", self._configmap_path(name)).read()
        except ApiException as exc:
            _ignore(404, exc)

    def delete_daemonset(self, name: str) -> None:
        try:
            self.rest.call("DELETE", self._daemonset_path(name), query={"propagationPolicy": "Background"}).read()
        except ApiException as exc:
            _ignore(404, exc)

    def json_patch_daemonset(self, name: str, patch: jsonpatch.JsonPatch) -> None:
        self.rest.call("PATCH", self._daemonset_path(name), body=list(patch), content_type=JSON_PATCH).read()

    # ---- events ----

    def emit_event(self, *, kind: str, name: str, uid: str | None, namespace: str | None,
                   reason: str, message: str, type_: str = "Normal",
                   api_version: str = f"{API_GROUP}/{API_VERSION}") -> None:
        stamp = now_rfc3339()
        event_ns = namespace or "default"
        involved = {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "namespace": namespace}
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": event_ns},
            "involvedObject": {k: v for k, v in involved.items() if v is not None},
            "reason": reason, "message": message[:1024], "type": type_,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
            "source": {"component": "proxyshift"},
            "reportingComponent": "proxyshift.io/operator", "reportingInstance": "proxyshift",
        }
        try:
            self.rest.call("POST", f"/api/v1/namespaces/{event_ns}/events", body=body).read()
        except ApiException as exc:  # an Event is a courtesy: never fail a step because of it
            log.warning("could not record event %s on %s/%s: %s", reason, kind, name, exc.reason)


def describe_api_error(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message", exc.reason))  # type: ignore[arg-type]  # None: TypeError below
    except (TypeError, ValueError):
        return str(exc.reason)
