"""Fixtures of the bad-input and security tests on the local cluster.

They reuse the e2e harness (tests/support/operator_harness.py, whose fixtures tests/reliability/conftest.py
imports) and the session's cluster (tests/conftest.py). Only the operator process differs: its own ports.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localcluster import install
from tests.support.operator_harness import operator_as_service_account

NAMESPACE = "proxyshift-system"


# Registered under its `name` and defined under another, so a test module can import it without its
# parameter shadowing the import. The rest (proxyshift_installed, harness) comes from tests/reliability's
# conftest, shared with tests/e2e; this module-level operator_process overrides the conftest's one for the
# modules that import it, harness included.
@pytest.fixture(scope="module", name="operator_process")
def operator_process_fixture(cluster: Any, proxyshift_installed: Path) -> Iterator[install.OperatorProcess]:
    """The operator as a host process logged in as its own ServiceAccount, as the e2e tests run it."""
    # Ports of our own: an operator left running by another session on the default ports would answer
    # wait_healthy for a process of ours that could not bind and exited.
    with operator_as_service_account(cluster, proxyshift_installed, "operator-reliability-input",
                                     metrics_port=18280, health_port=18281) as op:
        assert op.running, f"the operator exited; see {op.log_path}"
        yield op


def agent_pod(cluster: Any, node: str) -> str:
    pods = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-o", "json",
                                      "--field-selector", f"spec.nodeName={node}").stdout)["items"]
    names = [p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith("proxyshift-agent-")
             and not p["metadata"].get("deletionTimestamp")]
    assert names, f"no agent pod on {node}"
    return names[0]


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ps-reliability-"))
