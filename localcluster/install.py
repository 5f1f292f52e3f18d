"""Install proxyshift into a cluster and run its operator as a local process.

Used by `make demo` and by the e2e suite. The CRDs, RBAC, admission policies
and the agent DaemonSet come from `crds/` and `config/` exactly as a user
applies them; the agent pods are run by the node simulator. The operator runs
as a process on the host (so tests can kill -9 it and start another), logging
to the cluster's state directory, confined as its Deployment
(config/manager/deployment.yaml) confines it: the same launcher and
securityContext rules the node simulator applies to containers.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from localcluster import paths
from localcluster.nodesim.podspec import image_paths
from localcluster.security_context import Confinement, confinement
from proxyshift.commands import run, stop_child

AGENT_NAMESPACE = "proxyshift-system"
AGENT_DAEMONSET = "proxyshift-agent"
CRDS = ("proxypolicies.proxyshift.io", "proxynodes.proxyshift.io")
CRD_ESTABLISHED_SECONDS = 60.0
# Applied in this order: CRDs must be established before anything refers to them.
INSTALL_STEPS: tuple[tuple[str, list[str]], ...] = (
    ("CRDs", ["-k", "config/crd"]),
    ("RBAC", ["-k", "config/rbac"]),
    ("admission policies", ["-k", "config/admission"]),
    ("agent DaemonSet", ["-k", "config/agent"]),
)


def _say(message: str) -> None:
    print(f"[proxyshift] {message}", flush=True)


def kubectl(bin_dir: Path | None, kubeconfig: Path, *args: str, timeout: float = 120, check: bool = True,
            input: str | None = None) -> str:
    """The local cluster's own kubectl, or (bin_dir None: an external cluster such as kind) the one on PATH."""
    argv = [str(bin_dir / "kubectl") if bin_dir else "kubectl", "--kubeconfig", str(kubeconfig), *args]
    return run(argv, timeout=timeout, check=check, input=input).stdout


def _wait_established(bin_dir: Path | None, kubeconfig: Path, crds: tuple[str, ...],
                      timeout: float = CRD_ESTABLISHED_SECONDS) -> None:
    """Until every CRD says Established. Not `kubectl wait --for=condition=Established`, nor a jsonpath filter
    on the conditions: on a CRD the API server has not yet given a status both exit 1 at once
    (".status.conditions accessor error: <nil>", "<nil> is not array or slice")."""
    deadline = time.monotonic() + timeout
    waiting = list(crds)
    while waiting:
        waiting = [crd for crd in waiting if not _established(kubectl(bin_dir, kubeconfig, "get", f"crd/{crd}",
                                                                      "-o", "json"))]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"CRDs not Established within {timeout:g}s: {', '.join(waiting)}")
        if waiting:
            time.sleep(0.2)


def _established(crd_json: str) -> bool:
    conditions = (json.loads(crd_json).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def install(bin_dir: Path | None, kubeconfig: Path, *, agents: bool = True) -> None:
    """Apply proxyshift's manifests (idempotent) and wait until the agents run on every node."""
    root = paths.repo_root()
    for what, target in INSTALL_STEPS:
        if what == "agent DaemonSet" and not agents:
            continue
        _say(f"applying {what}")
        kubectl(bin_dir, kubeconfig, "apply", "--server-side", "--force-conflicts",
                "--field-manager=proxyshift-install", *[str(root / t) if t.startswith("config") else t for t in target])
        if what == "CRDs":
            _wait_established(bin_dir, kubeconfig, CRDS)
    if agents:
        _say("waiting for the agent DaemonSet to be ready on every node")
        kubectl(bin_dir, kubeconfig, "-n", AGENT_NAMESPACE, "rollout", "status",
                f"daemonset/{AGENT_DAEMONSET}", "--timeout=180s", timeout=200)


OPERATOR_DEPLOYMENT = "config/manager/deployment.yaml"
OPERATOR_CONTAINER = "operator"
# kubeconfig fields that name a credential file, or embed it as `<field>-data`, which the kubernetes client
# writes to a temporary file at login: with a read-only root that write fails. The operator's copy holds
# every one as a file of its own folder (as a pod's mounts are), embedded or named.
_CREDENTIALS = {"clusters": ("cluster", ("certificate-authority",)),
                "users": ("user", ("client-certificate", "client-key", "tokenFile"))}


def operator_confinement() -> Confinement:
    """What the operator container's securityContext (pod and container) grants, read from its Deployment."""
    with (paths.repo_root() / OPERATOR_DEPLOYMENT).open() as fh:
        deployment = next(d for d in yaml.safe_load_all(fh) if d and d.get("kind") == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == OPERATOR_CONTAINER)
    return confinement(pod, container, "proxyshift")


def credentials_for(kubeconfig: Path, uid: int, gid: int) -> Path:
    """A folder the operator's user can read holding `kubeconfig` and every credential it names or embeds.

    The original and its files may sit in folders only root can enter (a test's scratch folder, the
    cluster's PKI); the copy is the only thing the confined operator reads besides its image, as a pod
    reads only its mounts."""
    folder = Path(tempfile.mkdtemp(prefix="ps-operator-credentials-"))
    config: dict[str, Any] = yaml.safe_load(kubeconfig.read_text()) or {}
    for section, (inner, fields) in _CREDENTIALS.items():
        for index, entry in enumerate(config.get(section) or []):
            body = entry.get(inner) or {}
            for name in fields:
                data, named = body.pop(f"{name}-data", None), body.get(name)
                if data is None and named is None:
                    continue
                path = folder / f"{section}-{index}-{name}"
                if data is not None:
                    path.write_bytes(base64.b64decode(data))
                else:
                    # A relative path is relative to the kubeconfig's folder, as kubectl reads it.
                    path.write_bytes((kubeconfig.parent / str(named)).read_bytes())
                body[name] = str(path)
    copy = folder / "kubeconfig"
    copy.write_text(yaml.safe_dump(config))
    for path in folder.iterdir():
        os.chown(path, uid, gid)
        path.chmod(0o400)
    os.chown(folder, uid, gid)
    folder.chmod(0o500)
    return copy


@dataclass
class OperatorProcess:
    """`proxyshift operator` as a child process; kill it (-9 included) and start another at will.

    Confined (the default) as config/manager/deployment.yaml confines the container: its user, no
    capabilities, no privilege escalation, a read-only root, through localcluster.container, which execs,
    so `proc.pid` is the operator's own pid. Its kubeconfig is copied to a folder that user can read."""

    kubeconfig: Path
    log_path: Path
    metrics_port: int = 18080
    health_port: int = 18081
    extra_env: dict[str, str] = field(default_factory=dict)
    confined: bool = True
    proc: subprocess.Popen[bytes] | None = None
    _credentials: Path | None = None

    def start(self) -> OperatorProcess:
        if self.running:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        kubeconfig, launcher = self.kubeconfig, []
        if self.confined:
            limits = operator_confinement()
            self._forget_credentials()
            kubeconfig = credentials_for(self.kubeconfig, limits.uid, limits.gid)
            self._credentials = kubeconfig.parent
            launcher = [sys.executable, "-m", "localcluster.container", *limits.launcher_args()]
            for path in image_paths():
                launcher += ["--expose", path]
            launcher.append("--")
        argv = [*launcher, sys.executable, "-m", "proxyshift.cli", "operator", "--standalone",
                "--kubeconfig", str(kubeconfig), "--metrics-port", str(self.metrics_port),
                "--liveness", f"http://127.0.0.1:{self.health_port}/healthz"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,  # noqa: S603
                                         start_new_session=True)
        return self

    def _forget_credentials(self) -> None:
        if self._credentials is not None:
            shutil.rmtree(self._credentials, ignore_errors=True)
            self._credentials = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        stop_child(self.proc, sig=sig)
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self._forget_credentials()

    def wait_healthy(self, timeout: float = 60) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"operator exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"operator not healthy after {timeout:g}s; see {self.log_path}")
