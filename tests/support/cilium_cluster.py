"""Cilium installed in the local cluster for one test or module (tests/e2e): the pinned agent must be built."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localcluster import cilium, cilium_install, gotools, network
from localcluster.nodesim import volumes


@contextlib.contextmanager
def cilium_installed_in(cluster: Any) -> Iterator[None]:
    """Cilium's CRDs, RBAC, ConfigMap and DaemonSet (on no node until one is labelled), removed afterwards."""
    cluster.require_local("Cilium's agent")
    if gotools.built(cilium.AGENT_TOOL) is None:
        pytest.fail(gotools.build_hint(cilium.AGENT_TOOL))
    kubectl = cluster.bin_dir / "kubectl"
    cilium_install.install(cluster.kubeconfig, kubectl, build=False)
    try:
        yield
    finally:
        cilium_install.uninstall(cluster.kubeconfig, kubectl)


def node_link_pins(state_dir: Path, node: str) -> list[str]:
    """The link pins under Cilium's folder in a local-cluster node's bpffs (its /sys/fs/bpf), relative to it:
    what keeps a stopped Cilium's socket-LB and tcx programs attached until proxyshift's flush unpins them."""
    bpffs = volumes.node_host_path(network.node_dir(state_dir, node), volumes.NODE_BPFFS)
    assert bpffs is not None, f"{node} has no bpffs"
    return sorted(str(p.relative_to(bpffs)) for p in (bpffs / "cilium").rglob("*")
                  if "/links/" in str(p) and not p.is_dir())
