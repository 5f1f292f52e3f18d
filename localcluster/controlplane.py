"""Start, check and remove the local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

Every daemon runs as a plain host process on loopback (etcd, the controller
ports) or on the bridge address (the apiserver, which the node namespaces must
reach). `up_controlplane` returns only once the API answers /readyz and the
controllers have made the default ServiceAccounts and kube-root-ca.crt, so a
caller can create pods at once.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localcluster import build, network, paths, pki, state
from localcluster.paths import StateLayout
from proxyshift.commands import CommandError

ETCD_URL = f"http://127.0.0.1:{paths.ETCD_CLIENT_PORT}"
NODE_API_URL = f"https://{paths.BRIDGE_ADDRESS}:{paths.APISERVER_PORT}"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259

# What a DaemonSet rollout, projected SA tokens and the operator need; nothing
# that watches node health (node-lifecycle would taint and evict simulated nodes).
CONTROLLERS = (
    "daemonset-controller",
    "deployment-controller",
    "disruption-controller",  # PodDisruptionBudget status: evictions during a drain respect it
    "replicaset-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "job-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "validatingadmissionpolicy-status-controller",
)
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
START_TIMEOUT_SECONDS = 120.0
APISERVER_STOP_GRACE_SECONDS = 2.0
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


# The API server's audit policy. Secrets are logged at Metadata (who touched which secret; never the
# data), and every request of proxyshift's own service accounts too, so a test can both prove that the
# operator and agent never read a secret and see that their other requests do reach the log (without
# that positive control, an empty log would prove nothing). Everything else is not logged: the log
# stays small under the e2e load.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    resources:
      - group: ""
        resources: [secrets]
  - level: Metadata
    userGroups: ["system:serviceaccounts:proxyshift-system"]
  - level: None
"""
AUDIT_LOG_MAX_MB = 200


def audit_log_path(state_dir: Path) -> Path:
    """The API server's audit log (JSON lines, one event per line)."""
    return StateLayout(state_dir).logs / "audit.log"


def _audit_policy_path(layout: StateLayout) -> Path:
    return layout.root / "audit-policy.yaml"


class ControlPlaneError(RuntimeError):
    """A component did not start or did not become ready."""


@dataclass(frozen=True)
class ClusterInfo:
    """What a caller needs to talk to the cluster and to start nodes."""

    state_dir: Path
    kubeconfig: Path  # admin (system:masters), for host-side clients
    api_url: str  # the URL in `kubeconfig`
    node_api_url: str  # what pods and node simulators use (the bridge address)
    bin_dir: Path
    pki_dir: Path
    ca_cert: Path

    def to_json(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> ClusterInfo:
        return cls(state_dir=Path(data["state_dir"]), kubeconfig=Path(data["kubeconfig"]),
                   api_url=data["api_url"], node_api_url=data["node_api_url"],
                   bin_dir=Path(data["bin_dir"]), pki_dir=Path(data["pki_dir"]),
                   ca_cert=Path(data["ca_cert"]))


def daemon_env() -> dict[str, str]:
    """The environment for cluster daemons and tools: no proxy may see 198.18/15 traffic."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
    env.pop("KUBECONFIG", None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,198.18.0.0/15,198.19.0.0/16"
    return env


def _say(message: str) -> None:
    print(f"[localcluster] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- addresses

def can_bind(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def _apiserver_bind_address() -> str:
    """Bind the apiserver to the bridge address when the bridge exists, else to loopback.

    The node namespaces reach the API only through the bridge, so the node half's
    `network.ensure_bridge()` is called first. Without a bridge
    we bind loopback, never 0.0.0.0: the API must not be reachable from outside
    the machine. (A cluster without nodes works the same either way.)
    """
    try:
        network.ensure_bridge()
    except CommandError as exc:  # e.g. not root: a node-less control plane still works
        _say(f"cannot create the bridge ({exc})")
    if can_bind(paths.BRIDGE_ADDRESS, 0):
        return paths.BRIDGE_ADDRESS
    _say(f"bridge address {paths.BRIDGE_ADDRESS} is not on this host: binding the API to 127.0.0.1 "
         "(nodes in network namespaces will not reach it)")
    return "127.0.0.1"


def _check_ports_free(api_address: str) -> None:
    wanted = [("127.0.0.1", paths.ETCD_CLIENT_PORT), ("127.0.0.1", paths.ETCD_PEER_PORT),
              (api_address, paths.APISERVER_PORT), ("127.0.0.1", CONTROLLER_MANAGER_PORT),
              ("127.0.0.1", SCHEDULER_PORT)]
    busy = [f"{a}:{p}" for a, p in wanted if not can_bind(a, p)]
    if busy:
        raise ControlPlaneError(f"ports in use: {', '.join(busy)} (another local cluster? "
                                "`localcluster down`, or stop what holds them)")


# ---------------------------------------------------------------- HTTP probes

def _opener(context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # ProxyHandler({}) : urllib would otherwise honour *_proxy variables.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def admin_ssl_context(pki_dir: Path) -> ssl.SSLContext:
    files = pki.Pki(pki_dir)
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    context.load_cert_chain(str(files.client_cert("admin")), str(files.client_key("admin")))
    return context


def _loopback_context() -> ssl.SSLContext:
    # The controller-manager and scheduler serve self-signed certs on loopback;
    # /healthz there is a liveness probe, not a trust decision.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def http_get(url: str, context: ssl.SSLContext | None = None, timeout: float = 3.0) -> tuple[int, str]:
    """GET url; (status, body). Connection errors are status 0, so callers can poll."""
    try:
        with _opener(context).open(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return 0, str(exc)


def _tail(path: Path, lines: int = 8) -> str:
    """The log lines that explain a failure: klog errors/fatals (the reason is
    usually there, far above the shutdown noise), then the last few lines."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text if (line[:1] in ("E", "F") and line[1:5].isdigit()) or "Error:" in line]
    picked = [*errors[-10:], "...", *text[-lines:]] if errors else text[-lines:]
    return "\n".join(picked) + "\n"


def _wait(what: str, check: Callable[[], bool], state_dir: Path, component: str,
          timeout: float = START_TIMEOUT_SECONDS) -> None:
    """Poll `check` until true; fail fast with the log tail if the component died."""
    deadline = time.monotonic() + timeout
    record = next((r for r in state.read_state(state_dir)["processes"] if r["name"] == component), None)
    while time.monotonic() < deadline:
        if check():
            return
        if record is not None and not state.is_alive(record):
            log = StateLayout(state_dir).log(component)
            raise ControlPlaneError(f"{component} exited while waiting for {what}; {log}:\n{_tail(log)}")
        time.sleep(0.25)
    log = StateLayout(state_dir).log(component)
    raise ControlPlaneError(f"timed out after {timeout:g}s waiting for {what}; {log}:\n{_tail(log)}")


# ---------------------------------------------------------------- components

def _etcd_argv(bin_dir: Path, layout: StateLayout) -> list[str]:
    peer = f"http://127.0.0.1:{paths.ETCD_PEER_PORT}"
    return [
        str(bin_dir / "etcd"),
        "--name=proxyshift",
        f"--data-dir={layout.etcd}",
        f"--listen-client-urls={ETCD_URL}",
        f"--advertise-client-urls={ETCD_URL}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=proxyshift={peer}",
        # A throwaway test cluster: fsync costs seconds per write burst on slow
        # disks and buys durability we never use (down deletes the data).
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def _apiserver_argv(bin_dir: Path, files: pki.Pki, bind_address: str, layout: StateLayout) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers={ETCD_URL}",
        f"--bind-address={bind_address}",
        f"--secure-port={paths.APISERVER_PORT}",
        f"--advertise-address={paths.BRIDGE_ADDRESS}",
        f"--service-cluster-ip-range={paths.SERVICE_CIDR}",
        f"--tls-cert-file={files.apiserver_cert}",
        f"--tls-private-key-file={files.apiserver_key}",
        f"--client-ca-file={files.ca_cert}",
        "--authorization-mode=Node,RBAC",
        # On top of the default set (ValidatingAdmissionPolicy, ServiceAccount,
        # Priority, ... are on by default); NodeRestriction keeps simulated
        # nodes to their own objects as on a real cluster.
        "--enable-admission-plugins=NodeRestriction",
        # kube-proxy's DaemonSet is privileged, as kubeadm makes it.
        "--allow-privileged=true",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={files.sa_pub}",
        f"--service-account-signing-key-file={files.sa_key}",
        f"--api-audiences={SA_ISSUER}",
        "--service-account-extend-token-expiration=true",
        "--profiling=false",
        f"--audit-policy-file={_audit_policy_path(layout)}",
        f"--audit-log-path={audit_log_path(layout.root)}",
        "--audit-log-format=json",
        f"--audit-log-maxsize={AUDIT_LOG_MAX_MB}",
        "--audit-log-maxbackup=1",
        "--v=1",
    ]


def _controller_manager_argv(bin_dir: Path, layout: StateLayout, files: pki.Pki) -> list[str]:
    kubeconfig = layout.kubeconfig("kube-controller-manager")
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={CONTROLLER_MANAGER_PORT}",
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--root-ca-file={files.ca_cert}",
        f"--service-account-private-key-file={files.sa_key}",
        "--use-service-account-credentials=true",
        "--v=1",
    ]


def _scheduler_argv(bin_dir: Path, layout: StateLayout) -> list[str]:
    kubeconfig = layout.kubeconfig("kube-scheduler")
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={SCHEDULER_PORT}",
        "--leader-elect=false",
        "--v=1",
    ]


# ---------------------------------------------------------------- lifecycle

def load_info(state_dir: Path | None = None) -> ClusterInfo | None:
    """The ClusterInfo `up_controlplane` recorded, or None if no cluster was brought up."""
    data = state.read_state(state_dir or paths.default_state_dir())["info"].get("controlplane")
    return ClusterInfo.from_json(data) if data else None


def is_ready(info: ClusterInfo) -> bool:
    records = {r["name"]: r for r in state.read_state(info.state_dir)["processes"]}
    if not all(name in records and state.is_alive(records[name]) for name in CONTROL_PLANE):
        return False
    status, body = http_get(f"{info.api_url}/readyz", admin_ssl_context(info.pki_dir))
    return status == 200 and body.strip() == "ok"


def up_controlplane(state_dir: Path | None = None, *, bin_dir: Path | None = None) -> ClusterInfo:
    """Bring the control plane up (building binaries if needed) and wait until it serves.

    Idempotent: a healthy running control plane is returned as is; a broken or
    half-started one is torn down first.
    """
    state_dir = state_dir or paths.default_state_dir()
    with state.machine_lock():
        return _up_controlplane(state_dir, bin_dir)


def _up_controlplane(state_dir: Path, bin_dir: Path | None) -> ClusterInfo:
    existing = load_info(state_dir)
    if existing is not None and is_ready(existing):
        return existing
    if state.read_state(state_dir)["processes"] or state.read_state(state_dir)["paths"]:
        _say(f"cleaning a previous, not-ready cluster in {state_dir}")
        down(state_dir)

    bin_dir = bin_dir or build.build()
    started = time.monotonic()
    layout = StateLayout(state_dir)
    bind_address = _apiserver_bind_address()
    _check_ports_free(bind_address)
    api_url = f"https://{bind_address}:{paths.APISERVER_PORT}"

    # Recorded before creation: a crash anywhere below leaves nothing `down` misses.
    for path in (layout.pki, layout.etcd, layout.nodes, layout.logs, layout.pids, layout.admin_kubeconfig,
                 layout.kubeconfig("kube-controller-manager"), layout.kubeconfig("kube-scheduler"),
                 _audit_policy_path(layout)):
        state.record_path(state_dir, path)
    files = pki.ensure_pki(layout.pki)
    pki.write_kubeconfig(layout.admin_kubeconfig, api_url, layout.pki, "admin")
    for component in ("kube-controller-manager", "kube-scheduler"):
        pki.write_kubeconfig(layout.kubeconfig(component), api_url, layout.pki, component)
    layout.etcd.mkdir(mode=0o700, exist_ok=True)
    layout.nodes.mkdir(exist_ok=True)
    _audit_policy_path(layout).write_text(AUDIT_POLICY, encoding="utf-8")
    env = daemon_env()

    state.spawn(state_dir, "etcd", _etcd_argv(bin_dir, layout), env=env)
    _wait("etcd /health", lambda: '"health":"true"' in http_get(f"{ETCD_URL}/health")[1], state_dir, "etcd")

    # The apiserver lingers ~10 s after SIGTERM once it stopped listening; its
    # data is thrown away by `down`, so a short grace before SIGKILL is enough.
    state.spawn(state_dir, "kube-apiserver", _apiserver_argv(bin_dir, files, bind_address, layout), env=env,
                stop_grace=APISERVER_STOP_GRACE_SECONDS)
    context = admin_ssl_context(layout.pki)
    _wait("kube-apiserver /readyz", lambda: http_get(f"{api_url}/readyz", context)[0] == 200,
          state_dir, "kube-apiserver")

    state.spawn(state_dir, "kube-controller-manager", _controller_manager_argv(bin_dir, layout, files), env=env)
    state.spawn(state_dir, "kube-scheduler", _scheduler_argv(bin_dir, layout), env=env)
    loopback = _loopback_context()
    for component, port in (("kube-controller-manager", CONTROLLER_MANAGER_PORT),
                            ("kube-scheduler", SCHEDULER_PORT)):
        url = f"https://127.0.0.1:{port}/healthz"
        # mypy cannot type a lambda whose default binds the loop variable (python/mypy#15459).
        _wait(f"{component} /healthz", lambda url=url: http_get(url, loopback)[0] == 200,  # type: ignore[misc]
              state_dir, component)

    # Pods can be created only once their namespace has its ServiceAccount, and
    # projected tokens mount kube-root-ca.crt: wait for the controllers' work.
    for namespace in ("default", "kube-system"):
        for kind, name in (("serviceaccounts", "default"), ("configmaps", "kube-root-ca.crt")):
            url = f"{api_url}/api/v1/namespaces/{namespace}/{kind}/{name}"
            # mypy cannot type a lambda whose default binds the loop variable (python/mypy#15459).
            _wait(f"{namespace}/{kind}/{name}", lambda url=url: http_get(url, context)[0] == 200,  # type: ignore[misc]
                  state_dir, "kube-controller-manager")

    info = ClusterInfo(state_dir=state_dir, kubeconfig=layout.admin_kubeconfig, api_url=api_url,
                       node_api_url=NODE_API_URL if bind_address == paths.BRIDGE_ADDRESS else api_url,
                       bin_dir=bin_dir, pki_dir=layout.pki, ca_cert=files.ca_cert)
    with state.locked_state(state_dir) as current:
        current["info"]["controlplane"] = info.to_json()
    _say(f"control plane ready in {time.monotonic() - started:.1f}s at {api_url}")
    return info


def node_kubeconfig(info: ClusterInfo, node: str) -> Path:
    """A kubeconfig with the node's own identity (system:node:<node>, group system:nodes).

    For a node simulator that should be held to what a kubelet may do (the Node
    authorizer and NodeRestriction admission are on). It points at the bridge
    address, as a kubelet in the node's namespace would. Written to
    <state>/nodes/<node>/kubelet.kubeconfig, removed by `down` with nodes/.
    """
    layout = StateLayout(info.state_dir)
    state.record_path(info.state_dir, layout.nodes)
    target = layout.nodes / node / "kubelet.kubeconfig"
    target.parent.mkdir(parents=True, exist_ok=True)
    name = f"node-{node}"
    pki.issue_client_cert(info.pki_dir, name, f"system:node:{node}", ("system:nodes",))
    return pki.write_kubeconfig(target, info.node_api_url, info.pki_dir, name)


def down(state_dir: Path | None = None) -> list[str]:
    """Remove everything the cluster made: nodes (via the node half), processes, files.

    Idempotent and safe on a half-started cluster: it works from what state.json
    and the pid files recorded. Returns the names of the processes it stopped.
    """
    state_dir = state_dir or paths.default_state_dir()
    with state.machine_lock():
        return _down(state_dir)


def _down(state_dir: Path) -> list[str]:
    node_error: Exception | None = None
    try:
        network.remove_all(state_dir)
    except Exception as exc:  # the control plane must go even if the nodes did not
        node_error = exc
    stopped = state.stop_all(state_dir)
    state.remove_paths(state_dir)
    if node_error is not None:
        raise ControlPlaneError(f"control plane removed, but removing the nodes failed: {node_error}") \
            from node_error
    return stopped


def status(state_dir: Path | None = None) -> dict[str, Any]:
    """What runs and whether the API is ready: the data behind `localcluster status`."""
    state_dir = state_dir or paths.default_state_dir()
    info = load_info(state_dir)
    recorded = state.read_state(state_dir)
    report: dict[str, Any] = {
        "state_dir": str(state_dir),
        "processes": [{"name": r["name"], "pid": r["pid"], "alive": r["alive"], "log": r.get("log"),
                       "rss_mib": state.rss_mib(r["pid"]) if r["alive"] else None}
                      for r in state.running(state_dir)],
        "paths": [{"path": p, "exists": Path(p).exists()} for p in recorded["paths"]],
        "info": info.to_json() if info else None,
        "ready": bool(info and is_ready(info)),
    }
    report["nodes"] = network.status(state_dir)
    return report

