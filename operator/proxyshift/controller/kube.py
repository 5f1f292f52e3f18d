"""The operator's writes to the Kubernetes API, one method per idempotent step.

Synchronous `kubernetes` client calls, run by the rollout loop in a worker
thread. Every method can be called again after a crash with the same
arguments and leaves the same result: create-or-leave, patch-to-value,
delete-if-present.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, cast

import jsonpatch
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.controller.settings import CONFIG

log = logging.getLogger(__name__)

PROXYNODES = "proxynodes"
JSON_PATCH = "application/json-patch+json"
PROXYPOLICIES = "proxypolicies"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ignore(status: int, exc: ApiException) -> None:
    if exc.status != status:
        raise exc


class ClusterAPI:
    """Typed access to the objects the operator reads and writes."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api_client = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.policy_api = client.PolicyV1Api(self.api_client)
        self.namespace = CONFIG.kube_proxy_namespace

    # ---- nodes ----

    def set_node_label(self, node: str, key: str, value: str | None) -> str:
        """Returns the Node's new resourceVersion. A merge patch with null removes the label."""
        patched = self.core.patch_node(node, {"metadata": {"labels": {key: value}}})
        return str(cast(client.V1ObjectMeta, patched.metadata).resource_version)

    def set_unschedulable(self, node: str, unschedulable: bool) -> str:
        patched = self.core.patch_node(node, {"spec": {"unschedulable": unschedulable or None}})
        return str(cast(client.V1ObjectMeta, patched.metadata).resource_version)

    def evict_pods(self, node: str) -> tuple[int, list[str]]:
        """Evict the node's pods except DaemonSet and mirror pods; PDBs are honoured by the API.

        Returns (pods still to go, messages of evictions a PodDisruptionBudget refused).
        """
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
        remaining = 0
        blocked: list[str] = []
        for pod in pods:
            # The API server fills metadata (name, namespace) and status of every listed pod; the client's
            # models type them all Optional.
            meta = cast(client.V1ObjectMeta, pod.metadata)
            name, namespace = cast(str, meta.name), cast(str, meta.namespace)
            owners = meta.owner_references or []
            if any(o.kind == "DaemonSet" for o in owners):
                continue
            if "kubernetes.io/config.mirror" in (meta.annotations or {}):
                continue
            if cast(client.V1PodStatus, pod.status).phase in ("Succeeded", "Failed"):
                continue
            remaining += 1
            if meta.deletion_timestamp:
                continue
            body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=namespace))
            try:
                self.core.create_namespaced_pod_eviction(name, namespace, body)
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
        try:
            if not replace:
                patched = cast(dict[str, Any], self.custom.patch_cluster_custom_object(
                    API_GROUP, API_VERSION, PROXYNODES, name, {"spec": spec}))
                return str(patched["metadata"]["resourceVersion"])
            return self.patch_proxynode_spec(name, spec)
        except ApiException as exc:
            _ignore(404, exc)
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
        try:
            created = cast(dict[str, Any],
                           self.custom.create_cluster_custom_object(API_GROUP, API_VERSION, PROXYNODES, body))
            return str(created["metadata"]["resourceVersion"])
        except ApiException as exc:
            _ignore(409, exc)  # created meanwhile (by a peer): write it again
            return self.ensure_proxynode(name, node_uid, spec, replace=replace)

    def patch_proxynode_spec(self, name: str, spec: dict[str, Any]) -> str:
        """Replace the whole spec (JSON patch `add /spec`): a merge patch would keep keys the planner dropped,
        e.g. an old toRevision inside migration or an old operation's params."""
        body = [{"op": "add", "path": "/spec", "value": {k: v for k, v in spec.items() if v is not None}}]
        patched = cast(dict[str, Any], self.custom.patch_cluster_custom_object(
            API_GROUP, API_VERSION, PROXYNODES, name, body, _content_type=JSON_PATCH))
        return str(patched["metadata"]["resourceVersion"])

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
            obj = self.core.read_namespaced_config_map(name, self.namespace)
            return self.api_client.sanitize_for_serialization(obj)
        except ApiException as exc:
            _ignore(404, exc)
            return None

    def read_daemonset(self, name: str) -> dict[str, Any] | None:
        try:
            obj = self.apps.read_namespaced_daemon_set(name, self.namespace)
            return self.api_client.sanitize_for_serialization(obj)
        except ApiException as exc:
            _ignore(404, exc)
            return None

    def apply_configmap(self, desired: dict[str, Any]) -> None:
        name = desired["metadata"]["name"]
        try:
            # The client's validation turns the dict body into the model it is typed with.
            self.core.create_namespaced_config_map(self.namespace, desired)  # type: ignore[arg-type]
        except ApiException as exc:
            _ignore(409, exc)
            self.core.patch_namespaced_config_map(name, self.namespace, desired)

    def apply_daemonset(self, desired: dict[str, Any]) -> None:
        name = desired["metadata"]["name"]
        try:
            # The client's validation turns the dict body into the model it is typed with.
            self.apps.create_namespaced_daemon_set(self.namespace, desired)  # type: ignore[arg-type]
        except ApiException as exc:
            _ignore(409, exc)
            self.apps.patch_namespaced_daemon_set(name, self.namespace, desired)

    def delete_configmap(self, name: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, self.namespace)
        except ApiException as exc:
            _ignore(404, exc)

    def delete_daemonset(self, name: str) -> None:
        try:
            self.apps.delete_namespaced_daemon_set(name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            _ignore(404, exc)

    def json_patch_daemonset(self, name: str, patch: jsonpatch.JsonPatch) -> None:
        self.apps.patch_namespaced_daemon_set(name, self.namespace, list(patch), _content_type=JSON_PATCH)

    # ---- events ----

    def emit_event(self, *, kind: str, name: str, uid: str | None, namespace: str | None,
                   reason: str, message: str, type_: str = "Normal",
                   api_version: str = f"{API_GROUP}/{API_VERSION}") -> None:
        stamp = now_rfc3339()
        event_ns = namespace or "default"
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=event_ns),
            involved_object=client.V1ObjectReference(
                api_version=api_version, kind=kind, name=name, uid=uid, namespace=namespace
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            # The model (pydantic) parses the RFC 3339 text into its datetime.
            first_timestamp=stamp,  # type: ignore[arg-type]
            last_timestamp=stamp,  # type: ignore[arg-type]
            count=1,
            source=client.V1EventSource(component="proxyshift"),
            reporting_component="proxyshift.io/operator",
            reporting_instance="proxyshift",
        )
        try:
            self.core.create_namespaced_event(event_ns, body)
        except ApiException as exc:  # an Event is a courtesy: never fail a step because of it
            log.warning("could not record event %s on %s/%s: %s", reason, kind, name, exc.reason)


def describe_api_error(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message", exc.reason))  # type: ignore[arg-type]  # None: TypeError below
    except (TypeError, ValueError):
        return str(exc.reason)
