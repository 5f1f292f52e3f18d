"""A pod's volumes on the simulated node: hostPath, emptyDir, ConfigMap, Secret, downward API and
projected service-account tokens, written in place and refreshed as the kubelet does."""

from __future__ import annotations

import base64
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from localcluster.kubeapi import Kube
from localcluster.nodesim.podspec import PodError, field_value

# hostPaths that are the node's own, not the machine's: each node's pods see `<node dir>/hostpath/<path>`
# there. /var/run/cilium holds a node's Cilium agent's state and API socket (cilium.sock), which the
# other pods of that node (the proxyshift agent) must reach and no other node's may see. /sys/fs/bpf is
# the node's BPF filesystem: a bpffs instance of its own (`node_bpffs`), where the node's Cilium pins its
# links and maps as on a real node, and which the proxyshift agent's flush reads; never the host's.
NODE_BPFFS = Path("/sys/fs/bpf")
NODE_HOST_PATHS = (Path("/run/cilium"), NODE_BPFFS)
NODE_HOST_PATHS_DIR = "hostpath"
TOKEN_TTL_SECONDS = 3607  # kubelet's default projected-token lifetime
VOLUME_REFRESH_SECONDS = 10.0
VOLUME_GET_TIMEOUT = 5.0


def node_host_path(node_dir: Path, path: Path) -> Path | None:
    """Where a node-private hostPath is for this node (/var/run is /run), or None for a machine-wide one."""
    normal = Path("/run") / path.relative_to("/var/run") if path.is_relative_to("/var/run") else path
    if any(normal.is_relative_to(root) for root in NODE_HOST_PATHS):
        return node_dir / NODE_HOST_PATHS_DIR / normal.relative_to("/")
    return None


def node_bpffs(node_dir: Path) -> Path:
    """The node's bpffs on the host (its hostPath /sys/fs/bpf), mounted as one (idempotent)."""
    from localcluster import cilium

    path = node_host_path(node_dir, NODE_BPFFS)
    assert path is not None
    return cilium.mount_bpffs(path)


def write_files(target: Path, files: dict[str, tuple[bytes, int]]) -> None:
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


class VolumeHost(Protocol):
    """What a pod's volumes need from the simulator: the API, the CA, a record of host paths made."""

    kube: Kube

    def ca_pem(self) -> str: ...

    def note_created(self, path: Path) -> None: ...


class PodVolumes:
    """One pod's volumes: where each is on the node (`paths`, by volume name) and when to remake them."""

    def __init__(self, host: VolumeHost, pod_dir: Path, namespace: str, pod_name: str, uid: str, node_ip: str,
                 pod_ip: str, token_owner: Callable[[dict[str, Any]], int | None],
                 node_dir: Path | None = None) -> None:
        self.host = host
        self.pod_dir = pod_dir
        # The node's folder (node-private hostPaths live under it); pods live in <node dir>/pods/<pod>.
        self.node_dir = node_dir if node_dir is not None else pod_dir.parent.parent
        self.namespace = namespace
        self.pod_name = pod_name
        self.uid = uid
        self.node_ip = node_ip
        self.pod_ip = pod_ip
        # The uid a projected token file is handed to (the pod's containers decide it).
        self.token_owner = token_owner
        self.paths: dict[str, Path] = {}
        self.refreshed_at = 0.0
        self.tokens: dict[str, float] = {}  # token file -> monotonic time to refresh

    def complete(self, pod: dict[str, Any]) -> bool:
        """Every volume of `pod` was made at least once."""
        return all(v["name"] in self.paths for v in pod["spec"].get("volumes") or [])

    def sync(self, pod: dict[str, Any]) -> None:
        """Make every volume of `pod` (again when due: every VOLUME_REFRESH_SECONDS, or a token's renewal)."""
        now = time.monotonic()
        due_tokens = any(t <= now for t in self.tokens.values())
        if self.paths and now - self.refreshed_at < VOLUME_REFRESH_SECONDS and not due_tokens:
            return
        for volume in pod["spec"].get("volumes") or []:
            self.paths[volume["name"]] = self._materialise(pod, volume)
        self.refreshed_at = now

    def _materialise(self, pod: dict[str, Any], volume: dict[str, Any]) -> Path:
        name = volume["name"]
        target = self.pod_dir / "volumes" / name
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type") or ""
            private = node_host_path(self.node_dir, host)
            if private is not None and host.is_relative_to(NODE_BPFFS):
                node_bpffs(self.node_dir)  # a folder in a plain directory would be no bpffs
            if private is not None:
                # Inside the node's folder, which `down` removes whole: nothing to note. Made when
                # missing whatever the type says, as containerd makes a missing hostPath directory.
                if kind in ("File", "FileOrCreate"):
                    private.parent.mkdir(parents=True, exist_ok=True)
                    private.touch()
                else:
                    private.mkdir(parents=True, exist_ok=True)
                return private
            if kind == "DirectoryOrCreate" and not host.exists():
                self.host.note_created(host)
                host.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not host.exists():
                self.host.note_created(host)
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
            files = self._downward_files(pod, volume["downwardAPI"], volume["downwardAPI"].get("defaultMode"))
        elif "projected" in volume:
            mode = volume["projected"].get("defaultMode")
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    files.update(self._token_file(pod, source["serviceAccountToken"], target, mode))
                elif "configMap" in source:
                    files.update(self._object_files("configmaps", source["configMap"], mode))
                elif "secret" in source:
                    files.update(self._object_files("secrets", source["secret"], mode))
                elif "downwardAPI" in source:
                    files.update(self._downward_files(pod, source["downwardAPI"], mode))
                else:
                    raise PodError("CreateContainerConfigError",
                                   f"volume {name}: projected source {sorted(source)} not supported")
        else:
            raise PodError("CreateContainerConfigError",
                           f"volume {name}: type {sorted(k for k in volume if k != 'name')} not supported "
                           f"by the node simulator")
        write_files(target, files)
        owner = self.token_owner(pod) if "projected" in volume else None
        if owner is not None:
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    os.chown(target / source["serviceAccountToken"].get("path", "token"), owner, -1)
        return target

    def _object_files(self, kind: str, spec: dict[str, Any], default_mode: int | None) -> dict[str, tuple[bytes, int]]:
        name = spec.get("name")
        obj = self.host.kube.get_or_none(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}",
                                        timeout=VOLUME_GET_TIMEOUT)
        if obj is None:
            if spec.get("optional"):
                return {}
            if kind == "configmaps" and name == "kube-root-ca.crt":
                # The root-CA publisher may not have run yet in a fresh namespace; the CA
                # is the same one the kubeconfig trusts.
                obj = {"data": {"ca.crt": self.host.ca_pem()}}
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

    def _downward_files(self, pod: dict[str, Any], spec: dict[str, Any],
                        default_mode: int | None) -> dict[str, tuple[bytes, int]]:
        mode = default_mode if default_mode is not None else 0o644
        out = {}
        for item in spec.get("items") or []:
            if "fieldRef" not in item:
                raise PodError("CreateContainerConfigError", "downwardAPI resourceFieldRef not supported")
            value = field_value(pod, item["fieldRef"]["fieldPath"], self.node_ip, self.pod_ip)
            out[item["path"]] = (value.encode(), item.get("mode", mode))
        return out

    def _token_file(self, pod: dict[str, Any], spec: dict[str, Any], target: Path,
                    mode: int | None) -> dict[str, tuple[bytes, int]]:
        path = spec.get("path", "token")
        key = str(target / path)
        if key in self.tokens and self.tokens[key] > time.monotonic() and (target / path).exists():
            return {path: ((target / path).read_bytes(), mode if mode is not None else 0o600)}
        ttl = int(spec.get("expirationSeconds") or TOKEN_TTL_SECONDS)
        account = pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [spec["audience"]] if spec.get("audience") else None,
                         "expirationSeconds": ttl,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name,
                                            "uid": self.uid}}}
        try:
            answer = self.host.kube.post(
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", body)
        except Exception as exc:
            raise PodError("CreateContainerConfigError", f"TokenRequest for {account}: {exc}") from exc
        self.tokens[key] = time.monotonic() + 0.8 * ttl  # kubelet renews at 80% of the lifetime
        return {path: (answer["status"]["token"].encode(), mode if mode is not None else 0o600)}
