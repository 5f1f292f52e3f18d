"""The load harness of bench_controller_scale.py: a fleet of instant agents and kube-proxy pods.

Not the product: it plays the parts of a cluster that the operator only reads,
as fast as the API server lets it, so that what is measured is the operator.

- "DaemonSet controller + kubelet": every Node has exactly one kube-system pod
  labelled k8s-app=kube-proxy, owned by DaemonSet kube-proxy (no revision
  label) or kube-proxy-<revision> (the node's proxyshift.io/revision label),
  Running and Ready. When the label changes, the old pod is deleted (grace 0:
  there is no kubelet to finish a graceful delete) and a new one is created.
- "agent": for every ProxyNode whose spec.operation id differs from
  status.lastOperation.id, one status write reporting it Succeeded; a Probe also
  reports the kube-proxy facts of the node's current pod (mode of its
  DaemonSet, started when the harness made the pod, synced, healthy). A
  Preflight that asks for the rule hold (params.hold) or a Hold reports the
  hold made (details.hold, status.hold), as the agent does; a Probe or Cleanup
  reports it gone (the new kube-proxy has synced).

Work is keyed by node name: a watch thread per kind updates a cache and queues
the name, worker threads reconcile the newest cached object. One node is never
reconciled by two workers at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

GROUP, VERSION = "proxyshift.io", "v1alpha1"
REVISION_LABEL = "proxyshift.io/revision"
NS = "kube-system"
POOL_LABEL = "proxyshift-bench-pool"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_name(i: int) -> str:
    return f"bench-node-{i:05d}"


def pod_name(ds: str, node: str) -> str:
    return f"{ds}-{node}"[:253]


class Fleet:
    """Creates the fleet and then answers for it until stop()."""

    def __init__(self, api_client: client.ApiClient, nodes: int, workers: int = 16) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.n = nodes
        self.workers = workers
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.nodes: dict[str, dict[str, Any]] = {}        # name -> labels
        self.proxynodes: dict[str, dict[str, Any]] = {}   # name -> ProxyNode body
        self.pods: dict[str, tuple[str, float]] = {}      # node -> (DaemonSet, start time)
        self.answered: dict[str, str] = {}                # node -> last operation id answered
        self.busy: set[str] = set()
        self.queue: queue.Queue[str] = queue.Queue()
        self.ds_uids: dict[str, str] = {}
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self.writes = 0

    # ---- setup ----

    def _bulk(self, fn: Callable[[int], None], what: str) -> None:
        with ThreadPoolExecutor(self.workers) as pool:
            for f in [pool.submit(fn, i) for i in range(self.n)]:
                f.result()

    def create(self) -> None:
        self._bulk(self._create_node, "nodes")
        self._bulk(self._create_proxynode, "proxynodes")
        base = self.apps.read_namespaced_daemon_set("kube-proxy", NS)
        assert base.metadata is not None and base.metadata.uid is not None
        self.ds_uids["kube-proxy"] = base.metadata.uid
        self._bulk(lambda i: self._make_pod(node_name(i), "kube-proxy"), "pods")

    def _create_node(self, i: int) -> None:
        name = node_name(i)
        body = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                       POOL_LABEL: "all"}},
                "spec": {}}
        self.core.create_node(body)  # type: ignore[arg-type]  # the client sends a dict body as it is
        self.core.patch_node_status(name, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "bench",
                            "lastHeartbeatTime": now_iso(), "lastTransitionTime": now_iso()}],
            "addresses": [{"type": "Hostname", "address": name}]}})

    def _create_proxynode(self, i: int) -> None:
        name = node_name(i)
        self.custom.create_cluster_custom_object(GROUP, VERSION, "proxynodes", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyNode", "metadata": {"name": name}, "spec": {}})
        self.custom.patch_cluster_custom_object_status(GROUP, VERSION, "proxynodes", name, {"status": {
            "observedMode": "iptables", "kernelRelease": "6.8.0", "modules": ["nf_conntrack", "nf_tables"],
            "tools": {"nft": "1.0.9", "iptables": "1.8.10"}, "heartbeat": now_iso(), "agentVersion": "bench"}})

    def _ds_uid(self, ds: str) -> str:
        uid = self.ds_uids.get(ds)
        if uid is None:
            try:
                metadata = self.apps.read_namespaced_daemon_set(ds, NS).metadata
                assert metadata is not None and metadata.uid is not None
                uid = metadata.uid
            except ApiException:
                uid = "00000000-0000-0000-0000-000000000000"
            self.ds_uids[ds] = uid
        return uid

    def _make_pod(self, node: str, ds: str) -> None:
        name = pod_name(ds, node)
        started = time.time()
        body = {"metadata": {"name": name, "namespace": NS, "labels": {"k8s-app": "kube-proxy"},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds,
                                                  "uid": self._ds_uid(ds), "controller": True}]},
                "spec": {"nodeName": node, "serviceAccountName": "kube-proxy", "automountServiceAccountToken": False,
                         "containers": [{"name": "kube-proxy", "image": "registry.k8s.io/kube-proxy:v1.37.2"}]}}
        try:
            self.core.create_namespaced_pod(NS, body)  # type: ignore[arg-type]  # the client sends a dict body as it is
        except ApiException as exc:
            if exc.status != 409:
                raise
        ts = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.core.patch_namespaced_pod_status(name, NS, {"status": {
            "phase": "Running", "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "startTime": ts,
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}],
            "containerStatuses": [{"name": "kube-proxy", "ready": True, "restartCount": 0, "started": True,
                                   "image": "registry.k8s.io/kube-proxy:v1.37.2", "imageID": "bench",
                                   "state": {"running": {"startedAt": ts}}}]}})
        with self.lock:
            self.pods[node] = (ds, started)
            self.writes += 2

    # ---- answering ----

    def start(self) -> None:
        for target in (self._watch_nodes, self._watch_proxynodes):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self.threads.append(t)
        for _ in range(self.workers):
            t = threading.Thread(target=self._work, daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        self.stopped.set()

    def _stream(self, list_fn: Callable[..., Any], on: Callable[[dict[str, Any]], None], **kw: Any) -> None:
        while not self.stopped.is_set():
            try:
                initial = list_fn(**kw)
                items = initial["items"] if isinstance(initial, dict) else [
                    self.core.api_client.sanitize_for_serialization(o) for o in initial.items]
                rv = initial["metadata"]["resourceVersion"] if isinstance(initial, dict) else \
                    initial.metadata.resource_version
                for obj in items:
                    on(obj)
                w = watch.Watch()
                for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=60, **kw):
                    if self.stopped.is_set():
                        w.stop()
                        return
                    obj = ev["object"]
                    if not isinstance(obj, dict):
                        obj = self.core.api_client.sanitize_for_serialization(obj)
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        on(obj)
            except ApiException as exc:
                if exc.status != 410:
                    self.errors.append(f"watch: {exc.status} {exc.reason}")
                    time.sleep(1)
            except Exception as exc:  # a harness watch must survive a dropped stream
                self.errors.append(f"watch: {exc!r}")
                time.sleep(1)

    def _watch_nodes(self) -> None:
        def on(obj: dict[str, Any]) -> None:
            name = obj["metadata"]["name"]
            with self.lock:
                self.nodes[name] = dict(obj["metadata"].get("labels") or {})
            self.queue.put(name)
        self._stream(self.core.list_node, on, label_selector=f"{POOL_LABEL}=all")

    def _watch_proxynodes(self) -> None:
        def on(obj: dict[str, Any]) -> None:
            name = obj["metadata"]["name"]
            with self.lock:
                self.proxynodes[name] = obj
            self.queue.put(name)

        def list_fn(**kw: Any) -> Any:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, "proxynodes", **kw)
        self._stream(list_fn, on)

    def _work(self) -> None:
        while not self.stopped.is_set():
            try:
                name = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            with self.lock:
                again = name in self.busy
                if not again:
                    self.busy.add(name)
            if again:
                self.queue.put(name)  # another worker has it; look again after them
                time.sleep(0.01)
                continue
            try:
                self._reconcile(name)
            except ApiException as exc:
                self.errors.append(f"{name}: {exc.status} {exc.reason}")
                self.queue.put(name)
            except Exception as exc:  # report, keep the fleet answering
                self.errors.append(f"{name}: {exc!r}")
            finally:
                with self.lock:
                    self.busy.discard(name)

    def _reconcile(self, name: str) -> None:
        with self.lock:
            labels = self.nodes.get(name)
            pn = self.proxynodes.get(name)
            pod = self.pods.get(name)
        if labels is not None:
            rev = labels.get(REVISION_LABEL)
            want = "kube-proxy" if rev is None else f"kube-proxy-{rev}"
            if pod is None or pod[0] != want:
                if pod is not None:
                    try:
                        self.core.delete_namespaced_pod(pod_name(pod[0], name), NS, grace_period_seconds=0)
                    except ApiException as exc:
                        if exc.status != 404:
                            raise
                    with self.lock:
                        self.writes += 1
                self._make_pod(name, want)
        if pn is None:
            return
        op = (pn.get("spec") or {}).get("operation")
        last = ((pn.get("status") or {}).get("lastOperation") or {}).get("id")
        if not op or op["id"] == last or self.answered.get(name) == op["id"]:
            return
        status: dict[str, Any] = {"heartbeat": now_iso(), "lastOperation": {
            "id": op["id"], "type": op["type"], "state": "Succeeded", "message": "ok (bench harness)",
            "startedAt": now_iso(), "finishedAt": now_iso(), "details": {}}}
        if op["type"] == "Hold" or (op["type"] == "Preflight" and (op.get("params") or {}).get("hold")):
            status["hold"] = {"operationId": op["id"], "expires": None}
            if op["type"] == "Preflight":
                status["lastOperation"]["details"] = {"hold": {"ok": True, "message": "rule hold (bench harness)"}}
        elif op["type"] in ("Probe", "Cleanup"):
            status["hold"] = None
        if op["type"] == "Probe":
            with self.lock:
                ds, started = self.pods.get(name, ("kube-proxy", time.time()))
            spec = pn.get("spec") or {}
            mode = spec.get("mode") if spec.get("revision") and ds == f"kube-proxy-{spec['revision']}" else "iptables"
            status["observedMode"] = mode
            status["kubeProxy"] = {"proxyMode": mode, "healthzStatus": 200, "processStartTime": started,
                                   "lastSyncTimestamp": started + 0.5, "syncCount": 10,
                                   "syncDurationP99Seconds": 0.05, "syncFailures": 0, "probedAt": now_iso()}
        self.custom.patch_cluster_custom_object_status(GROUP, VERSION, "proxynodes", name, {"status": status})
        with self.lock:
            self.answered[name] = op["id"]
            self.writes += 1

