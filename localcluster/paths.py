"""Where the local cluster keeps things: the one place paths and addresses are spelled.

docs/architecture.md ("Local cluster contracts") is the specification; every
other localcluster module (and the node half) asks this module instead of
repeating a literal, so the contract can only drift in one file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Addresses from the RFC 2544 benchmarking range: nothing outside routes them.
BRIDGE_NAME = "psbr0"
BRIDGE_ADDRESS = "198.18.0.1"
BRIDGE_PREFIX = 16
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"
CLUSTER_CIDR = "198.18.0.0/15"
# kube-proxy's clusterCIDR: every client address of this cluster (nodes, endpoints, pods, second node
# addresses: the bridge's /16), never the Service CIDR. In ipvs mode a node's own connection to a
# ClusterIP leaves with that ClusterIP as its source (every VIP is bound on kube-ipvs0) and is
# masqueraded only when the source is outside clusterCIDR (pkg/proxy/ipvs/proxier.go, "masquerade
# purpose"): with the whole 198.18.0.0/15 it went out un-NATed and its reply had no way back.
KUBE_PROXY_CLUSTER_CIDR = "198.18.0.0/16"
APISERVER_PORT = 6443
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
KUBERNETES_VERSION_ENV = "KUBERNETES_VERSION"

DEFAULT_STATE_DIR = Path("/tmp/proxyshift-cluster")

# Node i: namespace ps-node-<i>, 198.18.0.<10+i> on the bridge (network.py makes them, nodesim runs them).
NODE_PREFIX = "ps-node-"
MAX_NODES = 200  # 198.18.0.11 .. 198.18.0.210


def node_name(index: int) -> str:
    return f"{NODE_PREFIX}{index}"


def node_ip(index: int) -> str:
    if not 1 <= index <= MAX_NODES:
        raise ValueError(f"node index {index} outside 1..{MAX_NODES}")
    return f"198.18.0.{10 + index}"


def node_index(name: str) -> int:
    if not name.startswith(NODE_PREFIX):
        raise ValueError(f"{name!r} is not a local-cluster node name")
    return int(name[len(NODE_PREFIX):])


def repo_root() -> Path:
    """The checkout this package was installed from (editable install).

    The test bed is a top-level package in the repository's localcluster/ folder,
    beside its Go module (go.mod, cmd/), which no wheel ships, so the build needs
    the source tree; PROXYSHIFT_REPO overrides the guess for an out-of-tree install.
    """
    override = os.environ.get("PROXYSHIFT_REPO")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1]


def go_module_dir() -> Path:
    """The Go module that pins and builds the upstream binaries: this package's own folder."""
    return repo_root() / "localcluster"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "proxyshift" / "k8s"


def tools_cache_root() -> Path:
    """The small Go programs the tests run (localcluster.gotools), one folder per tool."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "proxyshift" / "tools"


def vm_cache_root() -> Path:
    """The QEMU test bed's kernels and initramfs images (localcluster.vmkernel)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "proxyshift" / "vm"


def default_state_dir() -> Path:
    return Path(os.environ.get("PROXYSHIFT_CLUSTER_DIR") or DEFAULT_STATE_DIR)


@dataclass(frozen=True)
class StateLayout:
    """The files under one cluster's state directory."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def etcd(self) -> Path:
        return self.root / "etcd"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def kubeconfig(self, component: str) -> Path:
        return self.root / f"{component}.kubeconfig"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def pid(self, name: str) -> Path:
        return self.pids / f"{name}.pid"
