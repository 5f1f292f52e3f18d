"""Cilium's agent (kube-proxy replacement) confined to one simulated node.

A node of the test bed is a network namespace, but Cilium's socket-LB does not follow the network
namespace: it is a set of cgroup BPF programs (connect4, sendmsg4, getpeername4, ...) attached to
the cgroup v2 directory the agent takes for the cgroup root, and they translate the connects of
every process in that cgroup and below, whatever its network namespace. An agent that mounts
cgroup2 itself sees the host's hierarchy and attaches at the host's root cgroup, i.e. to every
process of the machine. So an agent runs here:

- in a cgroup v2 subtree of its own node (`<cgroup2 mount>/proxyshift-cilium-<node>`), joined before
  anything else, then in a cgroup namespace rooted there (`unshare(CLONE_NEWCGROUP)`), with a fresh
  cgroup2 mount at its --cgroup-root: that mount's root is the node's subtree, so the root the agent
  attaches socket-LB to is the node's cgroup. The launcher refuses to exec the agent when the mount
  is the host's root cgroup (it has no `cgroup.events`, which every non-root cgroup has);
- in the node's network namespace (its tc/tcx programs, routes, cilium_host/cilium_net and CILIUM_*
  iptables chains are that namespace's, and go away with it);
- in a private mount namespace with a tmpfs over /run (the agent writes /var/run/cilium whatever its
  flags say), a bpffs at --bpf-root, /sys remounted for the node, and
  /proc/sys/kernel/{unprivileged_bpf_disabled,timer_migration} bound read-only: the agent writes both,
  and they are the machine's, not the namespace's. The bpffs is the node's own (`--bpffs`, one bpffs
  instance per simulated node mounted on the host by `mount_bpffs`, as a real node's /sys/fs/bpf):
  the agent's pinned links and maps outlive it there, socket-LB stays attached at the node's cgroup and
  tcx on its devices after it stopped, and a restarted agent finds its maps; `remove_bpffs` unpins and
  unmounts it with the node. Without `--bpffs` a private instance dies with the agent's namespace.

The processes that should see the node's Services (the tests' clients) join the same cgroup and
network namespace (`dial`). Services come from `--lb-state-file` (Kubernetes Services and
EndpointSlices as JSON, Cilium's pkg/loadbalancer/reflectors/file.go); there is no API server.

    python -m localcluster.cilium confine --cgroup DIR --netns NS -- AGENT FLAGS...   (the launcher)
    python -m localcluster.cilium dial --cgroup DIR --netns NS ADDRESS PORT           (one TCP dial)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localcluster import container, gotools
from proxyshift.agent.flush.bpf import bpffs_mounts, is_bpffs
from proxyshift.commands import CommandError, run, stop_child

AGENT_TOOL = "cilium-agent"
CILIUM_MODULE = "github.com/cilium/cilium"
# Cilium's own image compiles with clang 19; Debian 12's default clang-14 leaves programs this
# kernel's verifier rejects. The agent runs `clang` from PATH.
LLVM_BIN = Path("/usr/lib/llvm-19/bin")
CGROUP_PREFIX = "proxyshift-cilium-"
CLONE_NEWCGROUP = 0x02000000
# Where the launcher mounts things inside the agent's private mount namespace (a tmpfs over /run).
# /run/cilium is the agent's state dir (and /var/run/cilium its socket's folder): a pod's hostPath
# /var/run/cilium is bound there, so its own mounts live beside it, never inside that node folder.
PRIVATE_RUN = Path("/run/cilium")
LAUNCHER_RUN = Path("/run/proxyshift-cilium")
PRIVATE_BPFFS = LAUNCHER_RUN / "bpffs"
# On the host: where a dataplane test's node keeps its bpffs (the local cluster's nodes keep theirs at their
# hostPath /sys/fs/bpf, localcluster/nodesim/volumes.py). Never the host's own /sys/fs/bpf.
HOST_BPFFS_ROOT = Path("/run/proxyshift-cilium")
# The kernel's own iterators in every new bpffs instance (bpf_preload): not unlinkable, and nobody's pins.
BPFFS_PRELOADED = frozenset({"maps.debug", "progs.debug"})
PRIVATE_CGROUP = LAUNCHER_RUN / "cgroupv2"
MOUNTINFO = Path("/proc/self/mountinfo")
# Machine-wide sysctls the agent's loader sets (pkg/datapath/loader/base.go, errors ignored).
HOST_SYSCTLS = ("/proc/sys/kernel/unprivileged_bpf_disabled", "/proc/sys/kernel/timer_migration")
# Healthy in about 5 s here (bpf_host compiled by clang in 1.4 s on 2 cores); generous for a loaded CI machine.
HEALTH_TIMEOUT_SECONDS = 180.0
STOP_GRACE_SECONDS = 20.0
GO_TIMEOUT_SECONDS = 60.0

_libc = ctypes.CDLL(None, use_errno=True)


class CiliumError(RuntimeError):
    """The agent is not built, could not be confined, did not become healthy, or left something behind."""


# ---------------------------------------------------------------- the host side


def cgroup2_mount() -> Path:
    """Where this machine mounts cgroup v2 (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid one)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            return Path(before.split()[4])
    raise CiliumError("no cgroup2 mount on this machine: Cilium's socket-LB needs cgroup v2")


def node_cgroup(node: str) -> Path:
    """The node's cgroup v2 subtree: the agent's cgroup root, and where the node's clients must be."""
    return cgroup2_mount() / f"{CGROUP_PREFIX}{node}"


def node_bpffs(node: str) -> Path:
    """Where a dataplane test's node keeps its bpffs on the host (mounted by `mount_bpffs`)."""
    return HOST_BPFFS_ROOT / node / "bpffs"


def bpffs_mount_points() -> set[Path]:
    """The bpffs mount points in this process's mount namespace (the agent's own mountinfo reading)."""
    return {Path(point) for point in bpffs_mounts(MOUNTINFO.read_text(errors="replace"))}


def bpffs_mounted(path: Path) -> bool:
    """Whether `path` is a bpffs mount point in this process's mount namespace."""
    return is_bpffs(path, MOUNTINFO.read_text(errors="replace"))


def mount_bpffs(path: Path) -> Path:
    """A bpffs instance of its own at `path` (made if needed; idempotent): a simulated node's /sys/fs/bpf."""
    resolved = Path(os.path.realpath(path))
    if resolved == Path("/sys/fs/bpf"):
        raise CiliumError(f"{path} is the host's BPF filesystem: a node's bpffs goes elsewhere")
    resolved.mkdir(parents=True, exist_ok=True)
    if not bpffs_mounted(resolved):
        container._mount("bpffs", str(resolved), "bpf", 0, "mode=0700")
    return resolved


def _unpin_tree(top: Path, *, keep: frozenset[str] = frozenset()) -> int:
    """Unlink every pin below `top` (symlinks as entries, never followed) and its folders; `keep`: names at the
    top level that stay. Returns how many pins went."""
    removed = 0
    for here, dirs, files in os.walk(top, topdown=False, followlinks=False):
        for name in [*files, *(d for d in dirs if (Path(here) / d).is_symlink())]:
            if Path(here) == top and name in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                (Path(here) / name).unlink()
                removed += 1
        for name in dirs:
            with contextlib.suppress(OSError):
                (Path(here) / name).rmdir()
    return removed


def unpin_cilium(path: Path) -> int:
    """Test-bed hygiene: unpin what a node's Cilium pinned in its own folder of the node's bpffs (`path`),
    as a node that left Cilium without the operator's cleanup would need. Returns how many pins went."""
    folder = Path(os.path.realpath(path)) / "cilium"
    if not bpffs_mounted(folder.parent) or not folder.is_dir():
        return 0
    removed = _unpin_tree(folder)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return removed


def remove_bpffs(path: Path) -> int:
    """Unpin everything in a node's bpffs (a pinned link's program is detached with its last reference),
    unmount it and remove the folder. Returns how many pins went. Idempotent; only a bpffs mount is emptied."""
    removed = 0
    resolved = Path(os.path.realpath(path))
    if bpffs_mounted(resolved):
        removed = _unpin_tree(resolved, keep=BPFFS_PRELOADED)
        if _libc.umount2(str(resolved).encode(), 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {resolved}: {os.strerror(err)}")
    with contextlib.suppress(OSError):
        resolved.rmdir()
        if resolved.parent.parent == HOST_BPFFS_ROOT:
            resolved.parent.rmdir()
            HOST_BPFFS_ROOT.rmdir()
    return removed


def image_flags(lib_dir: Path) -> list[str]:
    """What the agent's image and the launcher provide, as flags: the datapath sources (`lib_dir/bpf`),
    the bpffs and cgroup2 mounts the launcher made in the agent's mount namespace."""
    return [f"--lib-dir={lib_dir}", f"--bpf-root={PRIVATE_BPFFS}", f"--cgroup-root={PRIVATE_CGROUP}"]


def prepare_lib_dir(lib_dir: Path) -> Path:
    """`lib_dir/bpf` -> the pinned module's bpf/ (read only: the agent writes under --state-dir)."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    link = lib_dir / "bpf"
    sources = bpf_sources()
    if link.is_symlink() and link.resolve() == sources.resolve():
        return lib_dir
    link.unlink(missing_ok=True)
    link.symlink_to(sources)
    return lib_dir


def bpf_sources() -> Path:
    """The pinned Cilium module's bpf/ folder (the agent compiles its datapath from it at start)."""
    module = gotools.module_dir(AGENT_TOOL)
    env = {**os.environ, "GOFLAGS": gotools.GOFLAGS, "GOWORK": "off"}
    try:
        result = run(["go", "-C", str(module), "list", "-m", "-f", "{{.Dir}}", CILIUM_MODULE],
                     timeout=GO_TIMEOUT_SECONDS, env=env)
    except CommandError as exc:
        raise CiliumError(f"cannot find the Cilium module's sources: {exc}") from exc
    directory = Path(result.stdout.strip()) / "bpf"
    if not (directory / "bpf_host.c").is_file():
        raise CiliumError(f"no Cilium BPF sources at {directory}: {gotools.build_hint(AGENT_TOOL)}")
    return directory


@dataclass(frozen=True)
class Service:
    """One TCP Service of the lb state file: a ClusterIP, optionally a NodePort, one backend per address."""

    name: str
    cluster_ip: str
    port: int
    target_port: int
    backends: tuple[str, ...]
    node_port: int | None = None
    namespace: str = "default"


def lb_state(services: Sequence[Service]) -> dict[str, Any]:
    """The --lb-state-file document: Kubernetes Services and EndpointSlices, as Cilium reads them."""
    items: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    for svc in services:
        port: dict[str, Any] = {"name": "tcp", "port": svc.port, "protocol": "TCP", "targetPort": svc.target_port}
        if svc.node_port is not None:
            port["nodePort"] = svc.node_port
        items.append({
            "metadata": {"name": svc.name, "namespace": svc.namespace},
            "spec": {"type": "NodePort" if svc.node_port is not None else "ClusterIP",
                     "clusterIP": svc.cluster_ip, "clusterIPs": [svc.cluster_ip], "ports": [port]},
        })
        slices.append({
            "metadata": {"name": f"{svc.name}-1", "namespace": svc.namespace,
                         "labels": {"kubernetes.io/service-name": svc.name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True, "serving": True,
                                                                  "terminating": False}}
                          for address in svc.backends],
            "ports": [{"name": "tcp", "port": svc.target_port, "protocol": "TCP"}],
        })
    return {"services": items, "endpoints": slices}


def agent_flags(devices: Sequence[str], *, lib_dir: Path, socket_path: Path, lb_state_file: Path,
                native_cidr: str) -> list[str]:
    """Native-routing KPR for one node, without an API server, health checks, Hubble or the L7 proxy."""
    return [
        "--kube-proxy-replacement=true", "--routing-mode=native", f"--ipv4-native-routing-cidr={native_cidr}",
        "--enable-ipv4=true", "--enable-ipv6=false", f"--devices={','.join(devices)}",
        # The first device is the node's link to the network (the NodePorts' address); with more than
        # one, the agent will not guess it.
        f"--direct-routing-device={devices[0]}",
        "--enable-l7-proxy=false", "--enable-health-checking=false", "--enable-endpoint-health-checking=false",
        "--enable-hubble=false", "--cni-exclusive=false",
        "--enable-k8s=false",  # no API server: Services come from the lb state file
        f"--lb-state-file={lb_state_file}", f"--socket-path={socket_path}",
        # Inside the launcher's private mount namespace (see the module's docstring).
        f"--state-dir={PRIVATE_RUN}", *image_flags(lib_dir),
    ]


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def api_get(socket_path: Path, path: str, *, timeout: float = 5.0) -> Any:
    """GET the agent's REST API on its unix socket (what `cilium-dbg` does) and decode the JSON."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise CiliumError(f"GET {path}: {response.status} {body[:200]!r}")
    return json.loads(body)


def kpr_enabled(health: dict[str, Any]) -> bool:
    """Whether /v1/healthz says the kube-proxy replacement is on (the field `cilium-dbg status` shows)."""
    return str(health.get("kube-proxy-replacement", {}).get("mode", "")).lower() == "true"


def host_endpoint_ready(socket_path: Path) -> bool:
    """Whether the node's host endpoint is regenerated: its datapath compiled and loaded.

    /v1/healthz says Ok before the first BPF compile has finished; the host endpoint turns
    ready once bpf_host is attached to the node's devices (and socket-LB to its cgroup).
    """
    try:
        endpoints = api_get(socket_path, "/v1/endpoint")
    except (OSError, CiliumError, ValueError):
        return False
    return any("reserved:host" in (e.get("status", {}).get("identity", {}).get("labels") or [])
               and e.get("status", {}).get("state") == "ready" for e in endpoints)


@dataclass
class ConfinedAgent:
    """One agent confined to one node: its cgroup, state folder and process."""

    node: str
    netns: str
    cgroup: Path
    workdir: Path
    proc: subprocess.Popen[bytes]
    started: float
    log_path: Path
    healthy_after: float | None = None
    health: dict[str, Any] = field(default_factory=dict)
    # The node's bpffs on the host, when it has one that outlives the agent (`start(bpffs=...)`).
    bpffs: Path | None = None

    @property
    def socket_path(self) -> Path:
        return self.workdir / "cilium.sock"

    def rss_bytes(self) -> int:
        """The agent's resident memory (VmRSS of its process)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def host_endpoint_ready(self) -> bool:
        return host_endpoint_ready(self.socket_path)

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_SECONDS) -> dict[str, Any]:
        """Poll /v1/healthz until the agent reports Ok with the kube-proxy replacement on."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CiliumError(f"cilium-agent exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                health = api_get(self.socket_path, "/v1/healthz")
            except (OSError, CiliumError, ValueError) as exc:
                last = str(exc)
            else:
                state = health.get("cilium", {}).get("state")
                if state == "Ok" and kpr_enabled(health) and self.host_endpoint_ready():
                    self.healthy_after = time.monotonic() - self.started
                    self.health = health
                    return health
                last = (f"cilium {state}, kube-proxy-replacement {health.get('kube-proxy-replacement')}, "
                        f"host endpoint not ready")
            time.sleep(0.25)
        raise CiliumError(f"cilium-agent not healthy after {timeout:g}s ({last}):\n{self.log_tail()}")

    def stop(self, *, keep_cgroup: bool = False) -> None:
        """Stop the agent by its pid, then remove its cgroup and state folder (its netns is the caller's).

        A node bpffs (`bpffs`) stays, with whatever the agent pinned in it: as on a real node, its links keep
        socket-LB attached at the node's cgroup while the cgroup lives (remove_bpffs, or the flush, unpins).
        keep_cgroup: leave the node's cgroup (and what is attached there) as a real node's stays."""
        stop_child(self.proc, grace=STOP_GRACE_SECONDS)
        if not keep_cgroup:
            remove_cgroup(self.cgroup)
        shutil.rmtree(self.workdir, ignore_errors=True)


def agent_pid(cgroup: Path) -> int | None:
    """The pid of the cilium-agent process in a node's cgroup, if one runs there."""
    with contextlib.suppress(OSError):
        for text in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{text}/comm").read_text().strip() == "cilium-agent":
                    return int(text)
    return None


def make_cgroup(node: str, *, exist_ok: bool = False) -> Path:
    """The node's cgroup v2 subtree (empty; unless exist_ok, fails if a stale one of that name exists)."""
    path = node_cgroup(node)
    path.mkdir(exist_ok=exist_ok)
    return path


def remove_cgroup(path: Path, *, timeout: float = 10.0) -> None:
    """Kill what is left in the node's cgroup (by pid, its own processes only), then remove it.

    rmdir of a cgroup detaches the BPF programs attached to it: the node's socket-LB goes with it.
    """
    if not path.exists():
        return
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start(node: str, netns: str, devices: Sequence[str], services: Sequence[Service], *, native_cidr: str,
          agent: Path | None = None, bpffs: Path | None = None, cgroup_exists: bool = False,
          extra_flags: Sequence[str] = ()) -> ConfinedAgent:
    """Start the agent confined to `node` (a network namespace that exists) serving `services`.

    bpffs: the node's bpffs on the host (`mount_bpffs`), bound at the agent's --bpf-root so that its pins
    outlive it; cgroup_exists: the node's cgroup is kept from an earlier agent (a restart).
    """
    binary = agent or gotools.built(AGENT_TOOL)
    if binary is None:
        raise CiliumError(gotools.build_hint(AGENT_TOOL))
    if not (LLVM_BIN / "clang").is_file():
        raise CiliumError(f"no clang at {LLVM_BIN}: install clang-19 (hack/install-deps.sh does)")
    sources = bpf_sources()
    workdir = Path(tempfile.mkdtemp(prefix=f"proxyshift-cilium-{node}-"))
    cgroup: Path | None = None
    try:
        lib = workdir / "lib"
        lib.mkdir()
        (lib / "bpf").symlink_to(sources)  # read only: the agent writes its objects under --state-dir
        state_file = workdir / "lb-state.json"
        state_file.write_text(json.dumps(lb_state(services), indent=1))
        cgroup = make_cgroup(node, exist_ok=cgroup_exists)
        log_path = workdir / "agent.log"
        argv = [sys.executable, "-m", "localcluster.cilium", "confine", "--cgroup", str(cgroup),
                "--netns", netns, *(["--bpffs", str(bpffs)] if bpffs is not None else []), "--", str(binary),
                *agent_flags(devices, lib_dir=lib, socket_path=workdir / "cilium.sock",
                             lb_state_file=state_file, native_cidr=native_cidr), *extra_flags]
        env = {**os.environ, "PATH": f"{LLVM_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               "K8S_NODE_NAME": node}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,  # noqa: S603
                                    start_new_session=True)
        return ConfinedAgent(node, netns, cgroup, workdir, proc, time.monotonic(), log_path, bpffs=bpffs)
    except BaseException:
        if cgroup is not None:
            remove_cgroup(cgroup)
        shutil.rmtree(workdir, ignore_errors=True)
        raise


# ---------------------------------------------------------------- inside the node


def _unshare(flags: int, what: str) -> None:
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare({what}): {os.strerror(err)}")


def join_node(cgroup: Path, netns: str) -> None:
    """Move this (single-threaded) process into the node's cgroup and network namespace."""
    (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
    container.setns(netns)


def _bind_read_only(path: str) -> None:
    container._mount(path, path, None, container.MS_BIND)
    container._mount(None, path, None, container.MS_BIND | container.MS_REMOUNT | container.MS_RDONLY)


def confine(cgroup: Path, netns: str, binds: Sequence[tuple[str, str, bool]] = (),
            created: list[Path] | None = None, bpffs: Path | None = None) -> None:
    """Everything but the exec: the node's cgroup and netns, then private cgroup and mount namespaces.

    `binds` (src, dst, read_only) are a pod's volumes, bound last: a hostPath /var/run/cilium lands on
    the tmpfs's /run/cilium, so the agent's socket is in the node's folder the other pods see.
    `bpffs`: the node's bpffs on the host (a bpffs mount point, never the host's /sys/fs/bpf), bound at
    PRIVATE_BPFFS instead of a private instance.
    """
    if bpffs is not None and (not bpffs_mounted(bpffs) or os.path.realpath(bpffs) == "/sys/fs/bpf"):
        raise CiliumError(f"{bpffs} is no node bpffs (mount one with localcluster.cilium.mount_bpffs)")
    join_node(cgroup, netns)
    # The cgroup namespace is rooted at the cgroup the caller is in: joined above, so the node's.
    _unshare(container.CLONE_NEWNS | CLONE_NEWCGROUP, "CLONE_NEWNS|CLONE_NEWCGROUP")
    container._mount(None, "/", None, container.MS_REC | container.MS_PRIVATE)
    container._remount_sys(netns)
    # Opened in this namespace's copy of the mount, before the tmpfs over /run can hide it.
    node_fs = os.open(bpffs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if bpffs is not None else None
    container._mount("tmpfs", "/run", "tmpfs", container.MS_NOSUID | container.MS_NODEV, "mode=0755")
    for path in (PRIVATE_BPFFS, PRIVATE_CGROUP):
        path.mkdir(parents=True)
    if node_fs is None:
        container._mount("bpffs", str(PRIVATE_BPFFS), "bpf", 0, "mode=0700")
    else:
        container._mount(f"/proc/self/fd/{node_fs}", str(PRIVATE_BPFFS), None, container.MS_BIND)
        os.close(node_fs)
    container._mount("cgroup2", str(PRIVATE_CGROUP), "cgroup2", 0)
    # The guard the whole confinement rests on: the cgroup root the agent will attach socket-LB to
    # must be the node's subtree holding this process, never the machine's root cgroup.
    if not (PRIVATE_CGROUP / "cgroup.events").exists():
        raise CiliumError(f"{PRIVATE_CGROUP} is the host's root cgroup, not the node's subtree")
    if str(os.getpid()) not in (PRIVATE_CGROUP / "cgroup.procs").read_text().split():
        raise CiliumError(f"{PRIVATE_CGROUP} is not the node's cgroup {cgroup}")
    for sysctl in HOST_SYSCTLS:
        if Path(sysctl).exists():
            _bind_read_only(sysctl)
    container.apply_binds(list(binds), created if created is not None else [])


@dataclass(frozen=True)
class Dial:
    outcome: str
    payload: str | None
    detail: str


def dial(cgroup: Path, netns: str, address: str, port: int, *, timeout: float = 5.0) -> Dial:
    """One TCP connect from a process of the node (its cgroup and netns), as a pod there would dial."""
    argv = [sys.executable, "-m", "localcluster.cilium", "dial", "--cgroup", str(cgroup), "--netns", netns,
            "--timeout", str(timeout), address, str(port)]
    result = run(argv, timeout=timeout + 15.0)
    return Dial(**json.loads(result.stdout))


def _dial_here(address: str, port: int, timeout: float) -> Dial:
    from proxyshift.agent.behaviour import dial_tcp  # the agent's own probe: outcome and first line

    attempt = dial_tcp(address, port, timeout)
    return Dial(attempt.outcome, attempt.payload, attempt.detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localcluster.cilium", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    launch = sub.add_parser("confine", help="confine this process to the node and exec the command")
    probe = sub.add_parser("dial", help="one TCP dial from the node's cgroup and netns; prints JSON")
    for p in (launch, probe):
        p.add_argument("--cgroup", type=Path, required=True, help="the node's cgroup v2 directory")
        p.add_argument("--netns", required=True, help="the node's network namespace (under /run/netns)")
    probe.add_argument("--timeout", type=float, default=5.0)
    probe.add_argument("address")
    probe.add_argument("port", type=int)
    # The node simulator's part: a pod's volumes and its container's securityContext (as
    # localcluster.container applies them), for the `cilium` image.
    launch.add_argument("--bpffs", type=Path, help="the node's bpffs on the host (a bpffs mount point), bound "
                                                   "at the agent's --bpf-root so that its pins outlive it")
    launch.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:ro]")
    launch.add_argument("--created-log", type=Path,
                        help="append every host path created as a mount point to this file")
    launch.add_argument("--uid", type=int)
    launch.add_argument("--gid", type=int)
    launch.add_argument("--caps", help="exactly these capabilities, comma-separated; default: every one")
    launch.add_argument("--no-new-privs", action="store_true")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.what == "dial":
        join_node(args.cgroup, args.netns)
        print(json.dumps(asdict(_dial_here(args.address, args.port, args.timeout))))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    created: list[Path] = []
    try:
        confine(args.cgroup, args.netns, [container.parse_bind(spec) for spec in args.bind], created,
                bpffs=args.bpffs)
    except (OSError, ValueError, CiliumError) as exc:
        print(f"localcluster.cilium: not starting {command[0]}: {exc}", file=sys.stderr)
        return 1
    finally:
        # Mount points made outside the tmpfs over /run are the host's: `down` removes them.
        host_made = [path for path in created if not Path(os.path.realpath(path)).is_relative_to("/run")]
        if args.created_log is not None and host_made:
            with contextlib.suppress(OSError), args.created_log.open("a") as record:
                record.writelines(f"{path}\n" for path in host_made)
    if args.uid is not None or args.gid is not None or args.caps is not None or args.no_new_privs:
        command = [*container.setpriv_argv(args.uid, args.gid, args.caps, args.no_new_privs), *command]
        os.execvp(command[0], command)
    os.execv(command[0], command)
    return 127  # not reached: execv replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
