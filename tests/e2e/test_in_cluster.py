"""The operator as in-cluster pods (config/manager, two replicas with peering) migrates a pool (issue 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localcluster import paths
from tests.support.operator_harness import REVISION_LABEL, policy
from tests.support.processes import assert_confined_as_operator

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]


def assert_operator_confined(state_dir: Path) -> None:
    """Each replica runs as the manifest says: uid 65532, no capability, a read-only root (issue 15)."""
    pids = []
    for pid_file in state_dir.glob("nodes/*/pids/proxyshift-system_proxyshift-operator-*_operator.pid"):
        pid = pid_file.read_text().strip()
        if Path(f"/proc/{pid}").exists():
            pids.append(pid)
    assert len(pids) == 2, f"two operator replicas expected running, found {pids}"
    for pid in pids:
        assert_confined_as_operator(int(pid))


def test_in_cluster_operator_with_peering_migrates_a_pool(cluster: Any, harness: Any) -> None:
    h = harness
    h.operator.stop()  # only the in-cluster replicas may act now
    manager = str(paths.repo_root() / "config" / "manager")
    cluster.kubectl("apply", "-k", manager, "--server-side", "--force-conflicts",
                    "--field-manager=proxyshift-install")
    try:
        cluster.kubectl("-n", "proxyshift-system", "rollout", "status", "deployment/proxyshift-operator",
                        "--timeout=180s", timeout=200)
        h.wait_for(lambda: "proxyshift" in cluster.kubectl("get", "clusterkopfpeerings", "-o", "name").stdout,
                   60, "the operator's peering object")
        assert_operator_confined(cluster.require_local("operator confinement"))
        h.apply(policy("blue-in-cluster", "nftables"))
        h.wait_condition("blue-in-cluster", "Ready", 420)
        assert all(h.proxy_mode(n) == "nftables" for n in BLUE)
        assert all(h.node_labels(n).get(REVISION_LABEL, "").startswith("blue-in-cluster-") for n in BLUE)
        h.delete("blue-in-cluster", wait=420)
        assert all(h.proxy_mode(n) == "iptables" for n in BLUE)
    finally:
        cluster.kubectl("delete", "-k", manager, "--ignore-not-found", "--wait=true", timeout=180, check=False)
        h.operator.start()
