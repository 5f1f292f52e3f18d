"""The real agent process against a real kube-apiserver with the real ProxyNode CRD (apiserver_scenario.py).

Proves the status the agent writes is accepted by the CRD's structural schema
as it is, through the status subresource, that the field-selector watch sees
spec changes, and that Cleanup, Probe and Preflight results arrive in the
shapes the planner reads.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.kp_rules import kubelet_rules, user_rules
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane


def bin_dir() -> Path | None:
    env = os.environ.get("PROXYSHIFT_K8S_BIN")
    dirs = [env] if env else sorted(glob.glob(str(Path.home() / ".cache/proxyshift/k8s/*/bin")))
    for d in dirs:
        if d and (Path(d) / "kube-apiserver").exists() and (Path(d) / "etcd").exists():
            return Path(d)
    return None


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_agent_against_a_real_apiserver_and_crd(netns_factory: Callable[[], Netns], tmp_path: Path) -> None:
    bins = bin_dir()
    if bins is None:
        pytest.skip("no kube-apiserver/etcd build (localcluster build, or PROXYSHIFT_K8S_BIN)")
    node, ref = netns_factory(), netns_factory()
    # A module of the repository root's `tests` package, with this checkout's proxyshift (as the agent it starts).
    out = subprocess.run(["ip", "netns", "exec", node.name, sys.executable, "-m", "tests.dataplane.apiserver_scenario",
                          "--bin-dir", str(bins), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO / "operator")})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in (tmp_path / "work").glob("*.log"))
    assert out.returncode == 0, out.stderr[-3000:] + logs
    result = json.loads(out.stdout.splitlines()[-1])

    first = result["first"]
    assert first["kernelRelease"] and first["tools"]["iptablesBackend"] == "nf_tables"
    assert first["kubeProxy"]["error"] and first["heartbeat"] and first["agentVersion"]
    assert {o["mode"] for o in first["objects"]} == {"iptables"}

    cleanup = result["cleanup"]["lastOperation"]
    assert cleanup["state"] == "Succeeded", cleanup
    assert cleanup["details"]["steps"][0]["removed"]["chains"] > 600
    assert result["cleanup"].get("objects", []) == []

    probe = result["probe"]["lastOperation"]
    assert probe["state"] == "Succeeded" and "198.19.0.1:443" in probe["details"]["connects"]
    assert probe["details"]["connects"]["198.19.0.1:443"] is not True

    preflight = result["preflight"]["lastOperation"]
    assert preflight["state"] == "Failed"
    assert preflight["details"]["missingModules"][:2] == ["ip_vs", "ip_vs_mh"]

    before, after = user_rules()
    for text in (kubelet_rules(), before, after):
        ref.restore(text)
    assert body(result["iptables_after"]) == body(ref.save())
