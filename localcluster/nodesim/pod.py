"""One pod on the simulated node: its worker thread runs the containers, volumes, probes and status."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from localcluster import cilium, gotools, security_context
from localcluster.container import NETNS_DIR
from localcluster.kubeapi import Kube, KubeError, now_rfc3339
from localcluster.nodesim import volumes
from localcluster.nodesim.config import SimConfig
from localcluster.nodesim.containers import ContainerRun, stop_processes
from localcluster.nodesim.podspec import (
    CILIUM_COMMAND,
    CILIUM_IMAGE,
    KUBE_PROXY_IMAGE,
    PAUSE_ARGV,
    PAUSE_IMAGE,
    PROXYSHIFT_IMAGE,
    PYTHON_IMAGE_KINDS,
    TESTBED_IMAGE,
    PodError,
    expand,
    field_value,
    hidden_by,
    image_kind,
    image_paths,
    python_path,
)
from localcluster.nodesim.probes import ProbeState, probe_once, scaled_probes
from localcluster.nodesim.volumes import PodVolumes

log = logging.getLogger("proxyshift.nodesim")

STATUS_TIMEOUT = 5.0
BACKOFF_RESET_SECONDS = 600.0
TICK_SECONDS = 0.5
RETRY_SECONDS = 2.0
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
_warned: set[str] = set()  # nodes whose containers run outside a node cgroup (logged once)


class PodHost(Protocol):
    """What a pod worker needs from its simulator: config, the API, the node's other pods, the
    probe thread, and the start lock that shutdown takes so nothing starts while it stops."""

    cfg: SimConfig
    kube: Kube
    workers: dict[str, PodWorker]
    start_lock: threading.Lock
    stopping: bool
    probe_pool: concurrent.futures.ThreadPoolExecutor

    def ca_pem(self) -> str: ...

    def note_created(self, path: Path) -> None: ...


class PodWorker(threading.Thread):
    """Owns one pod's processes, volumes, probes and status, from first sight to finalisation."""

    def __init__(self, sim: PodHost, pod: dict[str, Any]) -> None:
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
        self.runs = [ContainerRun(scaled_probes(c, self.cfg.probe_time_scale), restart_count=previous.get(c["name"], 0))
                     for c in spec["containers"]]
        self.start_time = (pod.get("status") or {}).get("startTime") or now_rfc3339()
        # hostNetwork pods run in the node's namespace; the others in the node's one pod namespace.
        self.host_network = bool(spec.get("hostNetwork")) or not self.cfg.pod_netns
        self.netns = self.cfg.node if self.host_network else self.cfg.pod_netns
        self.pod_ip = self.cfg.node_ip if self.host_network else self.cfg.pod_ip
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_status: dict[str, Any] | None = None
        self.volumes = PodVolumes(sim, self.dir, self.namespace, self.pod_name, self.uid, self.cfg.node_ip,
                                  self.pod_ip, self._token_owner, self.cfg.node_dir)
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
        return self.volumes.complete(self.pod)

    def _sync_volumes(self) -> None:
        self.volumes.sync(self.pod)

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
                    f"{PROXYSHIFT_IMAGE}:*, {TESTBED_IMAGE}:*, {CILIUM_IMAGE}:* and {PAUSE_IMAGE}:*)"),
                    transient=False)
                return

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
        kind = image_kind(container["image"])
        if kind in PYTHON_IMAGE_KINDS:
            env["PYTHONPATH"] = python_path(kind)
            env["PYTHONUNBUFFERED"] = "1"
        if kind == "cilium":
            # The agent compiles its datapath with `clang` from PATH: clang-19, as Cilium's image has.
            env["PATH"] = f"{cilium.LLVM_BIN}:{env['PATH']}"
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
        if kind == "cilium":
            return self._cilium_argv(command, args)
        program, module, image = (("localcluster", "localcluster.cli", TESTBED_IMAGE) if kind == "localcluster"
                                  else ("proxyshift", "proxyshift.cli", PROXYSHIFT_IMAGE))
        command = command or [program]
        if Path(command[0]).name == program:
            rest = command[1:]
        elif Path(command[0]).name.startswith("python") and command[1:3] == ["-m", module]:
            rest = command[3:]
        else:
            raise PodError("RunContainerError", f"the simulator runs only the {program} CLI from "
                                                f"{image}, not {command[0]!r}")
        return [sys.executable, "-m", module, *rest, *args]

    def _cilium_argv(self, command: list[str], args: list[str]) -> list[str]:
        """The pinned agent with the pod's args, then what Cilium's image would hold: its datapath
        sources (`--lib-dir`) and the bpffs and cgroup2 mounts the confined launcher makes."""
        command = command or [CILIUM_COMMAND]
        if Path(command[0]).name != CILIUM_COMMAND:
            raise PodError("RunContainerError", f"the simulator runs only {CILIUM_COMMAND} from {CILIUM_IMAGE}, "
                                                f"not {command[0]!r}")
        binary = gotools.built(cilium.AGENT_TOOL)
        if binary is None:
            raise PodError("RunContainerError", gotools.build_hint(cilium.AGENT_TOOL))
        if not (cilium.LLVM_BIN / "clang").is_file():
            raise PodError("RunContainerError", f"no clang at {cilium.LLVM_BIN}: install clang-19 "
                                                "(hack/install-deps.sh does)")
        try:
            lib_dir = cilium.prepare_lib_dir(self.cfg.node_dir / "cilium" / "lib")
        except cilium.CiliumError as exc:
            raise PodError("RunContainerError", str(exc)) from exc
        return [str(binary), *command[1:], *args, *cilium.image_flags(lib_dir)]

    def confinement(self, container: dict[str, Any]) -> security_context.Confinement:
        try:
            return security_context.confinement(self.pod["spec"], container, image_kind(container.get("image", "")))
        except security_context.SecurityContextError as exc:
            raise PodError("CreateContainerConfigError", str(exc)) from exc

    def _token_owner(self, pod: dict[str, Any]) -> int | None:
        """The uid a projected token is handed to: like the kubelet, the one non-root runAsUser every
        container shares when no fsGroup is set (the file stays 0600)."""
        if (pod["spec"].get("securityContext") or {}).get("fsGroup") is not None:
            return None
        uids = set()
        for container in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
            with contextlib.suppress(PodError):
                uids.add(self.confinement(container).uid)
        return uids.pop() if len(uids) == 1 and 0 not in uids else None

    def _binds(self, container: dict[str, Any], read_only_root: bool = False) -> list[str]:
        binds = []
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in self.volumes.paths:
                raise PodError("CreateContainerConfigError", f"volumeMount {mount['name']} has no volume")
            source = self.volumes.paths[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            if source == Path(mount["mountPath"]) and not (read_only_root and not mount.get("readOnly")):
                # A hostPath at its own path: the container already sees the host's file system (under a
                # read-only root a writable one is bound onto itself, so that it stays writable).
                continue
            binds.append(f"{source}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else ""))
        if image_kind(container.get("image", "")) in PYTHON_IMAGE_KINDS:
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
        if image_kind(container.get("image", "")) == "cilium":
            launcher = self._cilium_launcher(confinement)
        else:
            launcher = [sys.executable, "-m", "localcluster.container", "--netns", self.netns,
                        "--created-log", str(self.cfg.created_paths_file),
                        "--workdir", container.get("workingDir") or "/", *confinement.launcher_args()]
            cgroup = self._node_cgroup()
            if cgroup is not None:
                launcher += ["--cgroup", str(cgroup)]
        for bind in self._binds(container, confinement.read_only_root):
            launcher += ["--bind", bind]
        if confinement.uid != 0 and image_kind(container.get("image", "")) in (*PYTHON_IMAGE_KINDS, "pause"):
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

    def _node_cgroup(self) -> Path | None:
        """The node's cgroup v2 subtree, where every container of the node runs (None: no cgroup v2 here).

        A node's Cilium agent takes it for its cgroup root: its socket-LB translates the connects of
        every process below, as on a real node where everything is below the root cgroup it attaches
        to. So the node's kube-proxy, proxyshift agent and pods are in it, whether Cilium runs or not.
        """
        try:
            return cilium.make_cgroup(self.cfg.node, exist_ok=True)
        except (OSError, cilium.CiliumError) as exc:
            if not _warned:  # once per simulator process (one node each)
                log.warning("containers of %s run outside a node cgroup: %s", self.cfg.node, exc)
                _warned.add(self.cfg.node)
            return None

    def _cilium_launcher(self, confinement: security_context.Confinement) -> list[str]:
        """localcluster.cilium's launcher: the node's cgroup subtree and netns, a private mount ns with
        the node's bpffs and its own cgroup2 root (nothing of the agent reaches the host's root cgroup,
        netns or /sys/fs/bpf)."""
        if not self.host_network:
            raise PodError("CreateContainerConfigError", f"the {CILIUM_IMAGE} image runs here only with "
                                                         "hostNetwork: true, as Cilium's DaemonSet has it")
        if confinement.read_only_root:
            raise PodError("CreateContainerConfigError", f"readOnlyRootFilesystem is not supported for {CILIUM_IMAGE}")
        try:
            cgroup = cilium.make_cgroup(self.cfg.node, exist_ok=True)
        except (OSError, cilium.CiliumError) as exc:
            raise PodError("RunContainerError", f"the node's cgroup for Cilium: {exc}") from exc
        try:
            # The node's BPF filesystem (its hostPath /sys/fs/bpf), as Cilium's chart mounts the host's:
            # what the agent pins there outlives it, as on a real node.
            bpffs = volumes.node_bpffs(self.cfg.node_dir)
        except (OSError, cilium.CiliumError) as exc:
            raise PodError("RunContainerError", f"the node's bpffs for Cilium: {exc}") from exc
        args = ["--bpffs", str(bpffs), "--uid", str(confinement.uid), "--gid", str(confinement.gid)]
        if confinement.capabilities is not None:
            args += ["--caps", ",".join(sorted(confinement.capabilities))]
        if confinement.no_new_privs:
            args.append("--no-new-privs")
        return [sys.executable, "-m", "localcluster.cilium", "confine", "--cgroup", str(cgroup),
                "--netns", self.netns, "--created-log", str(self.cfg.created_paths_file), *args]

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
            stop_processes([run.proc], grace)
            self._exited(run, run.proc.returncode if run.proc.returncode is not None else 137)

    # --- termination -------------------------------------------------------------

    def _stop_all(self, grace: float) -> None:
        procs = [r.proc for r in self.init_runs + self.runs if r.proc is not None]
        stop_processes(procs, grace)
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
