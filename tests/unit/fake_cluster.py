"""An in-memory stand-in for the API calls the operator's reconcile step makes (controller/kube.py's
ClusterAPI), wired to a real OperatorRuntime: every write lands in the fake's objects and echoes back
into the runtime's mirrors and the kopf index stores, as the watches would deliver it.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.executor import Executor
from proxyshift.controller.fleet import (
    NODES,
    PODS,
    PROXYNODE_MIRROR,
    REPLACEMENT_REVISIONS,
    REVISIONS,
    node_item,
    pod_item,
    proxynode_item,
    replacement_revision_item,
    revision_daemonset_item,
)
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.reconcile import Indexes
from proxyshift.controller.runtime import OperatorRuntime
from proxyshift.controller.snapshot import baseline_mode
from proxyshift.planner.timeutil import fmt
from proxyshift.planner.world import daemonset_for
from proxyshift.render import ANNOTATION_MODE, LABEL_REVISION

BASELINE = Path(__file__).parent.parent / "fixtures" / "baseline"
NAMESPACE = "kube-system"
# What an agent reports about its node before any policy: enough for every mode's preflight.
INVENTORY = {"kernelRelease": "6.8.0", "modules": ["nf_conntrack", "nf_tables", "ip_vs", "ip_vs_rr"],
             "tools": {"nft": "1.0.9", "iptables": "1.8.10"}, "heartbeat": "2026-11-30T12:00:00Z"}


def policy(name: str = "blue", mode: str = "nftables", *, deleting: bool = False, **spec: Any) -> ProxyPolicy:
    metadata: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "generation": 1,
                                "creationTimestamp": "2026-11-30T10:00:00Z", "finalizers": ["proxyshift.io/finalizer"]}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T13:00:00Z"
    return ProxyPolicy.model_validate({
        "metadata": metadata,
        "spec": {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": mode,
                 "gate": {"timeout": "2m", "minSyncs": 1}, **spec},
    })


class FakeCluster:
    """The objects of a small cluster, changed only through the ClusterAPI calls the executor makes."""

    def __init__(self) -> None:
        self.rv = 100
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.proxynodes: dict[str, dict[str, Any]] = {}
        self.configmaps: dict[str, dict[str, Any]] = {
            "kube-proxy": yaml.safe_load((BASELINE / "kube-proxy-configmap.yaml").read_text())}
        self.daemonsets: dict[str, dict[str, Any]] = {
            "kube-proxy": yaml.safe_load((BASELINE / "kube-proxy-daemonset.yaml").read_text())}
        self.policy_status: dict[str, dict[str, Any]] = {}  # policy -> the last status written
        self.events: list[dict[str, Any]] = []
        self.calls: list[str] = []  # every call, in order
        self.writes: list[str] = []  # the revision objects an apply changed (an unchanged apply writes nothing)
        self.fail: dict[tuple[str, str], Exception] = {}  # (call, node or object name) -> raised instead
        self.runtime: OperatorRuntime | None = None
        self.echo_delay = 0.0  # seconds between a write and its watch event reaching the mirror
        self.revision_watch_away = False  # True: revision writes do not reach the mirrors (the API server restarts)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.index_policies: dict[str, list[ProxyPolicy]] = {}
        # Node configs of revisions of a mode without kube-proxy (Cilium's KPR).
        self.node_configs: dict[str, dict[str, Any]] = {}

    # ---- building the cluster ----

    def _next(self) -> str:
        self.rv += 1
        return str(self.rv)

    def add_node(self, name: str, labels: dict[str, str], *, proxynode_spec: dict[str, Any] | None = None,
                 proxynode_status: dict[str, Any] | None = None, daemonset: str = "kube-proxy") -> None:
        self.nodes[name] = {"metadata": {"name": name, "uid": f"uid-{name}", "labels": dict(labels),
                                         "resourceVersion": self._next()},
                            "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                                   "addresses": [{"type": "InternalIP", "address": "198.18.0.11"}]}}
        self.pods[f"{NAMESPACE}/{daemonset}-{name}"] = self._pod(name, daemonset)
        self.proxynodes[name] = {"metadata": {"name": name, "resourceVersion": self._next()},
                                 "spec": dict(proxynode_spec or {}), "status": dict(proxynode_status or INVENTORY)}

    def add_policy(self, p: ProxyPolicy) -> None:
        self.index_policies[p.name] = [p]

    def add_revision_daemonset(self, body: dict[str, Any]) -> None:
        self.daemonsets[body["metadata"]["name"]] = body
        self._echo_revisions()

    def runtime_for_test(self) -> OperatorRuntime:
        """A runtime over this fake, its mirrors filled from the objects (as after the first list); on the loop."""
        # Events posted inline (no background sender): a test reads them right after the step that made them.
        executor = Executor(self)  # type: ignore[arg-type]  # the fake has ClusterAPI's calls
        runtime = OperatorRuntime.create(self, executor=executor)  # type: ignore[arg-type]  # as above
        fleet = runtime.fleet
        fleet.mirrors[NODES] = Mirror(NODES, list, node_item, fleet.node_changed)
        fleet.mirrors[PODS] = Mirror(PODS, list, pod_item, fleet.pod_changed)
        fleet.mirrors[PROXYNODE_MIRROR] = Mirror(PROXYNODE_MIRROR, list, proxynode_item, fleet.proxynode_changed)
        fleet.mirrors[REVISIONS] = Mirror(REVISIONS, list, revision_daemonset_item, fleet.revision_daemonset_changed)
        fleet.mirrors[REPLACEMENT_REVISIONS] = Mirror(REPLACEMENT_REVISIONS, list, replacement_revision_item,
                                                      fleet.revision_changed)
        for mirror, objects, view in ((fleet.mirrors[NODES], self.nodes, node_item),
                                      (fleet.mirrors[PODS], self.pods, pod_item),
                                      (fleet.mirrors[PROXYNODE_MIRROR], self.proxynodes, proxynode_item)):
            mirror._replace_all(dict(found for body in objects.values() if (found := view(body)) is not None))
        self.runtime, self.loop = runtime, asyncio.get_running_loop()
        self._fill_revisions()
        return runtime

    def indexes(self) -> Indexes:
        return Indexes(
            policies=self.index_policies,
            baseline_configmap={"body": [self.configmaps["kube-proxy"]]},
            baseline_daemonset={"body": [{k: self.daemonsets["kube-proxy"].get(k)
                                          for k in ("apiVersion", "kind", "metadata", "spec")}]},
        )

    # ---- the node side: what the DaemonSet controller, the kubelet and the agent do between steps ----

    def kubelet(self, node: str) -> None:
        """The node runs the kube-proxy of the DaemonSet its revision label names (the baseline without one)."""
        revision = self.nodes[node]["metadata"]["labels"].get(LABEL_REVISION)
        want = daemonset_for(revision)
        for key in [k for k, pod in self.pods.items() if pod["spec"]["nodeName"] == node]:
            del self.pods[key]
        self.pods[f"{NAMESPACE}/{want}-{node}"] = self._pod(node, want)
        self._echo_pods()

    def agent(self, node: str, *, fail: str | None = None) -> None:
        """The node's agent runs the requested operation (once per id) and reports kube-proxy's facts."""
        pn = self.proxynodes[node]
        op = pn["spec"].get("operation")
        status = pn["status"]
        now = datetime.now(UTC)
        status["heartbeat"] = fmt(now)
        revision = self.nodes[node]["metadata"]["labels"].get(LABEL_REVISION)
        mode = self._mode_of(revision)
        started = now.timestamp() - 5
        status["observedMode"] = mode
        status["kubeProxy"] = {"proxyMode": mode, "healthzStatus": 200, "processStartTime": started,
                               "lastSyncTimestamp": started + 1, "syncCount": 3, "syncDurationP99Seconds": 0.05,
                               "syncFailures": 0, "probedAt": fmt(now)}
        if op is not None and (status.get("lastOperation") or {}).get("id") != op["id"]:
            services = (op.get("params") or {}).get("services") or []
            status["lastOperation"] = {
                "id": op["id"], "type": op["type"], "state": "Failed" if fail else "Succeeded",
                "message": fail or "ok", "startedAt": fmt(now), "finishedAt": fmt(now),
                "details": {"connects": {svc: True for svc in services}} if op["type"] == "Probe" else {},
            }
        pn["metadata"]["resourceVersion"] = self._next()
        self._echo(PROXYNODE_MIRROR, pn)

    def _mode_of(self, revision: str | None) -> str:
        if revision is None:
            return baseline_mode(self.configmaps["kube-proxy"])
        ds = self.daemonsets.get(daemonset_for(revision)) or {}
        return str((ds.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_MODE, ""))

    def _pod(self, node: str, daemonset: str) -> dict[str, Any]:
        return {
            "metadata": {"name": f"{daemonset}-{node}", "namespace": NAMESPACE,
                         "ownerReferences": [{"kind": "DaemonSet", "name": daemonset}]},
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"state": {"running": {"startedAt": fmt(datetime.now(UTC))}}}]},
        }

    def _fill_revisions(self) -> None:
        """The revision mirrors as a (re-)list would find the revision objects now."""
        assert self.runtime is not None
        mirrors = self.runtime.fleet.mirrors
        for name, objects, view in ((REVISIONS, self.daemonsets, revision_daemonset_item),
                                    (REPLACEMENT_REVISIONS, self.configmaps, replacement_revision_item)):
            mirrors[name]._replace_all(dict(found for body in objects.values() if (found := view(body)) is not None))

    def _echo_revisions(self) -> None:
        """A revision object written: the mirrors see it at once, as kopf's index did for these tests."""
        if self.runtime is not None and not self.revision_watch_away:
            self._fill_revisions()

    def _echo_pods(self) -> None:
        assert self.runtime is not None and self.loop is not None
        fresh = dict(found for body in self.pods.values() if (found := pod_item(body)) is not None)
        self.loop.call_soon_threadsafe(self.runtime.fleet.mirrors[PODS]._replace_all, fresh)

    # ---- the watch: a write comes back into the runtime's mirror, on the event loop ----

    def _echo(self, mirror: str, body: dict[str, Any]) -> None:
        assert self.runtime is not None and self.loop is not None
        view = {NODES: node_item, PROXYNODE_MIRROR: proxynode_item}[mirror]
        found = view(copy.deepcopy(body))
        assert found is not None
        apply, loop, delay = self.runtime.fleet.mirrors[mirror]._apply, self.loop, self.echo_delay
        loop.call_soon_threadsafe(lambda: loop.call_later(delay, apply, *found))

    def _call(self, name: str, key: str) -> None:
        self.calls.append(f"{name} {key}")
        if (name, key) in self.fail:
            raise self.fail[(name, key)]

    # ---- ClusterAPI ----

    def set_node_label(self, node: str, key: str, value: str | None,
                       with_labels: dict[str, str | None] | None = None) -> str:
        self._call("set_node_label", node)
        labels = self.nodes[node]["metadata"]["labels"]
        for name, wanted in {**(with_labels or {}), key: value}.items():
            if wanted is None:
                labels.pop(name, None)
            else:
                labels[name] = wanted
        self.nodes[node]["metadata"]["resourceVersion"] = rv = self._next()
        self._echo(NODES, self.nodes[node])
        return rv

    def set_unschedulable(self, node: str, unschedulable: bool) -> str:
        self._call("set_unschedulable", node)
        self.nodes[node]["spec"]["unschedulable"] = unschedulable
        self.nodes[node]["metadata"]["resourceVersion"] = rv = self._next()
        self._echo(NODES, self.nodes[node])
        return rv

    def evict_pods(self, node: str) -> tuple[int, list[str]]:
        self._call("evict_pods", node)
        return 0, []

    def ensure_proxynode(self, name: str, node_uid: str | None, spec: dict[str, Any], *, replace: bool = True) -> str:
        self._call("ensure_proxynode", name)
        pn = self.proxynodes.setdefault(name, {"metadata": {"name": name}, "spec": {}, "status": {}})
        clean = {k: v for k, v in spec.items() if v is not None}
        pn["spec"] = clean if replace else {**pn["spec"], **clean}
        pn["metadata"]["resourceVersion"] = rv = self._next()
        self._echo(PROXYNODE_MIRROR, pn)
        return rv

    def patch_policy_status(self, name: str, status: dict[str, Any]) -> None:
        self._call("patch_policy_status", name)
        self.policy_status[name] = status
        known = self.index_policies.get(name)
        if known:  # the policy index sees the status change, as kopf's watch would deliver it
            body = known[0].to_k8s()
            self.index_policies[name] = [ProxyPolicy.model_validate({**body, "status": status})]

    def read_configmap(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.configmaps.get(name))

    def read_daemonset(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.daemonsets.get(name))

    def _applied(self, store: dict[str, dict[str, Any]], desired: dict[str, Any]) -> tuple[bool, str]:
        """Server-side apply's rule for the fake: an unchanged rendering writes nothing, keeps the resourceVersion."""
        name = desired["metadata"]["name"]
        live = store.get(name)
        if live is not None:
            rv = live["metadata"].get("resourceVersion")
            unchanged = {**live, "metadata": {k: v for k, v in live["metadata"].items() if k != "resourceVersion"}}
            if rv and unchanged == desired:
                return False, rv
        body = copy.deepcopy(desired)
        body["metadata"]["resourceVersion"] = rv = self._next()
        store[name] = body
        self.writes.append(name)
        return True, rv

    def apply_configmap(self, desired: dict[str, Any]) -> str:
        self._call("apply_configmap", desired["metadata"]["name"])
        rv = self._applied(self.configmaps, desired)[1]
        self._echo_revisions()
        return rv

    def apply_node_config(self, desired: dict[str, Any]) -> str:
        self._call("apply_node_config", desired["metadata"]["name"])
        return self._applied(self.node_configs, desired)[1]

    def delete_node_config(self, api_version: str, kind: str, name: str) -> None:
        self._call("delete_node_config", name)
        self.node_configs.pop(name, None)

    def apply_daemonset(self, desired: dict[str, Any]) -> str:
        self._call("apply_daemonset", desired["metadata"]["name"])
        written, rv = self._applied(self.daemonsets, desired)
        if written:
            self.add_revision_daemonset(self.daemonsets[desired["metadata"]["name"]])
        return rv

    def delete_configmap(self, name: str) -> None:
        self._call("delete_configmap", name)
        self.configmaps.pop(name, None)
        self._echo_revisions()

    def delete_daemonset(self, name: str) -> None:
        self._call("delete_daemonset", name)
        self.daemonsets.pop(name, None)
        self._echo_revisions()

    def json_patch_daemonset(self, name: str, patch: Any) -> None:
        self._call("json_patch_daemonset", name)
        self.daemonsets[name] = patch.apply(self.daemonsets[name])

    def emit_event(self, **event: Any) -> None:
        self.events.append(event)
