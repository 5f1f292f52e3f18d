"""The local cluster's pods run with what their manifests grant, as on a kubelet (issue 15, item 3).

Read from the running processes themselves (/proc/<pid>/status and mountinfo): the agent is root with
exactly NET_ADMIN and NET_RAW, no new privileges and a read-only root; the pod-network probe server
runs as 65532 with no capability; kube-proxy, privileged, keeps every capability.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e
NET_ADMIN_AND_RAW = 0x3000


def running_pid(state_dir: Path, node: str, pattern: str) -> int | None:
    for pid_file in sorted((state_dir / "nodes" / node / "pids").glob(pattern)):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            os.kill(pid, 0)
            return pid
    return None


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def mount_options(pid: int) -> dict[str, set[str]]:
    """Mount point -> per-mount options, as the process sees its mounts."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        out[fields[4]] = set(fields[5].split(","))
    return out


def test_each_container_runs_with_its_manifest_confinement(cluster: Any, harness: Any) -> None:
    state_dir = cluster.require_local("process confinement")
    full = int(status(os.getpid())["CapEff"], 16)

    def pid_of(node: str, pattern: str) -> int:
        found: int = harness.wait_for(lambda: running_pid(state_dir, node, pattern), 120, f"{pattern} on {node}")
        return found

    for node in cluster.nodes:
        agent = pid_of(node, "proxyshift-system_proxyshift-agent-*_agent.pid")
        s, mounts = status(agent), mount_options(agent)
        assert s["Uid"].split()[0] == "0", (node, s["Uid"])
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert int(s[field], 16) == NET_ADMIN_AND_RAW, (node, field, s[field])
        assert s["NoNewPrivs"] == "1", node
        assert "ro" in mounts["/"], (node, mounts["/"])
        assert "rw" in mounts["/run/xtables.lock"], "the agent's writable hostPath must stay writable"

        probe = pid_of(node, "proxyshift-system_proxyshift-probe-*_probe.pid")
        s, mounts = status(probe), mount_options(probe)
        assert s["Uid"].split()[0] == "65532" and s["Gid"].split()[0] == "65532", (node, s["Uid"], s["Gid"])
        assert all(int(s[f], 16) == 0 for f in ("CapEff", "CapPrm", "CapBnd", "CapAmb")), node
        assert "ro" in mounts["/"], node

        kube_proxy = pid_of(node, "kube-system_kube-proxy-*_kube-proxy.pid")
        assert int(status(kube_proxy)["CapEff"], 16) == full, "privileged kube-proxy keeps every capability"
