"""The local cluster's "kubelet": one process per node that keeps the Node alive and runs its pods.

    python -m localcluster.nodesim --node ps-node-1 --node-ip 198.18.0.11 \\
        --kubeconfig STATE/admin.kubeconfig --bin-dir BIN --state-dir STATE

It keeps the Node Ready and its Lease renewed, watches the pods bound to the
node and runs the two images it knows (docs/architecture.md): kube-proxy as
the real binary and the proxyshift image as `python -m proxyshift.cli`, each
through `localcluster.container` (the node's network namespace for a
hostNetwork pod, the node's one pod namespace (podnet) for any other, with status.podIP
that namespace's address; plus a private mount namespace with the pod's volumes bound at
their mountPaths). It reports
pod status, restarts crashed containers with back-off, runs readiness and
liveness probes inside the node, and stops a pod's processes when the pod is
deleted or terminating, then finalises the pod.

It talks to the API with raw JSON (through the kubernetes client's transport,
so kubeconfig handling is the standard one) rather than the generated models:
the simulator must round-trip fields the models may not know, and skipping
model (de)serialisation keeps a node's CPU use negligible.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import datetime as dt
import http.client
import ipaddress
import json
import logging
import os
import platform
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import proxyshift
from localcluster import paths, podnet, security_context
from localcluster.container import NETNS_DIR, setns

log = logging.getLogger("proxyshift.nodesim")

READY_FILE = "simulator.ready"
KUBE_PROXY_IMAGE = "registry.k8s.io/kube-proxy"
PROXYSHIFT_IMAGE = "ghcr.io/proxyshift/proxyshift"
# kubelet's sandbox image, as an ordinary workload: it does nothing until it is stopped. Tests use it
# for pods that must be Running on a node (a drain blocked by a PodDisruptionBudget needs one).
PAUSE_IMAGE = "registry.k8s.io/pause"
PAUSE_ARGV = [sys.executable, "-c", "import signal; signal.pause()"]
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 60.0
TOKEN_TTL_SECONDS = 3607  # kubelet's default projected-token lifetime
VOLUME_REFRESH_SECONDS = 10.0
VOLUME_GET_TIMEOUT = 5.0
STATUS_TIMEOUT = 5.0
BACKOFF_RESET_SECONDS = 600.0
TICK_SECONDS = 0.5
RETRY_SECONDS = 2.0
CREATED_PATHS_FILE = "created-host-paths.txt"
NODE_CONDITION_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
KUBELET_PORT = 10250
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- a small raw-JSON API client ---------------------------------------------

class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        self.body = body
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Kube:
    """JSON in, JSON out, over the kubernetes client's configured transport (certs, proxies, auth)."""

    def __init__(self, kubeconfig: Path | str, pool_size: int = 4) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = pool_size
        self.api = client.ApiClient(configuration)
        self.host = configuration.host.rstrip("/")
        self.configuration = configuration

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        hook = getattr(self.configuration, "refresh_api_key_hook", None)
        if hook is not None:  # exec/OIDC kubeconfigs renew their token through this hook
            hook(self.configuration)
        token = (self.configuration.api_key or {}).get("authorization") or \
            (self.configuration.api_key or {}).get("BearerToken")
        if token:
            prefix = (self.configuration.api_key_prefix or {}).get("authorization", "")
            headers["Authorization"] = f"{prefix} {token}".strip() if prefix else token
        return headers

    def _send(self, method: str, path: str, body: Any, query: dict[str, Any] | None, content_type: str,
              timeout: float | tuple[float, float]) -> Any:
        url = self.host + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        return self.api.rest_client.request(method, url, headers=self._headers(content_type), body=body,
                                            _request_timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 30.0) -> Any:
        resp = self._send(method, path, body, query, content_type, timeout)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, method, path, data.decode(errors="replace"))
        return json.loads(data) if data else None

    def get(self, path: str, *, timeout: float = 30.0, **query: Any) -> Any:
        return self.request("GET", path, query=query or None, timeout=timeout)

    def get_or_none(self, path: str, *, timeout: float = 30.0) -> Any:
        try:
            return self.get(path, timeout=timeout)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any, *, timeout: float = 30.0) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json", timeout=timeout)

    def strategic_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: dict[str, Any], read_timeout: float) -> Iterator[dict[str, Any]]:
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._send("GET", path, None, {**query, "watch": "true"}, "application/json",
                          (10.0, read_timeout))
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, "WATCH", path, resp.read().decode(errors="replace"))
        try:
            for line in iter_resp_lines(resp.response):
                if line.strip():
                    yield json.loads(line)
        finally:
            resp.response.release_conn()


def api_client(kubeconfig: Path | str) -> Kube:
    return Kube(kubeconfig)


# --- Node and Lease ----------------------------------------------------------

def node_status(ip: str, name: str, kubelet_version: str) -> dict[str, Any]:
    stamp = now_rfc3339()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {"type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}

    resources = {"cpu": "4", "memory": "8Gi", "pods": "110", "ephemeral-storage": "20Gi"}
    return {
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "simulated"),
            condition("Ready", "True", "KubeletReady", "proxyshift node simulator is posting ready status"),
        ],
        # No Hostname address: the apiserver prefers it for kubelet connections (kubectl logs)
        # and ps-node-<i> resolves nowhere; InternalIP is then used.
        "addresses": [{"type": "InternalIP", "address": ip}],
        "capacity": resources,
        "allocatable": resources,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
        "nodeInfo": {
            "machineID": name, "systemUUID": name, "bootID": name,
            "kernelVersion": platform.release(), "osImage": "proxyshift node simulator",
            "containerRuntimeVersion": "proxyshift-nodesim://0.1.0",
            "kubeletVersion": kubelet_version, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64",
        },
    }


def node_manifest(name: str, ip: str, pool: str, kubelet_version: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "pool": pool, "proxyshift-test-pool": pool,
            },
            "annotations": {"proxyshift.io/simulated-node": "true"},
        },
        "spec": {},
        "status": node_status(ip, name, kubelet_version),
    }


def ensure_node(kube: Kube, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create the Node or bring its labels and status back to the manifest's."""
    name = manifest["metadata"]["name"]
    try:
        node = kube.post("/api/v1/nodes", manifest)
    except KubeError as exc:
        if exc.status != 409:
            raise
        node = kube.strategic_patch(f"/api/v1/nodes/{name}",
                                    {"metadata": {"labels": manifest["metadata"]["labels"]}})
    kube.strategic_patch(f"/api/v1/nodes/{name}/status", {"status": manifest["status"]})
    # The TaintNodesByCondition admission plugin gives every new Node a not-ready taint that the
    # node-lifecycle controller lifts once the node is Ready. That controller is off here (it
    # would evict simulated nodes), so the simulator lifts it, as it is the one that knows.
    taints = (node.get("spec") or {}).get("taints") or []
    kept = [t for t in taints if t.get("key") not in NODE_CONDITION_TAINTS]
    if kept != taints:
        node = kube.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": kept or None}})
    return node


def renew_lease(kube: Kube, node: str, node_uid: str | None = None) -> None:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{node}"
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_DURATION_SECONDS, "renewTime": now_micro()}
    try:
        kube.merge_patch(path, {"spec": spec})
    except KubeError as exc:
        if exc.status != 404:
            raise
        if node_uid is None:
            node_uid = kube.get(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
        kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                  {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                   "metadata": {"name": node, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                   "spec": spec})


# --- pod helpers ---------------------------------------------------------------

class PodError(RuntimeError):
    """The pod cannot run here (yet); `reason` goes into its container statuses."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def image_kind(image: str) -> str | None:
    repo = image.split("@", 1)[0]
    repo = repo.rsplit(":", 1)[0] if ":" in repo.rsplit("/", 1)[-1] else repo
    if repo == KUBE_PROXY_IMAGE:
        return "kube-proxy"
    if repo == PROXYSHIFT_IMAGE:
        return "proxyshift"
    if repo == PAUSE_IMAGE:
        return "pause"
    return None


def image_paths() -> list[str]:
    """What the proxyshift "image" is here: this interpreter's prefixes and the checkout's package."""
    package_root = Path(proxyshift.__file__).resolve().parent.parent
    return sorted({sys.base_prefix, sys.prefix, str(package_root)})


def hidden_by(mount_paths: list[Path], paths: list[Path]) -> list[Path]:
    """The paths that a mount at one of mount_paths (or above them) would cover."""
    return [path for path in paths if any(path.is_relative_to(mount) for mount in mount_paths)]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: $$ escapes, unknown references stay as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def field_value(pod: dict[str, Any], field_path: str, node_ip: str, pod_ip: str | None = None) -> str:
    """A downward-API field; `pod_ip` is the pod namespace's address (default: hostNetwork, the node's)."""
    meta, spec = pod["metadata"], pod["spec"]
    pod_ip = pod_ip or node_ip
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip, "status.hostIP": node_ip, "status.podIPs": pod_ip, "status.hostIPs": node_ip,
    }
    if field_path in simple:
        return simple[field_path]
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        values = meta.get(source) or {}
        if field_path == prefix:
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        if field_path.startswith(prefix + "["):
            return values.get(field_path[len(prefix) + 1:].rstrip("]").strip("'\""), "")
    raise PodError("CreateContainerConfigError", f"unsupported fieldRef {field_path!r}")


def resolve_port(port: Any, container: dict[str, Any]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for candidate in container.get("ports") or []:
        if candidate.get("name") == port:
            return int(candidate["containerPort"])
    raise ValueError(f"named port {port!r} not found in container {container['name']}")


def probe_once(probe: dict[str, Any], container: dict[str, Any], host: str) -> tuple[bool, str]:
    """Run one probe; called on a thread that lives in the node's network namespace."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            port = resolve_port(spec["port"], container)
            target = spec.get("host") or host
            if spec.get("scheme", "HTTP").upper() == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    target, port, timeout=timeout, context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(target, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
                conn.request("GET", spec.get("path", "/"), headers=headers)
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP {status}"
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            with socket.create_connection((spec.get("host") or host, resolve_port(spec["port"], container)),
                                          timeout=timeout):
                return True, "connected"
        return False, f"probe type not supported by the node simulator: {sorted(probe)}"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, str(exc)


@dataclass
class ProbeState:
    spec: dict[str, Any]
    kind: str  # readiness | liveness | startup
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool = False
    pending: concurrent.futures.Future[tuple[bool, str]] | None = None
    message: str = ""


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restart_count: int = 0
    crashes: int = 0
    next_start: float = 0.0
    waiting: tuple[str, str] = ("ContainerCreating", "")
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    done: bool = False  # exited and will not be restarted
    probes: list[ProbeState] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def reset_probes(self) -> None:
        self.probes = [ProbeState(self.spec[key], kind) for key, kind in
                       (("startupProbe", "startup"), ("readinessProbe", "readiness"),
                        ("livenessProbe", "liveness")) if self.spec.get(key)]
        for probe in self.probes:
            probe.next_at = time.monotonic() + float(probe.spec.get("initialDelaySeconds", 0))

    def probe_ok(self, kind: str) -> bool:
        return all(p.ok for p in self.probes if p.kind == kind)

    @property
    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.probe_ok("startup") and \
            self.probe_ok("readiness")


# --- the simulator ---------------------------------------------------------------

@dataclass(frozen=True)
class SimConfig:
    node: str
    node_ip: str
    pool: str
    kubeconfig: Path
    bin_dir: Path
    state_dir: Path
    api_host: str
    api_port: int
    kubelet_version: str
    backoff_base: float
    backoff_max: float
    # The node's pod namespace and its address (podnet); unset: every pod runs in the node's own.
    pod_netns: str = ""
    pod_ip: str = ""

    @property
    def node_dir(self) -> Path:
        return paths.StateLayout(self.state_dir).nodes / self.node

    @property
    def created_paths_file(self) -> Path:
        return paths.StateLayout(self.state_dir).nodes / CREATED_PATHS_FILE


class PodWorker(threading.Thread):
    """Owns one pod's processes, volumes, probes and status, from first sight to finalisation."""

    def __init__(self, sim: Simulator, pod: dict[str, Any]) -> None:
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.sim = sim
        self.cfg = sim.cfg
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.namespace = pod["metadata"]["namespace"]
        self.pod_name = pod["metadata"]["name"]
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.gone = False
        self.finished = False
        self.dir = self.cfg.node_dir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        previous = {s["name"]: s.get("restartCount", 0)
                    for s in (pod.get("status") or {}).get("containerStatuses") or []}
        spec = pod["spec"]
        self.init_runs = [ContainerRun(c, init=True) for c in spec.get("initContainers") or []]
        self.runs = [ContainerRun(c, restart_count=previous.get(c["name"], 0)) for c in spec["containers"]]
        self.start_time = (pod.get("status") or {}).get("startTime") or now_rfc3339()
        # hostNetwork pods run in the node's namespace; the others in the node's one pod namespace.
        self.host_network = bool(spec.get("hostNetwork")) or not self.cfg.pod_netns
        self.netns = self.cfg.node if self.host_network else self.cfg.pod_netns
        self.pod_ip = self.cfg.node_ip if self.host_network else self.cfg.pod_ip
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_status: dict[str, Any] | None = None
        self.volumes: dict[str, Path] = {}
        self.refreshed_at = 0.0
        self.tokens: dict[str, float] = {}  # token file -> monotonic time to refresh
        self.blocked: PodError | None = None
        self.last_error = ""

    # called from the watch thread
    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod
        self.wake.set()

    def mark_gone(self) -> None:
        self.gone = True
        self.wake.set()

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}"

    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod %s/%s: worker failed; stopping its containers", self.namespace, self.pod_name)
            self._stop_all(5.0)
        finally:
            self.finished = True

    def _loop(self) -> None:
        self._check_images()
        while True:
            with self.lock:
                pod = self.pod
            if self.gone or pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod)
                return
            failed = False
            if self.blocked is None:
                # Volumes that were made once stay usable while a refresh fails (an API blip
                # must not stop restarts of crashed containers, nor kill running ones).
                if self._volumes_complete():
                    # Containers first: a volume refresh may wait on a slow API.
                    failed = not self._step(self._sync_containers)
                    failed = not self._step(self._sync_volumes) or failed
                else:
                    failed = not self._step(self._sync_volumes) or not self._step(self._sync_containers)
                self._sync_probes()
            self._publish()
            if self.blocked is not None and self.blocked.reason == "ImageNotSupported":
                self.wake.wait(60.0)
            else:
                self.wake.wait(RETRY_SECONDS if failed else min(TICK_SECONDS, self._next_probe_in()))
            self.wake.clear()

    def _step(self, step: Any) -> bool:
        try:
            step()
        except PodError as exc:
            self._block(exc, transient=True)
            return False
        except Exception as exc:  # the API or the network, for a moment: retry, keep what runs
            self._block(PodError("ContainerCreating", f"{step.__name__.strip('_')}: {exc}"), transient=True)
            return False
        self.last_error = ""
        return True

    def _volumes_complete(self) -> bool:
        return all(v["name"] in self.volumes for v in self.pod["spec"].get("volumes") or [])

    def _block(self, exc: PodError, *, transient: bool) -> None:
        if str(exc) != self.last_error:  # once per distinct error, not once per tick
            log.warning("pod %s/%s: %s: %s", self.namespace, self.pod_name, exc.reason, exc)
            self.last_error = str(exc)
        for run in self.init_runs + self.runs:
            if run.proc is None:
                run.waiting = (exc.reason, str(exc))
        if not transient:
            self.blocked = exc

    def _check_images(self) -> None:
        for container in (self.pod["spec"].get("initContainers") or []) + self.pod["spec"]["containers"]:
            if image_kind(container.get("image", "")) is None:
                self._block(PodError(
                    "ImageNotSupported",
                    f"container {container['name']}: image {container.get('image')!r} is not one the "
                    f"proxyshift node simulator can run (it runs {KUBE_PROXY_IMAGE}:*, "
                    f"{PROXYSHIFT_IMAGE}:* and {PAUSE_IMAGE}:*)"), transient=False)
                return

    # --- volumes ---------------------------------------------------------------

    def _sync_volumes(self) -> None:
        now = time.monotonic()
        due_tokens = any(t <= now for t in self.tokens.values())
        if self.volumes and now - self.refreshed_at < VOLUME_REFRESH_SECONDS and not due_tokens:
            return
        for volume in self.pod["spec"].get("volumes") or []:
            self.volumes[volume["name"]] = self._materialise(volume)
        self.refreshed_at = now

    def _materialise(self, volume: dict[str, Any]) -> Path:
        name = volume["name"]
        target = self.dir / "volumes" / name
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type") or ""
            if kind == "DirectoryOrCreate" and not host.exists():
                self.sim.note_created(host)
                host.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not host.exists():
                self.sim.note_created(host)
                host.parent.mkdir(parents=True, exist_ok=True)
                host.touch()
            return host
        target.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            target.chmod(0o777)  # as the kubelet makes it: writable for a container of any user
            return target
        files: dict[str, tuple[bytes, int]] = {}
        if "configMap" in volume:
            files = self._object_files("configmaps", volume["configMap"], volume["configMap"].get("defaultMode"))
        elif "secret" in volume:
            spec = {**volume["secret"], "name": volume["secret"].get("secretName")}
            files = self._object_files("secrets", spec, volume["secret"].get("defaultMode"))
        elif "downwardAPI" in volume:
            files = self._downward_files(volume["downwardAPI"], volume["downwardAPI"].get("defaultMode"))
        elif "projected" in volume:
            mode = volume["projected"].get("defaultMode")
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    files.update(self._token_file(source["serviceAccountToken"], target, mode))
                elif "configMap" in source:
                    files.update(self._object_files("configmaps", source["configMap"], mode))
                elif "secret" in source:
                    files.update(self._object_files("secrets", source["secret"], mode))
                elif "downwardAPI" in source:
                    files.update(self._downward_files(source["downwardAPI"], mode))
                else:
                    raise PodError("CreateContainerConfigError",
                                   f"volume {name}: projected source {sorted(source)} not supported")
        else:
            raise PodError("CreateContainerConfigError",
                           f"volume {name}: type {sorted(k for k in volume if k != 'name')} not supported "
                           f"by the node simulator")
        _write_files(target, files)
        owner = self._token_owner() if "projected" in volume else None
        if owner is not None:
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    os.chown(target / source["serviceAccountToken"].get("path", "token"), owner, -1)
        return target

    def _object_files(self, kind: str, spec: dict[str, Any], default_mode: int | None) -> dict[str, tuple[bytes, int]]:
        name = spec.get("name")
        obj = self.sim.kube.get_or_none(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}",
                                        timeout=VOLUME_GET_TIMEOUT)
        if obj is None:
            if spec.get("optional"):
                return {}
            if kind == "configmaps" and name == "kube-root-ca.crt":
                # The root-CA publisher may not have run yet in a fresh namespace; the CA
                # is the same one the kubeconfig trusts.
                obj = {"data": {"ca.crt": self.sim.ca_pem()}}
            else:
                raise PodError("CreateContainerConfigError", f"{kind[:-1]} {self.namespace}/{name} not found")
        data: dict[str, bytes] = {k: v.encode() for k, v in (obj.get("data") or {}).items()} \
            if kind == "configmaps" else {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "configmaps":
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        mode = default_mode if default_mode is not None else 0o644
        items = spec.get("items")
        if not items:
            return {key: (value, mode) for key, value in data.items()}
        out = {}
        for item in items:
            if item["key"] not in data:
                if spec.get("optional"):
                    continue
                raise PodError("CreateContainerConfigError", f"{kind[:-1]} {name} has no key {item['key']!r}")
            out[item["path"]] = (data[item["key"]], item.get("mode", mode))
        return out

    def _downward_files(self, spec: dict[str, Any], default_mode: int | None) -> dict[str, tuple[bytes, int]]:
        mode = default_mode if default_mode is not None else 0o644
        out = {}
        for item in spec.get("items") or []:
            if "fieldRef" not in item:
                raise PodError("CreateContainerConfigError", "downwardAPI resourceFieldRef not supported")
            value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.cfg.node_ip, self.pod_ip)
            out[item["path"]] = (value.encode(), item.get("mode", mode))
        return out

    def _token_file(self, spec: dict[str, Any], target: Path, mode: int | None) -> dict[str, tuple[bytes, int]]:
        path = spec.get("path", "token")
        key = str(target / path)
        if key in self.tokens and self.tokens[key] > time.monotonic() and (target / path).exists():
            return {path: ((target / path).read_bytes(), mode if mode is not None else 0o600)}
        ttl = int(spec.get("expirationSeconds") or TOKEN_TTL_SECONDS)
        account = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [spec["audience"]] if spec.get("audience") else None,
                         "expirationSeconds": ttl,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name,
                                            "uid": self.uid}}}
        try:
            answer = self.sim.kube.post(
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", body)
        except Exception as exc:
            raise PodError("CreateContainerConfigError", f"TokenRequest for {account}: {exc}") from exc
        self.tokens[key] = time.monotonic() + 0.8 * ttl  # kubelet renews at 80% of the lifetime
        return {path: (answer["status"]["token"].encode(), mode if mode is not None else 0o600)}

    # --- containers ------------------------------------------------------------

    def _sync_containers(self) -> None:
        for run in self.init_runs:
            if run.terminated is not None and run.terminated.get("exitCode") == 0 and run.done:
                continue
            self._sync_one(run)
            return  # init containers run one at a time, each to completion
        for run in self.runs:
            self._sync_one(run)

    def _sync_one(self, run: ContainerRun) -> None:
        if run.proc is not None:
            code = run.proc.poll()
            if code is None:
                return
            self._exited(run, code)
        if run.done or time.monotonic() < run.next_start:
            return
        self._start(run)

    def _exited(self, run: ContainerRun, code: int) -> None:
        finished = now_rfc3339()
        exit_code = code if code >= 0 else 128 - code
        reason = "Completed" if exit_code == 0 else "Error"
        run.terminated = {"exitCode": exit_code, "reason": reason, "startedAt": run.started_at,
                          "finishedAt": finished, "containerID": self._container_id(run)}
        if code < 0:
            run.terminated["signal"] = -code
        log.info("pod %s/%s container %s exited %s", self.namespace, self.pod_name, run.name, exit_code)
        self._pid_file(run).unlink(missing_ok=True)
        ran_for = time.monotonic() - run.started_mono
        run.proc = None
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if run.init:
            restart = exit_code != 0 and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if not restart:
            run.done = True
            return
        run.crashes = 1 if ran_for >= BACKOFF_RESET_SECONDS else run.crashes + 1
        # Like the kubelet: the first restart is immediate, later ones back off exponentially.
        delay = 0.0 if run.crashes <= 1 else min(self.cfg.backoff_base * 2 ** (run.crashes - 2),
                                                 self.cfg.backoff_max)
        run.next_start = time.monotonic() + delay
        run.last_terminated = run.terminated
        if delay > 0:
            run.waiting = ("CrashLoopBackOff", f"back-off {delay:g}s restarting failed container={run.name} "
                                               f"pod={self.pod_name}_{self.namespace}({self.uid})")

    def _container_id(self, run: ContainerRun) -> str:
        return f"proxyshift://{self.uid}/{run.name}/{run.restart_count}"

    def _pid_file(self, run: ContainerRun) -> Path:
        return self.cfg.node_dir / "pids" / f"{self.namespace}_{self.pod_name}_{run.name}.pid"

    def _env(self, container: dict[str, Any]) -> dict[str, str]:
        pod = self.pod
        env: dict[str, str] = {
            "PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": "/root",
            "HOSTNAME": self.cfg.node if self.host_network else self.pod_name,
            "KUBERNETES_SERVICE_HOST": self.cfg.api_host,
            "KUBERNETES_SERVICE_PORT": str(self.cfg.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.cfg.api_port),
        }
        if image_kind(container["image"]) == "proxyshift":
            # The agent runs the simulator's own copy of proxyshift, whatever the install.
            env["PYTHONPATH"] = str(paths.repo_root() / "operator")
            env["PYTHONUNBUFFERED"] = "1"
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                if key in source:
                    obj = self.sim.kube.get_or_none(
                        f"/api/v1/namespaces/{self.namespace}/{kind}/{source[key]['name']}")
                    if obj is None:
                        if source[key].get("optional"):
                            continue
                        raise PodError("CreateContainerConfigError", f"{key} {source[key]['name']} not found")
                    for k, v in (obj.get("data") or {}).items():
                        env[prefix + k] = base64.b64decode(v).decode() if kind == "secrets" else v
        for item in container.get("env") or []:
            if "valueFrom" not in item:
                env[item["name"]] = expand(item.get("value", ""), env)
                continue
            source = item["valueFrom"]
            if "fieldRef" in source:
                env[item["name"]] = field_value(pod, source["fieldRef"]["fieldPath"], self.cfg.node_ip, self.pod_ip)
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                secret = "secretKeyRef" in source
                ref = source["secretKeyRef" if secret else "configMapKeyRef"]
                obj = self.sim.kube.get_or_none(
                    f"/api/v1/namespaces/{self.namespace}/{'secrets' if secret else 'configmaps'}/{ref['name']}")
                value = ((obj or {}).get("data") or {}).get(ref["key"])
                if value is None:
                    if ref.get("optional"):
                        continue
                    raise PodError("CreateContainerConfigError", f"{ref['name']}/{ref['key']} not found")
                env[item["name"]] = base64.b64decode(value).decode() if secret else value
            elif "resourceFieldRef" in source:
                env[item["name"]] = "0"
        return env

    def _argv(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        kind = image_kind(container["image"])
        command = [expand(c, env) for c in container.get("command") or []]
        args = [expand(a, env) for a in container.get("args") or []]
        if kind == "kube-proxy":
            command = command or ["/usr/local/bin/kube-proxy"]
            if Path(command[0]).name != "kube-proxy":
                raise PodError("RunContainerError", f"the simulator runs only kube-proxy from {KUBE_PROXY_IMAGE}, "
                                                    f"not {command[0]!r}")
            binary = self.cfg.bin_dir / "kube-proxy"
            if not binary.exists():
                raise PodError("RunContainerError", f"{binary} does not exist")
            return [str(binary), *command[1:], *args]
        if kind == "pause":
            return list(PAUSE_ARGV)  # like the real image: no command of its own to honour
        command = command or ["proxyshift"]
        if Path(command[0]).name == "proxyshift":
            rest = command[1:]
        elif Path(command[0]).name.startswith("python") and command[1:3] == ["-m", "proxyshift.cli"]:
            rest = command[3:]
        else:
            raise PodError("RunContainerError", f"the simulator runs only the proxyshift CLI from "
                                                f"{PROXYSHIFT_IMAGE}, not {command[0]!r}")
        return [sys.executable, "-m", "proxyshift.cli", *rest, *args]

    def confinement(self, container: dict[str, Any]) -> security_context.Confinement:
        try:
            return security_context.confinement(self.pod["spec"], container, image_kind(container.get("image", "")))
        except security_context.SecurityContextError as exc:
            raise PodError("CreateContainerConfigError", str(exc)) from exc

    def _token_owner(self) -> int | None:
        """The uid a projected token is handed to: like the kubelet, the one non-root runAsUser every
        container shares when no fsGroup is set (the file stays 0600)."""
        if (self.pod["spec"].get("securityContext") or {}).get("fsGroup") is not None:
            return None
        uids = set()
        for container in [*(self.pod["spec"].get("initContainers") or []), *self.pod["spec"]["containers"]]:
            with contextlib.suppress(PodError):
                uids.add(self.confinement(container).uid)
        return uids.pop() if len(uids) == 1 and 0 not in uids else None

    def _binds(self, container: dict[str, Any], read_only_root: bool = False) -> list[str]:
        binds = []
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in self.volumes:
                raise PodError("CreateContainerConfigError", f"volumeMount {mount['name']} has no volume")
            source = self.volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            if source == Path(mount["mountPath"]) and not (read_only_root and not mount.get("readOnly")):
                # A hostPath at its own path: the container already sees the host's file system (under a
                # read-only root a writable one is bound onto itself, so that it stays writable).
                continue
            binds.append(f"{source}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else ""))
        if image_kind(container.get("image", "")) == "proxyshift":
            # The "image" is this checkout's package run by this interpreter: a volume over one of
            # their parents (an emptyDir on /tmp with the checkout, and so its .venv, under /tmp)
            # would hide them, so bind each hidden one back on top, read-only.
            mount_paths = [Path(m["mountPath"]) for m in container.get("volumeMounts") or []]
            image = [Path(path) for path in image_paths()]
            binds += [f"{path}:{path}:ro" for path in hidden_by(mount_paths, image)]
        return binds

    @property
    def declared_ports(self) -> set[tuple[int, str]]:
        """(containerPort, protocol) of every container: what the pod says it listens on."""
        return {(int(p["containerPort"]), p.get("protocol", "TCP")) for c in self.pod["spec"]["containers"]
                for p in c.get("ports") or [] if "containerPort" in p}

    def _check_shared_ports(self) -> None:
        """Refuse, for now, a port another running pod already declared in the node's one pod namespace.

        A real node gives each pod its own namespace; here they share one, so the second
        listener would die with EADDRINUSE and crash-loop with a message that names nothing.
        """
        mine = self.declared_ports
        for other in list(self.sim.workers.values()):
            if other is self or other.host_network or other.finished or \
                    not any(r.proc is not None for r in other.runs):
                continue
            taken = mine & other.declared_ports
            if taken:
                ports = ", ".join(f"{port}/{proto}" for port, proto in sorted(taken))
                raise PodError("PortConflict", f"{ports} already declared by pod {other.namespace}/"
                                               f"{other.pod_name}: non-hostNetwork pods on a local-cluster node "
                                               f"share one pod namespace ({self.netns})")

    def _start(self, run: ContainerRun) -> None:
        container = run.spec
        env = self._env(container)
        argv = self._argv(container, env)
        if not (NETNS_DIR / self.netns).exists():
            raise PodError("NetworkNotReady", f"network is not ready: no pod namespace {self.netns} on this node")
        if not self.host_network:
            self._check_shared_ports()
        confinement = self.confinement(container)
        launcher = [sys.executable, "-m", "localcluster.container", "--netns", self.netns,
                    "--created-log", str(self.cfg.created_paths_file),
                    "--workdir", container.get("workingDir") or "/", *confinement.launcher_args()]
        for bind in self._binds(container, confinement.read_only_root):
            launcher += ["--bind", bind]
        if confinement.uid != 0 and image_kind(container.get("image", "")) in ("proxyshift", "pause"):
            # The "image" is this interpreter and checkout: reachable for the container's user even
            # when they live under a private folder (pyenv under /root).
            for path in image_paths():
                launcher += ["--expose", path]
        logs = self.cfg.node_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{self.pod_name}_{run.name}.log"
        # Under the start lock, so a shutdown either sees this process or stops it from starting.
        with self.sim.start_lock:
            if self.sim.stopping:
                return
            with log_path.open("ab") as out:
                out.write(f"--- {now_rfc3339()} proxyshift nodesim: starting {run.name}: {argv}\n".encode())
                out.flush()
                run.proc = subprocess.Popen([*launcher, "--", *argv], stdin=subprocess.DEVNULL,  # noqa: S603
                                            stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        if run.started_at is not None:
            run.restart_count += 1
        run.started_at = now_rfc3339()
        run.started_mono = time.monotonic()
        run.terminated = None
        run.waiting = ("", "")
        run.reset_probes()
        pid_file = self._pid_file(run)
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{run.proc.pid}\n")
        log.info("pod %s/%s container %s started pid %d", self.namespace, self.pod_name, run.name, run.proc.pid)

    # --- probes ------------------------------------------------------------------

    def _sync_probes(self) -> None:
        now = time.monotonic()
        for run in self.runs:
            if run.proc is None or run.proc.poll() is not None:
                continue
            for probe in run.probes:
                if probe.kind != "startup" and not run.probe_ok("startup"):
                    continue
                if probe.pending is not None:
                    if not probe.pending.done():
                        continue
                    ok, probe.message = probe.pending.result()
                    probe.pending = None
                    self._record_probe(run, probe, ok)
                    if run.proc is None:
                        break
                if now >= probe.next_at:
                    probe.next_at = now + float(probe.spec.get("periodSeconds", 10))
                    # From the node, as the kubelet probes: to the pod's address (its pod namespace's).
                    probe.pending = self.sim.probe_pool.submit(probe_once, probe.spec, run.spec, self.pod_ip)
                    # A kubelet records a probe's result when it arrives, not at its next pass: wake for it.
                    probe.pending.add_done_callback(lambda _: self.wake.set())

    def _next_probe_in(self) -> float:
        """Seconds until a probe is due, so one with periodSeconds 1 runs on time, not on the next tick."""
        due = [p.next_at for run in self.runs if run.proc is not None for p in run.probes if p.pending is None]
        return max(0.0, min(due, default=float("inf")) - time.monotonic())

    def _record_probe(self, run: ContainerRun, probe: ProbeState, ok: bool) -> None:
        if ok:
            probe.successes, probe.failures = probe.successes + 1, 0
            if probe.successes >= int(probe.spec.get("successThreshold", 1)):
                probe.ok = True
            return
        probe.successes, probe.failures = 0, probe.failures + 1
        if probe.failures < int(probe.spec.get("failureThreshold", 3)):
            return
        probe.ok = False
        if probe.kind in ("liveness", "startup"):
            log.info("pod %s/%s container %s failed its %s probe (%s): restarting", self.namespace,
                     self.pod_name, run.name, probe.kind, probe.message)
            assert run.proc is not None
            grace = float(probe.spec.get("terminationGracePeriodSeconds")
                          or self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            _stop_processes([run.proc], grace)
            self._exited(run, run.proc.returncode if run.proc.returncode is not None else 137)

    # --- termination -------------------------------------------------------------

    def _stop_all(self, grace: float) -> None:
        procs = [r.proc for r in self.init_runs + self.runs if r.proc is not None]
        _stop_processes(procs, grace)
        for run in self.init_runs + self.runs:
            if run.proc is not None:
                self._pid_file(run).unlink(missing_ok=True)
                run.proc = None

    def _terminate(self, pod: dict[str, Any]) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        log.info("pod %s/%s: terminating (grace %ss)", self.namespace, self.pod_name, grace)
        self._stop_all(float(grace))
        while not self.gone:
            try:
                self.sim.kube.delete(self.path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                                 "gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
                break
            except KubeError as exc:
                if exc.status in (404, 409):  # already gone, or a new pod of the same name
                    break
                log.warning("pod %s/%s: finalising failed: %s", self.namespace, self.pod_name, exc)
            except Exception as exc:  # API unreachable: the pod must still be finalised later
                log.warning("pod %s/%s: finalising failed: %s", self.namespace, self.pod_name, exc)
            self.wake.wait(RETRY_SECONDS)
            self.wake.clear()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        log.info("pod %s/%s: finalised", self.namespace, self.pod_name)

    # --- status ------------------------------------------------------------------

    def _condition(self, kind: str, value: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        status = "True" if value else "False"
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != status:
            self.transitions[kind] = (status, now_rfc3339())
        cond = {"type": kind, "status": status, "lastProbeTime": None,
                "lastTransitionTime": self.transitions[kind][1]}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond

    def _container_status(self, run: ContainerRun) -> dict[str, Any]:
        running = run.proc is not None and run.proc.poll() is None
        if running:
            state: dict[str, Any] = {"running": {"startedAt": run.started_at}}
        elif run.terminated is not None and (run.done or not run.waiting[0]):
            state = {"terminated": run.terminated}
        else:
            reason, message = run.waiting
            state = {"waiting": {"reason": reason or "ContainerCreating", **({"message": message} if message else {})}}
        status = {"name": run.name, "image": run.spec.get("image", ""), "imageID": run.spec.get("image", ""),
                  "ready": run.ready, "started": running and run.probe_ok("startup"),
                  "restartCount": run.restart_count, "state": state,
                  "lastState": {"terminated": run.last_terminated} if run.last_terminated else {}}
        if run.started_at is not None:
            status["containerID"] = self._container_id(run)
        return status

    def _phase(self) -> str:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if any(r.done and (r.terminated or {}).get("exitCode") != 0 for r in self.init_runs):
            return "Failed"
        if any(r.started_at is None for r in self.runs):
            return "Pending"
        if policy != "Always" and all(r.done for r in self.runs):
            ok = all((r.terminated or {}).get("exitCode") == 0 for r in self.runs)
            return "Succeeded" if ok else "Failed"
        return "Running"

    def _publish(self) -> None:
        with self.lock:
            pod = self.pod
        ready = all(r.ready for r in self.runs)
        reason, message = "", ""
        if not ready:
            waiting = [r for r in self.runs if not r.ready]
            reason = self.blocked.reason if self.blocked else "ContainersNotReady"
            message = str(self.blocked) if self.blocked else \
                f"containers with unready status: [{' '.join(r.name for r in waiting)}]"
        initialized = all(r.done and (r.terminated or {}).get("exitCode") == 0 for r in self.init_runs)
        conditions = [
            self._condition("PodReadyToStartContainers",
                            any(r.started_at is not None for r in self.init_runs + self.runs)),
            self._condition("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
            self._condition("ContainersReady", ready, reason, message),
            self._condition("Ready", ready, reason, message),
        ]
        others = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] not in OWN_CONDITIONS]
        ip = self.cfg.node_ip
        status: dict[str, Any] = {
            "phase": self._phase(), "conditions": others + conditions, "hostIP": ip, "hostIPs": [{"ip": ip}],
            "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}], "startTime": self.start_time,
            "containerStatuses": [self._container_status(r) for r in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [self._container_status(r) for r in self.init_runs]
        if status == self.last_status:
            return
        try:
            # Short: a slow API must not hold up restarts; an unsent status goes with the next tick.
            self.sim.kube.merge_patch(self.path + "/status", {"status": status}, timeout=STATUS_TIMEOUT)
            self.last_status = status
        except KubeError as exc:
            if exc.status == 404:
                self.mark_gone()
            else:
                log.warning("pod %s/%s: status update failed: %s", self.namespace, self.pod_name, exc)
        except Exception as exc:  # API unreachable: the next tick sends it again
            log.warning("pod %s/%s: status update failed: %s", self.namespace, self.pod_name, exc)


def _write_files(target: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Write volume files in place (tmp + rename), so a bind mount of `target` sees updates."""
    for rel, (content, mode) in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            if path.read_bytes() == content and (path.stat().st_mode & 0o777) == mode:
                continue
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        tmp.chmod(mode)
        tmp.replace(path)
    wanted = {str(target / rel) for rel in files}
    for existing in target.rglob("*"):
        if existing.is_file() and str(existing) not in wanted and not existing.name.startswith("."):
            existing.unlink(missing_ok=True)


def _stop_processes(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each container's process group, SIGKILL whatever is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return


class LogServer:
    """The slice of the kubelet API that `kubectl logs` uses: GET /containerLogs/<ns>/<pod>/<container>.

    It listens on <node-ip>:10250 inside the node (the socket is made by a thread in
    the node's namespace, as the apiserver reaches nodes by InternalIP through the
    bridge), over TLS with a throwaway self-signed certificate: the apiserver does
    not verify kubelet serving certificates unless told to. Only the bridge reaches
    it, so it does not authenticate the caller.
    """

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def _tls_context(self) -> ssl.SSLContext:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.sim.cfg.node)])
        start = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start)
                .not_valid_after(start + dt.timedelta(days=365))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(self.sim.cfg.node_ip)), x509.DNSName(self.sim.cfg.node)]),
                    critical=False)
                .sign(key, hashes.SHA256()))
        folder = self.sim.cfg.node_dir / "kubelet-serving"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file = folder / "tls.key"
        key_file.touch(mode=0o600)
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(folder / "tls.crt", key_file)
        return context

    def start(self) -> None:
        import http.server

        from localcluster.container import run_in_netns

        def listen() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.sim.cfg.node_ip, KUBELET_PORT))
            sock.listen(64)
            return sock

        sim = self.sim

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
                if parts == ["healthz"]:
                    self._reply(200, b"ok")
                elif len(parts) == 4 and parts[0] == "containerLogs":
                    sim.log_server.serve_logs(self, parts[1], parts[2], parts[3], urllib.parse.parse_qs(url.query))
                else:
                    self._reply(404, b"the proxyshift node simulator serves only /containerLogs and /healthz\n")

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = http.server.ThreadingHTTPServer((sim.cfg.node_ip, KUBELET_PORT), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = self._tls_context().wrap_socket(run_in_netns(sim.cfg.node, listen), server_side=True)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="kubelet-api", daemon=True).start()

    def serve_logs(self, handler: Any, namespace: str, pod: str, container: str, query: dict[str, list[str]]) -> None:
        path = self.sim.cfg.node_dir / "logs" / f"{pod}_{container}.log"
        if not path.exists():
            handler._reply(404, f"no log for {namespace}/{pod}/{container} on {self.sim.cfg.node}\n".encode())
            return
        data = path.read_bytes()
        tail = query.get("tailLines", [None])[0]
        if tail is not None and tail.isdigit():
            data = b"".join(data.splitlines(keepends=True)[-int(tail):]) if int(tail) else b""
        limit = query.get("limitBytes", [None])[0]
        if limit is not None and limit.isdigit():
            data = data[:int(limit)]
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.end_headers()
        handler.wfile.write(data)
        if query.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size
        while self.pod_running(namespace, pod):
            time.sleep(0.5)
            with contextlib.suppress(OSError), path.open("rb") as log:
                log.seek(offset)
                chunk = log.read()
                offset += len(chunk)
            if chunk:
                try:
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
                except OSError:
                    return

    def pod_running(self, namespace: str, pod: str) -> bool:
        return any(w.namespace == namespace and w.pod_name == pod and not w.finished
                   for w in list(self.sim.workers.values()))


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.kube = Kube(cfg.kubeconfig)
        self.workers: dict[str, PodWorker] = {}
        self.node_uid: str | None = None
        self.created_lock = threading.Lock()
        self.log_server = LogServer(self)
        self.start_lock = threading.Lock()
        self.stopping = False
        # One thread that lives in the node's network namespace runs every probe, so a
        # probe costs a socket, not a process.
        self.probe_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="probe", initializer=setns, initargs=(cfg.node,))

    def ca_pem(self) -> str:
        ca = self.kube.configuration.ssl_ca_cert
        return Path(ca).read_text() if ca else ""

    def note_created(self, path: Path) -> None:
        with self.created_lock, self.cfg.created_paths_file.open("a") as out:
            out.write(f"{path}\n")

    def heartbeat(self) -> None:
        manifest = node_manifest(self.cfg.node, self.cfg.node_ip, self.cfg.pool, self.cfg.kubelet_version)
        last_status = 0.0
        while True:
            try:
                if time.monotonic() - last_status >= NODE_STATUS_SECONDS:
                    manifest["status"] = node_status(self.cfg.node_ip, self.cfg.node, self.cfg.kubelet_version)
                    if self.node_uid is None:
                        self.node_uid = ensure_node(self.kube, manifest)["metadata"]["uid"]
                    else:
                        try:
                            self.kube.strategic_patch(f"/api/v1/nodes/{self.cfg.node}/status",
                                                      {"status": manifest["status"]})
                        except KubeError as exc:
                            if exc.status == 404:  # someone deleted the Node: register again
                                self.node_uid = None
                                continue
                            raise
                    last_status = time.monotonic()
                renew_lease(self.kube, self.cfg.node, self.node_uid)
                ready = self.cfg.node_dir / READY_FILE
                if not ready.exists():
                    ready.write_text(f"{os.getpid()}\n")
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
                last_status = 0.0
                time.sleep(2.0)
                continue
            time.sleep(LEASE_RENEW_SECONDS)

    def dispatch(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is not None and not worker.finished:
            worker.update(pod)
            return
        if worker is not None and not pod["metadata"].get("deletionTimestamp"):
            return  # finalised or failed; only a deletion needs a worker again
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and \
                not pod["metadata"].get("deletionTimestamp"):
            return
        worker = PodWorker(self, pod)
        self.workers[uid] = worker
        worker.start()

    def forget_finished(self) -> None:
        for uid in [u for u, w in self.workers.items() if w.finished and (w.gone or w.pod["metadata"].get(
                "deletionTimestamp"))]:
            del self.workers[uid]

    def watch_pods(self) -> None:
        selector = f"spec.nodeName={self.cfg.node}"
        resource_version = ""
        while True:
            try:
                if not resource_version:
                    listing = self.kube.get("/api/v1/pods", fieldSelector=selector)
                    resource_version = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing["items"]:
                        seen.add(pod["metadata"]["uid"])
                        self.dispatch(pod)
                    for uid, worker in list(self.workers.items()):
                        if uid not in seen:
                            worker.mark_gone()
                for event in self.kube.watch("/api/v1/pods", {
                        "fieldSelector": selector, "resourceVersion": resource_version,
                        "allowWatchBookmarks": "true", "timeoutSeconds": 300}, read_timeout=330.0):
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            resource_version = ""
                        break
                    resource_version = obj["metadata"].get("resourceVersion", resource_version)
                    if kind in ("ADDED", "MODIFIED"):
                        self.dispatch(obj)
                    elif kind == "DELETED" and (deleted := self.workers.get(obj["metadata"]["uid"])):
                        deleted.mark_gone()
                self.forget_finished()
            except Exception as exc:
                log.warning("pod watch failed (%s); relisting", exc)
                resource_version = ""
                time.sleep(1.0)

    def shutdown(self, *_: Any) -> None:
        """On SIGTERM (`down`): stop every container quickly, leave the API alone, exit."""
        # The pod workers keep running while this handler does: without the flag, one of them
        # would "restart" the container this handler just stopped, and that one would outlive us.
        self.stopping = True
        with self.start_lock:
            procs = [r.proc for w in list(self.workers.values()) for r in w.init_runs + w.runs
                     if r.proc is not None]
        _stop_processes(procs, 3.0)
        os._exit(0)

    def kill_orphans(self) -> None:
        """Kill processes a previous simulator left in the node (they would hold ports and rules)."""
        from proxyshift.commands import run

        pids = [int(p) for netns in (self.cfg.node, self.cfg.pod_netns) if netns
                for p in run(["ip", "netns", "pids", netns], check=False).stdout.split()
                if p.isdigit() and int(p) != os.getpid()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            log.info("killed %d processes left in %s by an earlier simulator", len(pids), self.cfg.node)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.shutdown)
        signal.signal(signal.SIGINT, self.shutdown)
        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)
        self.kill_orphans()
        try:
            self.log_server.start()
        except Exception as exc:  # logs are a convenience: never the reason a node is down
            log.warning("kubelet log API not started: %s", exc)
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()
        self.watch_pods()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="localcluster.nodesim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", required=True)
    parser.add_argument("--node-ip", help="default: from the node name (ps-node-<i> -> 198.18.0.<10+i>)")
    parser.add_argument("--pod-ip", help="the node's pod namespace address (default: from the node name, "
                                         "see localcluster.podnet)")
    parser.add_argument("--pool", default="default")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, default=paths.default_state_dir())
    parser.add_argument("--api-url", default=f"https://{paths.BRIDGE_ADDRESS}:{paths.APISERVER_PORT}",
                        help="what pods get as KUBERNETES_SERVICE_HOST/PORT")
    parser.add_argument("--kubelet-version", default="v1.37.2")
    parser.add_argument("--backoff-base", type=float, default=10.0)
    parser.add_argument("--backoff-max", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node} %(levelname)s %(message)s")
    node_ip = args.node_ip
    if node_ip is None:
        node_ip = paths.node_ip(paths.node_index(args.node))
    pod_ip = args.pod_ip
    if pod_ip is None:
        pod_ip = podnet.pod_ip(paths.node_index(args.node))
    rest = args.api_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    cfg = SimConfig(node=args.node, node_ip=node_ip, pool=args.pool, kubeconfig=args.kubeconfig,
                    bin_dir=args.bin_dir, state_dir=args.state_dir, api_host=host or rest,
                    api_port=int(port) if host else 443, kubelet_version=args.kubelet_version,
                    backoff_base=args.backoff_base, backoff_max=args.backoff_max,
                    pod_netns=podnet.pod_netns(args.node), pod_ip=pod_ip)
    Simulator(cfg).run()


if __name__ == "__main__":
    main()
