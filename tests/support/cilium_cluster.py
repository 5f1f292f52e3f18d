"""Cilium installed in the local cluster for one test or module (tests/e2e): the pinned agent must be built."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from localcluster import cilium, cilium_install, gotools


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
