"""What one node simulator is told at start (its node, addresses, folders, API and back-off)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localcluster import paths

CREATED_PATHS_FILE = "created-host-paths.txt"


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
    # Probes' initial delays and timeouts times this (probes.scaled_probes): >1 on a slow (emulated) node.
    probe_time_scale: float = 1.0
    # The Node's spec.podCIDR (podnet.node_pod_cidr); unset: the Node gets none.
    pod_cidr: str = ""

    @property
    def node_dir(self) -> Path:
        return paths.StateLayout(self.state_dir).nodes / self.node

    @property
    def created_paths_file(self) -> Path:
        return paths.StateLayout(self.state_dir).nodes / CREATED_PATHS_FILE
