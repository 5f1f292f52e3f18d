"""The agent against a real kube-apiserver and the real ProxyNode CRD, all inside one namespace.

Run inside a fresh network namespace (test_agent_apiserver.py does that), so
etcd and kube-apiserver on 127.0.0.1 collide with nothing else on the machine:

    ip netns exec <ns> python -m tests.dataplane.apiserver_scenario --bin-dir DIR --work DIR  # from the repository root

It starts etcd and kube-apiserver (token auth, AlwaysAllow), installs
crds/proxynode.yaml, creates a ProxyNode, loads kube-proxy iptables-mode rules
next to a user's, starts the real agent process, drives it through Cleanup,
Probe and Preflight operations by patching spec.operation, and prints what
the API server stored (JSON) for the test to judge. Every process it starts is
stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import yaml

from proxyshift.commands import run, stop_child
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, user_rules

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "proxyshift-test-token"
GROUP, VERSION, PLURAL, NODE = "proxyshift.io", "v1alpha1", "proxynodes", "ps-node-1"


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait(pred: Callable[[], Any], what: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # the API server is still starting
            last_exc = exc
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what} ({last_exc})")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    run(["ip", "link", "set", "lo", "up"])
    run(["openssl", "genrsa", "-out", str(work / "sa.key"), "2048"])
    (work / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
    (work / "kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "t", "user": {"token": TOKEN}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
    }))
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {}
    try:
        procs.append(start([str(args.bin_dir / "etcd"), "--data-dir", str(work / "etcd"),
                            "--listen-client-urls", "http://127.0.0.1:2379",
                            "--advertise-client-urls", "http://127.0.0.1:2379",
                            "--listen-peer-urls", "http://127.0.0.1:2380", "--unsafe-no-fsync",
                            "--log-level", "warn"], work / "etcd.log"))
        procs.append(start([str(args.bin_dir / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379",
                            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port=6443",
                            f"--cert-dir={work / 'certs'}", f"--token-auth-file={work / 'tokens.csv'}",
                            "--authorization-mode=AlwaysAllow",
                            "--service-account-issuer=https://kubernetes.default.svc",
                            f"--service-account-key-file={work / 'sa.key'}",
                            f"--service-account-signing-key-file={work / 'sa.key'}",
                            "--service-cluster-ip-range=198.19.0.0/16", "--endpoint-reconciler-type=none",
                            "--enable-priority-and-fairness=false"], work / "apiserver.log"))

        from kubernetes import client, config

        config.load_kube_config(str(work / "kubeconfig"))
        ext = client.ApiextensionsV1Api()
        crd = yaml.safe_load((ROOT / "crds" / "proxynode.yaml").read_text())
        wait(lambda: ext.create_custom_resource_definition(crd), "the CRD to be accepted", 120)
        def established() -> bool:
            status = ext.read_custom_resource_definition(crd["metadata"]["name"]).status
            return any(c.type == "Established" and c.status == "True"
                       for c in (status.conditions if status else None) or [])

        wait(established, "the CRD to be established")
        api = client.CustomObjectsApi()
        wait(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyNode", "metadata": {"name": NODE},
            "spec": {"mode": "nftables"}}), "the ProxyNode to be created")

        before, after = user_rules()
        for text in (kubelet_rules(), before, iptables_mode_rules(200), after):
            run(["iptables-restore", "--noflush"], input=text, timeout=120)

        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "operator"),
               "KUBECONFIG": str(work / "kubeconfig"), "NODE_NAME": NODE, "HOME": str(work)}
        procs.append(start([sys.executable, "-m", "proxyshift.cli", "agent", "--watch-timeout", "5",
                            "--probe-interval", "1", "--status-interval", "2", "--inventory-interval", "1"],
                           work / "agent.log", env))

        def status() -> dict[str, Any]:
            # The custom-objects API returns the object as JSON: a dict.
            obj = cast(dict[str, Any], api.get_cluster_custom_object(GROUP, VERSION, PLURAL, NODE))
            return cast(dict[str, Any], obj.get("status") or {})

        result["first"] = wait(lambda: status() if status().get("heartbeat") else None, "a heartbeat")

        def operate(op: dict[str, Any]) -> dict[str, Any]:
            api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, NODE, {"spec": {"operation": op}})
            return wait(lambda: status() if (status().get("lastOperation") or {}).get("id") == op["id"]
                        and status()["lastOperation"]["state"] != "Running" else None, f"operation {op['id']}")

        result["cleanup"] = operate({"id": "c1", "type": "Cleanup",
                                     "params": {"removeModes": ["iptables"], "targetMode": "nftables"}})
        result["probe"] = operate({"id": "p1", "type": "Probe", "params": {"services": ["198.19.0.1:443"]}})
        result["preflight"] = operate({"id": "f1", "type": "Preflight", "params": {
            "mode": "ipvs", "scheduler": "mh", "loadModules": False, "extraModules": []}})
        result["iptables_after"] = run(["iptables-save"]).stdout
        print(json.dumps(result))
        return 0
    finally:
        for proc in reversed(procs):
            stop_child(proc, grace=20)


if __name__ == "__main__":
    sys.exit(main())
