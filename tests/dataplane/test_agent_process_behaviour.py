"""The real agent process runs the behaviour probe and the conntrack step as the operator asks.

`python -m proxyshift.cli agent` in the behaviour topology's node namespace (behaviour_topology.py),
against the one-ProxyNode fake API: a Preflight with `behaviour` writes status.behaviour.before, a
Probe with `conntrack` and `behaviour` deletes an un-NATed SYN_SENT entry and writes
status.behaviour.after, through the real KernelNodeEffects, the real tools and a real probe
server in the pod namespace.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import behaviour_topology as bt
import pytest
from test_agent_process import PORT, Processes, wait_for

from tests.support.ps_netns import need_root

pytestmark = pytest.mark.dataplane

BEHAVIOUR = {"nodeIps": [bt.NODE_IP], "podProbe": f"{bt.POD_IP}:{bt.PROBE_PORT}", "targets": [
    {"service": "d/tcp", "kind": "ClusterIP", "port": 80, "address": bt.SVC_TCP, "attempts": 2},
    {"service": "d/udp", "kind": "ClusterIP", "protocol": "UDP", "port": 53, "address": bt.SVC_UDP},
    {"service": "d/np", "kind": "NodePort", "port": bt.NODE_PORT, "localEndpoints": [bt.EP_A]},
]}


def done(op_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda o: (o.get("status", {}).get("lastOperation", {}).get("id") == op_id
                      and o["status"]["lastOperation"]["state"] != "Running")


def test_agent_process_writes_before_and_after_and_runs_the_conntrack_step(tmp_path: Path) -> None:
    need_root()
    topo = bt.build()
    procs = Processes(topo.node, tmp_path)
    stuck: dict[str, object] = {}
    try:
        topo.start_probe_server()
        procs.start(["-m", "tests.dataplane.fake_proxynode_api", "--port", str(PORT), "--state", str(tmp_path)],
                    "api.log")
        time.sleep(0.5)
        spec = {"mode": "iptables", "operation": {"id": "m1.Preflight.0", "type": "Preflight",
                                                  "params": {"mode": "iptables", "behaviour": BEHAVIOUR}}}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        procs.start(["-m", "proxyshift.cli", "agent", "--watch-timeout", "1", "--probe-interval", "1"], "agent.log")
        obj = wait_for(tmp_path, done("m1.Preflight.0"), "the preflight")
        last, before = obj["status"]["lastOperation"], obj["status"]["behaviour"]["before"]
        assert last["state"] == "Succeeded" and "behaviour: " in last["message"], last
        paths = {(c["service"], c["address"], c["path"]): c for c in before["cells"]}
        assert paths[("d/udp", bt.SVC_UDP, "pod")]["endpoints"] == [bt.EP_A]
        assert paths[("d/np", bt.NODE_IP, "node")]["local"] is True
        assert paths[("d/np", "127.0.0.1", "node")]["outcome"] == "refused"
        assert before.get("podPathError") is None and before["durationSeconds"] < 1.2

        # A client caught in a gap: its SYN went out before the Service had a rule.
        def client() -> None:
            with socket.socket() as sock:
                sock.settimeout(8)
                try:
                    sock.connect((bt.SVC_LATE, 80))
                    stuck["connected"] = time.monotonic()
                except OSError as exc:
                    stuck["error"] = exc

        threading.Thread(target=topo.in_node, args=(client,), daemon=True).start()
        time.sleep(0.3)
        topo.node.run(["iptables", "-t", "nat", "-I", "PS-SERVICES", "-d", f"{bt.SVC_LATE}/32", "-p", "tcp",
                       "--dport", "80", "-j", "DNAT", "--to-destination", f"{bt.EP_A}:8080"])
        time.sleep(1.2)
        assert "connected" not in stuck
        spec["operation"] = {"id": "m1.Probe.0", "type": "Probe", "params": {
            "behaviour": BEHAVIOUR, "conntrack": {"serviceCidrs": [bt.SERVICE_CIDR], "nodePorts": [bt.NODE_PORT]}}}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        obj = wait_for(tmp_path, done("m1.Probe.0"), "the probe")
        last, after = obj["status"]["lastOperation"], obj["status"]["behaviour"]["after"]
        assert last["state"] == "Succeeded", last
        assert last["details"]["conntrack"]["deletedTcp"] == 1, last["details"]
        assert obj["status"]["behaviour"]["before"]["operationId"] == "m1.Preflight.0"
        assert after["operationId"] == "m1.Probe.0"
        key = lambda c: (c["service"], c["addressRole"], c["address"], c["port"], c["path"])  # noqa: E731
        assert {key(c): c["outcome"] for c in after["cells"]} == {key(c): c["outcome"] for c in before["cells"]}
        deadline = time.monotonic() + 3
        while "connected" not in stuck and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "connected" in stuck, stuck
    finally:
        procs.stop_all()
        topo.close()
