"""The local cluster's pods run with what their manifests grant, as on a kubelet (issue 15, item 3).

Read from the running processes themselves (/proc/<pid>/status and mountinfo): the agent is root with
exactly NET_ADMIN and NET_RAW, no new privileges and a read-only root; the pod-network probe server
runs as 65532 with no capability; kube-proxy, privileged, keeps every capability.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.processes import container_pid, mount_options, status

pytestmark = pytest.mark.e2e
NET_ADMIN_AND_RAW = 0x3000


def test_each_container_runs_with_its_manifest_confinement(cluster: Any, harness: Any) -> None:
    state_dir = cluster.require_local("process confinement")
    full = int(status(os.getpid())["CapEff"], 16)

    def pid_of(node: str, namespace: str, pod_prefix: str, container: str) -> int:
        found: int = harness.wait_for(lambda: container_pid(state_dir, node, namespace, pod_prefix, container), 120,
                                      f"container {container} of {namespace}/{pod_prefix}* on {node}")
        return found

    for node in cluster.nodes:
        agent = pid_of(node, "proxyshift-system", "proxyshift-agent-", "agent")
        s, mounts = status(agent), mount_options(agent)
        assert s["Uid"].split()[0] == "0", (node, s["Uid"])
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert int(s[field], 16) == NET_ADMIN_AND_RAW, (node, field, s[field])
        assert s["NoNewPrivs"] == "1", node
        assert "ro" in mounts["/"], (node, mounts["/"])
        assert "rw" in mounts["/run/xtables.lock"], "the agent's writable hostPath must stay writable"

        probe = pid_of(node, "proxyshift-system", "proxyshift-probe-", "probe")
        s, mounts = status(probe), mount_options(probe)
        assert s["Uid"].split()[0] == "65532" and s["Gid"].split()[0] == "65532", (node, s["Uid"], s["Gid"])
        assert all(int(s[f], 16) == 0 for f in ("CapEff", "CapPrm", "CapBnd", "CapAmb")), node
        assert "ro" in mounts["/"], node

        kube_proxy = pid_of(node, "kube-system", "kube-proxy-", "kube-proxy")
        assert int(status(kube_proxy)["CapEff"], 16) == full, "privileged kube-proxy keeps every capability"
