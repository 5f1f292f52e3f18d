"""Reading a pod spec as the kubelet does: which image it is, $(VAR) expansion, the downward API,
named ports, and which paths of the simulator's "image" a volume mount would hide."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import proxyshift

KUBE_PROXY_IMAGE = "registry.k8s.io/kube-proxy"
PROXYSHIFT_IMAGE = "ghcr.io/proxyshift/proxyshift"
# The test bed's own tools (`localcluster serve`, the tests' identity listener), as an image of its own:
# the product's image does not carry the test bed.
TESTBED_IMAGE = "ghcr.io/proxyshift/localcluster"
# The images the simulator runs as this interpreter with this checkout on its path.
PYTHON_IMAGE_KINDS = ("proxyshift", "localcluster")
# kubelet's sandbox image, as an ordinary workload: it does nothing until it is stopped. Tests use it
# for pods that must be Running on a node (a drain blocked by a PodDisruptionBudget needs one).
PAUSE_IMAGE = "registry.k8s.io/pause"
PAUSE_ARGV = [sys.executable, "-c", "import signal; signal.pause()"]
# Cilium's agent image: the pinned agent built as the Go tool `cilium-agent` (localcluster.gotools),
# started by localcluster.cilium's confined launcher (its node's cgroup, netns and a private mount ns).
CILIUM_IMAGE = "quay.io/cilium/cilium"
CILIUM_COMMAND = "cilium-agent"


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
    if repo == TESTBED_IMAGE:
        return "localcluster"
    if repo == PAUSE_IMAGE:
        return "pause"
    if repo == CILIUM_IMAGE:
        return "cilium"
    return None


def image_paths() -> list[str]:
    """What the proxyshift and localcluster "images" are here: this interpreter's prefixes and the
    checkout's two packages."""
    return sorted({sys.base_prefix, sys.prefix, str(product_root()), str(testbed_root())})


def product_root() -> Path:
    """The folder whose child `proxyshift` is the product package (the checkout's operator/)."""
    return Path(proxyshift.__file__).resolve().parent.parent


def testbed_root() -> Path:
    """The folder whose child `localcluster` is the test bed package (the checkout's root)."""
    return Path(__file__).resolve().parents[2]


def python_path(kind: str) -> str:
    """PYTHONPATH for a container of a Python image: the simulator's own copies, whatever the install."""
    return str(product_root()) if kind == "proxyshift" else f"{testbed_root()}:{product_root()}"


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
