"""Fixtures for the operator e2e tests: proxyshift installed, an operator process, a harness."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from operator_harness import Harness

from proxyshift.localcluster import install


@pytest.fixture(scope="session")
def proxyshift_installed(cluster: Any, kubeconfig: Path) -> Path:
    """CRDs, RBAC, admission policies and agents applied; agents ready on every node."""
    bin_dir = cluster.bin_dir
    if bin_dir is None:  # an external cluster: kubectl from PATH
        pytest.fail("installing proxyshift on an external cluster: run `kubectl apply -k config/default`")
    install.install(bin_dir, kubeconfig)
    return kubeconfig


# Module scope: the operator stops at the end of each module, so the session's last test (`down`
# leaves nothing behind) sees no process of ours.
@pytest.fixture(scope="module")
def operator_process(cluster: Any, proxyshift_installed: Path) -> Iterator[install.OperatorProcess]:
    state_dir = cluster.state_dir or Path("/tmp")
    op = install.OperatorProcess(proxyshift_installed, state_dir / "logs" / "operator-e2e.log").start()
    op.wait_healthy()
    yield op
    op.stop()


@pytest.fixture
def harness(api_client: Any, operator_process: install.OperatorProcess, node_exec: Callable[..., Any],
            node_http_get: Callable[..., tuple[int, str]], wait_for: Callable[..., Any]) -> Iterator[Harness]:
    h = Harness(api_client, operator_process, node_exec, node_http_get, wait_for)
    if not operator_process.running:
        operator_process.start()
    yield h
    if not operator_process.running:
        operator_process.start()
    h.cleanup()
