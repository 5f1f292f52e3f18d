"""The operator as in-cluster pods (config/manager, two replicas with peering) migrates a pool (issue 6)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import REVISION_LABEL, policy

from proxyshift.localcluster import paths

pytestmark = pytest.mark.e2e

BLUE = ["ps-node-1", "ps-node-2"]


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
        h.apply(policy("blue-in-cluster", "nftables"))
        h.wait_condition("blue-in-cluster", "Ready", 420)
        assert all(h.proxy_mode(n) == "nftables" for n in BLUE)
        assert all(h.node_labels(n).get(REVISION_LABEL, "").startswith("blue-in-cluster-") for n in BLUE)
        h.delete("blue-in-cluster", wait=420)
        assert all(h.proxy_mode(n) == "iptables" for n in BLUE)
    finally:
        cluster.kubectl("delete", "-k", manager, "--ignore-not-found", "--wait=true", timeout=180, check=False)
        h.operator.start()
