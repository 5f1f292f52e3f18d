"""What a container's securityContext grants, worked out as a kubelet with containerd does.

The node simulator starts every container through `localcluster/container.py`; this module turns
the pod's and the container's securityContext into the launcher's confinement flags, so a
container started with less than it needs fails here as it would on a real node (the agent
without NET_ADMIN cannot flush; the operator runs as 65532 with a read-only root).

Pure: no I/O. The image defaults (its USER) are the ones of the images the simulator runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# containerd's default capability set for a non-privileged container (oci/spec_opts defaults).
DEFAULT_CAPABILITIES = frozenset({
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
    "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
})

# USER of each image the simulator runs: (uid, gid). kube-proxy's image runs as root, proxyshift's
# Dockerfile says USER 65532:65532 (the test bed's own image is taken to be built the same way),
# registry.k8s.io/pause 3.9+ runs as 65535.
IMAGE_USERS: Mapping[str, tuple[int, int]] = {"kube-proxy": (0, 0), "proxyshift": (65532, 65532),
                                              "localcluster": (65532, 65532),
                                              "pause": (65535, 65535), "cilium": (0, 0)}


class SecurityContextError(ValueError):
    """The container cannot start as specified (the kubelet's CreateContainerConfigError)."""


@dataclass(frozen=True)
class Confinement:
    uid: int
    gid: int
    # None: every capability the node has (privileged); otherwise the bounding, permitted and
    # effective set (and the ambient set of a non-root process).
    capabilities: frozenset[str] | None
    read_only_root: bool
    no_new_privs: bool

    def launcher_args(self) -> list[str]:
        """The flags of `python -m localcluster.container` that apply this confinement."""
        args = ["--uid", str(self.uid), "--gid", str(self.gid)]
        if self.capabilities is not None:
            args += ["--caps", ",".join(sorted(self.capabilities))]
        if self.read_only_root:
            args.append("--read-only-root")
        if self.no_new_privs:
            args.append("--no-new-privs")
        return args


def _capability(name: str) -> str:
    name = name.upper()
    return name[4:] if name.startswith("CAP_") else name


def confinement(pod_spec: Mapping[str, Any], container: Mapping[str, Any], image_kind: str | None) -> Confinement:
    """The container's confinement: its own securityContext over the pod's, over the image's USER."""
    pod_sc: Mapping[str, Any] = pod_spec.get("securityContext") or {}
    sc: Mapping[str, Any] = container.get("securityContext") or {}

    def setting(key: str) -> Any:
        return sc[key] if sc.get(key) is not None else pod_sc.get(key)

    image_uid, image_gid = IMAGE_USERS.get(image_kind or "", (0, 0))
    uid = setting("runAsUser")
    gid = setting("runAsGroup")
    uid = image_uid if uid is None else int(uid)
    # A runAsUser without runAsGroup takes the image user's group when the image names that user,
    # else group 0 (containerd looks the uid up in the image's /etc/passwd).
    gid = int(gid) if gid is not None else (image_gid if uid == image_uid else 0)
    name = container.get("name", "?")
    if setting("runAsNonRoot") and uid == 0:
        if setting("runAsUser") is None:
            raise SecurityContextError(f"container {name} has runAsNonRoot and image will run as root")
        raise SecurityContextError(f"container {name}'s runAsUser breaks non-root policy")
    privileged = bool(sc.get("privileged"))
    escalation = sc.get("allowPrivilegeEscalation")
    if privileged and escalation is False:
        raise SecurityContextError(f"container {name}: cannot set allowPrivilegeEscalation to false and "
                                   "privileged to true")
    read_only_root = bool(sc.get("readOnlyRootFilesystem"))
    if privileged:
        return Confinement(uid, gid, None, read_only_root, False)
    caps_spec: Mapping[str, Any] = sc.get("capabilities") or {}
    drop = {_capability(c) for c in caps_spec.get("drop") or []}
    add = {_capability(c) for c in caps_spec.get("add") or []}
    caps = (set() if "ALL" in drop else set(DEFAULT_CAPABILITIES) - drop) | add
    # add: [ALL] grants every capability, as privileged does (without its escalation).
    return Confinement(uid, gid, None if "ALL" in caps else frozenset(caps), read_only_root, escalation is False)
