"""The node simulator's process: the Node's heartbeat, the pod watch, a worker per pod, shutdown."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from localcluster import nodesim, paths, podnet
from localcluster.container import setns
from localcluster.kubeapi import Kube, KubeError
from localcluster.nodesim.config import SimConfig
from localcluster.nodesim.containers import stop_processes
from localcluster.nodesim.logserver import LogServer
from localcluster.nodesim.node import (
    LEASE_RENEW_SECONDS,
    NODE_STATUS_SECONDS,
    READY_FILE,
    ensure_node,
    node_manifest,
    node_status,
    renew_lease,
)
from localcluster.nodesim.pod import PodWorker

log = logging.getLogger("proxyshift.nodesim")

class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.kube = Kube(cfg.kubeconfig)
        self.workers: dict[str, PodWorker] = {}
        self.node_uid: str | None = None
        self.created_lock = threading.Lock()
        self.log_server = LogServer(cfg, self.pod_running)
        self.start_lock = threading.Lock()
        self.stopping = False
        # One thread that lives in the node's network namespace runs every probe, so a
        # probe costs a socket, not a process.
        self.probe_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="probe", initializer=setns, initargs=(cfg.node,))

    def pod_running(self, namespace: str, pod: str) -> bool:
        return any(w.namespace == namespace and w.pod_name == pod and not w.finished
                   for w in list(self.workers.values()))

    def ca_pem(self) -> str:
        ca = self.kube.configuration.ssl_ca_cert
        return Path(ca).read_text() if ca else ""

    def note_created(self, path: Path) -> None:
        with self.created_lock, self.cfg.created_paths_file.open("a") as out:
            out.write(f"{path}\n")

    def heartbeat(self) -> None:
        manifest = node_manifest(self.cfg.node, self.cfg.node_ip, self.cfg.pool, self.cfg.kubelet_version,
                                 self.cfg.pod_cidr)
        last_status = 0.0
        while True:
            try:
                if time.monotonic() - last_status >= NODE_STATUS_SECONDS:
                    manifest["status"] = node_status(self.cfg.node_ip, self.cfg.node, self.cfg.kubelet_version)
                    if self.node_uid is None:
                        self.node_uid = ensure_node(self.kube, manifest)["metadata"]["uid"]
                    else:
                        try:
                            self.kube.strategic_patch(f"/api/v1/nodes/{self.cfg.node}/status",
                                                      {"status": manifest["status"]})
                        except KubeError as exc:
                            if exc.status == 404:  # someone deleted the Node: register again
                                self.node_uid = None
                                continue
                            raise
                    last_status = time.monotonic()
                renew_lease(self.kube, self.cfg.node, self.node_uid)
                ready = self.cfg.node_dir / READY_FILE
                if not ready.exists():
                    ready.write_text(f"{os.getpid()}\n")
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
                last_status = 0.0
                time.sleep(2.0)
                continue
            time.sleep(LEASE_RENEW_SECONDS)

    def dispatch(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is not None and not worker.finished:
            worker.update(pod)
            return
        if worker is not None and not pod["metadata"].get("deletionTimestamp"):
            return  # finalised or failed; only a deletion needs a worker again
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and \
                not pod["metadata"].get("deletionTimestamp"):
            return
        worker = PodWorker(self, pod)
        self.workers[uid] = worker
        worker.start()

    def forget_finished(self) -> None:
        for uid in [u for u, w in self.workers.items() if w.finished and (w.gone or w.pod["metadata"].get(
                "deletionTimestamp"))]:
            del self.workers[uid]

    def watch_pods(self) -> None:
        selector = f"spec.nodeName={self.cfg.node}"
        resource_version = ""
        while True:
            try:
                if not resource_version:
                    listing = self.kube.get("/api/v1/pods", fieldSelector=selector)
                    resource_version = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing["items"]:
                        seen.add(pod["metadata"]["uid"])
                        self.dispatch(pod)
                    for uid, worker in list(self.workers.items()):
                        if uid not in seen:
                            worker.mark_gone()
                for event in self.kube.watch("/api/v1/pods", {
                        "fieldSelector": selector, "resourceVersion": resource_version,
                        "allowWatchBookmarks": "true", "timeoutSeconds": 300}, read_timeout=330.0):
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            resource_version = ""
                        break
                    resource_version = obj["metadata"].get("resourceVersion", resource_version)
                    if kind in ("ADDED", "MODIFIED"):
                        self.dispatch(obj)
                    elif kind == "DELETED" and (deleted := self.workers.get(obj["metadata"]["uid"])):
                        deleted.mark_gone()
                self.forget_finished()
            except Exception as exc:
                log.warning("pod watch failed (%s); relisting", exc)
                resource_version = ""
                time.sleep(1.0)

    def shutdown(self, *_: Any) -> None:
        """On SIGTERM (`down`): stop every container quickly, leave the API alone, exit."""
        # The pod workers keep running while this handler does: without the flag, one of them
        # would "restart" the container this handler just stopped, and that one would outlive us.
        self.stopping = True
        with self.start_lock:
            procs = [r.proc for w in list(self.workers.values()) for r in w.init_runs + w.runs
                     if r.proc is not None]
        stop_processes(procs, 3.0)
        os._exit(0)

    def kill_orphans(self) -> None:
        """Kill processes a previous simulator left in the node (they would hold ports and rules)."""
        from proxyshift.commands import run

        pids = [int(p) for netns in (self.cfg.node, self.cfg.pod_netns) if netns
                for p in run(["ip", "netns", "pids", netns], check=False).stdout.split()
                if p.isdigit() and int(p) != os.getpid()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            log.info("killed %d processes left in %s by an earlier simulator", len(pids), self.cfg.node)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.shutdown)
        signal.signal(signal.SIGINT, self.shutdown)
        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)
        self.kill_orphans()
        try:
            self.log_server.start()
        except Exception as exc:  # logs are a convenience: never the reason a node is down
            log.warning("kubelet log API not started: %s", exc)
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()
        self.watch_pods()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="localcluster.nodesim", description=nodesim.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", required=True)
    parser.add_argument("--node-ip", help="default: from the node name (ps-node-<i> -> 198.18.0.<10+i>)")
    parser.add_argument("--pod-ip", help="the node's pod namespace address (default: from the node name, "
                                         "see localcluster.podnet)")
    parser.add_argument("--pool", default="default")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, default=paths.default_state_dir())
    parser.add_argument("--api-url", default=f"https://{paths.BRIDGE_ADDRESS}:{paths.APISERVER_PORT}",
                        help="what pods get as KUBERNETES_SERVICE_HOST/PORT")
    parser.add_argument("--kubelet-version", default="v1.37.2")
    parser.add_argument("--backoff-base", type=float, default=10.0)
    parser.add_argument("--backoff-max", type=float, default=300.0)
    parser.add_argument("--probe-time-scale", type=float, default=1.0,
                        help="multiply probes' initialDelaySeconds and timeoutSeconds (a node in the QEMU guest)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node} %(levelname)s %(message)s")
    node_ip = args.node_ip
    if node_ip is None:
        node_ip = paths.node_ip(paths.node_index(args.node))
    pod_ip = args.pod_ip
    if pod_ip is None:
        pod_ip = podnet.pod_ip(paths.node_index(args.node))
    rest = args.api_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    cfg = SimConfig(node=args.node, node_ip=node_ip, pool=args.pool, kubeconfig=args.kubeconfig,
                    bin_dir=args.bin_dir, state_dir=args.state_dir, api_host=host or rest,
                    api_port=int(port) if host else 443, kubelet_version=args.kubelet_version,
                    backoff_base=args.backoff_base, backoff_max=args.backoff_max,
                    pod_netns=podnet.pod_netns(args.node), pod_ip=pod_ip,
                    probe_time_scale=args.probe_time_scale,
                    pod_cidr=str(podnet.node_pod_cidr(paths.node_index(args.node))))
    Simulator(cfg).run()


if __name__ == "__main__":
    main()
