"""The real `python -m proxyshift.cli agent` process in a test namespace, against a one-ProxyNode API.

It must report the node (heartbeat, kernel, tools, objects, leftovers, the
kube-proxy probe error when none runs), run a Cleanup operation once and
surgically, and after a restart that finds its operation still Running report
instead of flushing again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from proxyshift.commands import stop_child
from tests.support import REPO
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, user_rules
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

OPERATOR = REPO / "operator"
PORT = 16444
KUBECONFIG = f"""\
apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "http://127.0.0.1:{PORT}"}}}}]
users: [{{name: agent, user: {{token: fake}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: agent}}}}]
current-context: fake
"""


class Processes:
    def __init__(self, ns: Netns, state: Path) -> None:
        self.ns, self.state = ns, state
        self.procs: list[tuple[subprocess.Popen[bytes], IO[str]]] = []
        (state / "kubeconfig").write_text(KUBECONFIG)
        self.env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(OPERATOR), "KUBECONFIG": str(state / "kubeconfig"),
                    "HOME": str(state), "NODE_NAME": "ps-node-1"}

    def start(self, argv: list[str], log: str) -> subprocess.Popen:
        out = open(self.state / log, "a")  # noqa: SIM115 - lives as long as the process
        # In the repository root, so `-m tests.dataplane...` finds the test helpers' package.
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns.name, sys.executable, *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        self.procs.append((proc, out))
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        stop_child(proc)

    def stop_all(self) -> None:
        for proc, out in self.procs:
            self.stop(proc)
            out.close()


def read(state: Path) -> dict[str, Any]:
    try:
        return json.loads((state / "object.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for(state: Path, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = read(state)
        if obj and pred(obj):
            return obj
        time.sleep(0.5)
    logs = "\n".join((state / f).read_text()[-2000:] for f in ("agent.log", "api.log") if (state / f).exists())
    raise AssertionError(f"timed out waiting for {what}; last status {read(state).get('status')}\n{logs}")


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_agent_process_reports_runs_a_cleanup_once_and_recovers_after_a_restart(
        netns_factory: Callable[[], Netns], tmp_path: Path) -> None:
    node, ref = netns_factory(), netns_factory()
    before, after = user_rules()
    for ns, kube in ((node, True), (ref, False)):
        ns.restore(kubelet_rules())
        ns.restore(before)
        if kube:
            ns.restore(iptables_mode_rules(200))
        ns.restore(after)
    node.run(["ip", "link", "set", "lo", "up"])
    state = tmp_path
    (state / "spec.json").write_text(json.dumps({"mode": "nftables"}))
    procs = Processes(node, state)
    agent_argv = ["-m", "proxyshift.cli", "agent", "--watch-timeout", "1", "--probe-interval", "1",
                  "--status-interval", "2", "--inventory-interval", "1"]
    try:
        procs.start(["-m", "tests.dataplane.fake_proxynode_api", "--port", str(PORT), "--state", str(state)], "api.log")
        time.sleep(0.5)
        agent = procs.start(agent_argv, "agent.log")

        obj = wait_for(state, lambda o: "heartbeat" in o.get("status", {}), "a heartbeat")
        status = obj["status"]
        assert status["kernelRelease"] == Path("/proc/sys/kernel/osrelease").read_text().strip()
        assert status["tools"]["iptablesBackend"] == "nf_tables"
        assert "Connection" in status["kubeProxy"]["error"]      # no kube-proxy in this namespace
        assert {o["mode"] for o in status["objects"]} == {"iptables"}
        assert status.get("leftovers", []) == []                  # unknown observed mode: nothing called stale

        (state / "spec.json").write_text(json.dumps({"mode": "nftables", "operation": {
            "id": "c1", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}}}))
        obj = wait_for(state, lambda o: o["status"].get("lastOperation", {}).get("state") in ("Succeeded", "Failed")
                       and o["status"]["lastOperation"]["id"] == "c1", "the cleanup result")
        last = obj["status"]["lastOperation"]
        assert last["state"] == "Succeeded", last
        assert last["details"]["steps"][0]["removed"]["chains"] > 600
        assert body(node.save()) == body(ref.save())
        procs.stop(agent)

        # An agent that died during c2: its status still says Running. The restarted one reports.
        (state / "spec.json").write_text(json.dumps({"mode": "nftables", "operation": {
            "id": "c2", "type": "Cleanup", "params": {"removeModes": ["iptables"], "targetMode": "nftables"}},
            "status": {"lastOperation": {"id": "c2", "type": "Cleanup", "state": "Running",
                                         "startedAt": "2026-01-01T00:00:00Z"}}}))
        procs.start(agent_argv, "agent.log")
        obj = wait_for(state, lambda o: o["status"].get("lastOperation", {}).get("id") == "c2"
                       and o["status"]["lastOperation"]["state"] != "Running", "the recovered report")
        last = obj["status"]["lastOperation"]
        assert last["state"] == "Succeeded" and last["details"]["recovered"] is True
        assert "restarted during this cleanup" in last["message"]
        assert last["startedAt"] == "2026-01-01T00:00:00Z"
    finally:
        procs.stop_all()
