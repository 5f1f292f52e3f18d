"""Shared fixtures: the session's cluster and helpers to act inside its nodes.

The cluster is the local one (`localcluster up --pools blue=2,green=1`: three
network-namespace nodes, real control plane and kube-proxy), started once per
session and torn down at the end even when tests fail. With
PROXYSHIFT_EXTERNAL_CLUSTER=1 and KUBECONFIG set, the tests use that cluster
instead (e.g. kind) and nothing is started or stopped; the tests that need the
local nodes' namespaces are then skipped, each with that reason.

Nothing here skips silently: a missing requirement of the local cluster (root,
iproute2, iptables, nft) fails the test that asked for it, with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxyshift.commands import Result, run
from tests.support.polling import wait_until

E2E_POOLS = "blue=2,green=1"
UP_TIMEOUT_SECONDS = 3 * 3600  # the first `up` may build Kubernetes from source


@dataclass
class Cluster:
    kubeconfig: Path
    external: bool
    state_dir: Path | None = None
    bin_dir: Path | None = None
    nodes: list[str] = field(default_factory=list)
    up_seconds: float = 0.0
    before: dict[str, Any] | None = None  # host_snapshot() taken before `up`
    is_down: bool = False

    def down(self) -> subprocess.CompletedProcess[str]:
        """`localcluster down` (idempotent); the session teardown then has nothing left to do."""
        state_dir = self.require_local("down")
        result = localcluster_cli("down", state_dir=state_dir, timeout=300)
        self.is_down = result.returncode == 0
        return result

    def kubectl(self, *args: str, timeout: float = 120.0, check: bool = True, input: str | None = None) -> Result:
        kubectl = str(self.bin_dir / "kubectl") if self.bin_dir and (self.bin_dir / "kubectl").exists() \
            else "kubectl"
        return run([kubectl, "--kubeconfig", str(self.kubeconfig), *args], timeout=timeout, check=check,
                   input=input)

    def require_local(self, what: str) -> Path:
        # An explicit, reasoned skip (listed by -ra), only for a deliberately external cluster: kind's
        # nodes are containers this process cannot enter. On the local cluster nothing is skipped.
        if self.external or self.state_dir is None:
            pytest.skip(f"{what} needs the local cluster's network-namespace nodes; this run uses the "
                        f"external cluster in {self.kubeconfig} (PROXYSHIFT_EXTERNAL_CLUSTER=1)")
        return self.state_dir


def localcluster_cli(*args: str, state_dir: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `localcluster <args>` as a user would (a subprocess, so a crash in it cannot take pytest down)."""
    return subprocess.run([sys.executable, "-m", "localcluster.cli", "--state-dir", str(state_dir),
                           *args], capture_output=True, text=True, timeout=timeout, check=False)


def network_leftovers() -> list[str]:
    """Node or endpoint namespaces that exist before this session started a cluster."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines()
            if line.startswith(("ps-node-", "ps-ep-"))]


def _listening(port: int) -> bool:
    """Whether a local socket listens on the port (read from the kernel: a connect() to the
    bridge address would leave the machine when the bridge does not exist)."""
    out = run(["ss", "-ltnH"]).stdout
    return any(line.split()[3].rsplit(":", 1)[-1] == str(port) for line in out.splitlines() if len(line.split()) > 3)


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the local cluster needs root (network namespaces, veths, iptables inside nodes); "
                    "run the e2e tests as root, or set PROXYSHIFT_EXTERNAL_CLUSTER=1 and KUBECONFIG")
    for tool in ("ip", "iptables", "nft"):
        if shutil.which(tool) is None:
            pytest.fail(f"the local cluster needs {tool!r} on PATH (`make deps` installs it)")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("PROXYSHIFT_EXTERNAL_CLUSTER") == "1"
    if external:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            pytest.fail("PROXYSHIFT_EXTERNAL_CLUSTER=1 needs KUBECONFIG pointing at the cluster")
        yield Cluster(kubeconfig=Path(kubeconfig), external=True)
        return
    _require_root()
    from localcluster import controlplane, paths

    state_dir = paths.default_state_dir()
    if controlplane.load_info(state_dir) is not None:
        # A cluster left by a killed session (or by hand) would carry its changes into this
        # run; the tests are written against a fresh one.
        print(f"\nremoving the cluster left in {state_dir} before starting a fresh one", file=sys.stderr)
        localcluster_cli("down", state_dir=state_dir, timeout=300)
    busy = [port for port in (paths.ETCD_CLIENT_PORT, paths.APISERVER_PORT) if _listening(port)]
    if busy or network_leftovers():
        # Addresses and ports are machine-wide: `down` here would tear down someone else's cluster.
        pytest.fail(f"another local cluster runs on this machine (ports in use: {busy}, node/endpoint "
                    f"namespaces: {network_leftovers()}); take it down with `localcluster --state-dir "
                    f"<its dir> down` first")
    before = _host_snapshot(state_dir)
    started = time.monotonic()
    handle = Cluster(kubeconfig=state_dir / "admin.kubeconfig", external=False, state_dir=state_dir,
                     before=before)
    try:
        result = localcluster_cli("up", "--pools", E2E_POOLS, state_dir=state_dir, timeout=UP_TIMEOUT_SECONDS)
        if result.returncode != 0:
            pytest.fail(f"`localcluster up` failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        info = controlplane.load_info(state_dir)
        assert info is not None, f"`localcluster up` left no cluster info in {state_dir}"
        from localcluster import network

        handle.kubeconfig, handle.bin_dir = info.kubeconfig, info.bin_dir
        handle.nodes = [network.node_name(i) for i in range(1, 4)]
        handle.up_seconds = time.monotonic() - started
        print(f"\nlocal cluster up in {handle.up_seconds:.1f}s", file=sys.stderr)
        yield handle
    finally:
        if not handle.is_down:
            down = handle.down()
            if down.returncode != 0:
                print(f"`localcluster down` failed (exit {down.returncode}):\n{down.stderr[-4000:]}",
                      file=sys.stderr)


# --- what the cluster leaves on the host -------------------------------------------

OUR_MODULES = ("localcluster.nodesim", "localcluster.listener",
               "localcluster.container")


def _our_processes(state_dir: Path) -> list[str]:
    """Live processes of the cluster in `state_dir`: daemons whose arguments name the state dir,
    the node half's Python modules, and containers started for ps-node-* (kube-proxy's
    --hostname-override). Other engineers' clusters on the same machine use other state dirs."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(state_dir) in cmdline or any(m in cmdline for m in OUR_MODULES) or "ps-node-" in cmdline:
            found.append(f"{proc.name} {cmdline[:160]}")
    return sorted(found)


def _host_snapshot(state_dir: Path) -> dict[str, Any]:
    netns = run(["ip", "netns", "list"]).stdout.split("\n")
    links = run(["ip", "-o", "link", "show"]).stdout.splitlines()
    return {
        # Only ours: other engineers' tests make ps-test-* namespaces and their own links meanwhile.
        "namespaces": sorted(n.split()[0] for n in netns if n.startswith(("ps-node-", "ps-ep-"))),
        "interfaces": sorted(name for name in (line.split(":", 2)[1].strip().split("@")[0] for line in links)
                             if name == "psbr0" or (name[:3] in ("psn", "pse") and name[3:].isdigit())
                             or (name.startswith("pstap") and name[5:].isdigit())),  # a QEMU guest's tap
        "routes": [line for line in run(["ip", "route", "show", "table", "all"]).stdout.splitlines()
                   if "198.18." in line or "198.19." in line],
        "processes": _our_processes(state_dir),
        "mounts": [line for line in Path("/proc/mounts").read_text().splitlines()
                   if str(state_dir) in line or "/run/netns/ps-node-" in line or "/run/netns/ps-ep-" in line],
        # Mount points the containers needed on the host (the simulator notes and `down` removes them).
        "host_paths": [p for p in ("/var/lib/kube-proxy", "/run/secrets/kubernetes.io", "/run/secrets")
                       if Path(p).exists()],
    }


@pytest.fixture(scope="session")
def host_snapshot() -> Callable[[Path], dict[str, Any]]:
    """host_snapshot(state_dir) -> our namespaces, interfaces, processes, mounts, host mount points."""
    return _host_snapshot


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "localcluster_down: takes the session's local cluster down; runs last")
    config.addinivalue_line("markers", "needs_free_ports: starts its own control plane on the standard ports; "
                                       "runs first, before the session's cluster exists")


# Every test belongs to one layer, so that `-m <layer>` runs it: an unmarked test would run only in a
# whole `make test` and be left out of every layer's own run.
LAYERS = ("unit", "dataplane", "e2e", "reliability", "vm", "vm_guest")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test is refused in every run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = sorted(item.nodeid for item in items if not any(item.get_closest_marker(m) for m in LAYERS))
    if unmarked:
        raise pytest.UsageError(f"{len(unmarked)} test(s) without a layer marker ({', '.join(LAYERS)}): "
                                + ", ".join(unmarked[:10]))
    # The `down` test must see every other test finish first, whatever the file order.
    last = [item for item in items if item.get_closest_marker("localcluster_down")]
    # Tests that need the control-plane ports run before the session cluster takes them (in CI the
    # ports are otherwise free, so such a test never skips there).
    first = [item for item in items if item.get_closest_marker("needs_free_ports")]
    items[:] = first + [item for item in items if item not in last and item not in first] + last


@pytest.fixture(scope="session")
def kubeconfig(cluster: Cluster) -> Path:
    return cluster.kubeconfig


@pytest.fixture(scope="session")
def api_client(cluster: Cluster) -> Any:
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Any:
    """A raw-JSON client (localcluster.kubeapi.Kube): dicts in, dicts out."""
    from localcluster.kubeapi import Kube

    return Kube(cluster.kubeconfig, pool_size=16)


@pytest.fixture(scope="session")
def node_exec(cluster: Cluster) -> Callable[..., Result]:
    """node_exec(node, argv, timeout=30, check=True, input=None) -> Result: run a command inside a node."""

    def node_exec(node: str, argv: list[str], *, timeout: float = 30.0, check: bool = True,
                  input: str | None = None) -> Result:
        cluster.require_local("node_exec")
        return run(argv, netns=node, timeout=timeout, check=check, input=input)

    return node_exec


@pytest.fixture(scope="session")
def tcp_probe(cluster: Cluster) -> Callable[..., Any]:
    """tcp_probe(node, ip, port, count=10, timeout=2.0) -> ProbeResult(ok, failed, served_by, errors)."""
    from localcluster import workloads

    def tcp_probe(node: str, ip: str, port: int, count: int = 10, *, timeout: float = 2.0) -> Any:
        cluster.require_local("tcp_probe")
        return workloads.tcp_probe(node, ip, port, count, timeout=timeout)

    return tcp_probe


@pytest.fixture(scope="session")
def node_http_get(cluster: Cluster) -> Callable[..., tuple[int, str]]:
    """node_http_get(node, url) -> (status, body), from inside the node (e.g. kube-proxy's /proxyMode)."""
    from localcluster import workloads

    def node_http_get(node: str, url: str, *, timeout: float = 3.0) -> tuple[int, str]:
        cluster.require_local("node_http_get")
        return workloads.http_get(node, url, timeout=timeout)

    return node_http_get


@pytest.fixture
def continuous_prober(cluster: Cluster) -> Iterator[Callable[..., Any]]:
    """continuous_prober(node, ip, port, interval=0.05) -> a started ContinuousProber; stopped at teardown.

    Call .stop() for the ProbeResult; .failures lists (timestamp, error) for every failed connection.
    """
    from localcluster import workloads

    probers: list[workloads.ContinuousProber] = []

    def start(node: str, ip: str, port: int, *, interval: float = 0.05, timeout: float = 1.0) -> Any:
        cluster.require_local("continuous_prober")
        prober = workloads.ContinuousProber(node, ip, port, interval=interval, timeout=timeout).start()
        probers.append(prober)
        return prober

    yield start
    for prober in probers:
        prober.stop()


@pytest.fixture(scope="session")
def test_service(cluster: Cluster, kube: Any) -> Any:
    """One Service (ClusterIP, port 80) whose EndpointSlice lists two real listeners, ps-ep-1 and ps-ep-2."""
    from localcluster import workloads

    state_dir = cluster.require_local("test_service")
    endpoints = workloads.create_endpoints(state_dir, 2)
    (service,) = workloads.create_services(kube, endpoints, 1, prefix="ps-e2e")
    return service


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., Any]:
    """wait_for(predicate, timeout, what, interval=0.5): poll until truthy, else fail naming `what`."""
    return wait_until
