"""Fixtures for the operator e2e tests: proxyshift installed, an operator process, a harness (they live
in tests/support/operator_harness.py, shared with tests/reliability), and the behaviour workloads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localcluster import behaviour_workloads
from localcluster.behaviour_workloads import BehaviourWorkloads
from tests.support.operator_harness import harness, operator_process, proxyshift_installed

__all__ = ["harness", "made", "operator_process", "proxyshift_installed"]


@pytest.fixture(scope="module")
def made(cluster: Any, kube: Any, proxyshift_installed: Path) -> Iterator[BehaviourWorkloads]:
    """The behaviour workloads (every Service kind the matrix samples), made for one test module."""
    state_dir = cluster.require_local("the behaviour workloads")
    workloads = behaviour_workloads.create(state_dir, kube, nodes=list(cluster.nodes))
    yield workloads
    behaviour_workloads.delete(kube, workloads.namespace)
