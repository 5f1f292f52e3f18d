"""`make demo`: the main job, end to end on the local cluster.

Builds the pinned Kubernetes binaries (cached), starts a local cluster with
pools blue (2 nodes) and green (1 node) on iptables, installs proxyshift, runs
the operator, sends continuous TCP traffic through a ClusterIP from a node of
each pool, applies config/samples/blue-nftables.yaml and shows the rollout live
until the policy is Ready. The cluster stays up afterwards to explore
(`localcluster down` removes it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from localcluster import cli as cluster_cli
from localcluster import controlplane, install, network, paths, workloads
from proxyshift.controller import status_view

POLICY = "blue-nftables"
SAMPLE = Path("config/samples/blue-nftables.yaml")


def say(message: str) -> None:
    print(f"\n==> {message}", flush=True)


def ensure_cluster(state_dir: Path) -> controlplane.ClusterInfo:
    info = controlplane.load_info(state_dir)
    if info is not None and controlplane.status(state_dir)["ready"]:
        say(f"local cluster already running (state in {state_dir})")
        return info
    say("starting the local cluster: pools blue=2, green=1, kube-proxy in iptables mode")
    report = cluster_cli.up(state_dir, {"blue": 2, "green": 1})
    say(f"cluster up in {report['seconds']}s: nodes {', '.join(report['nodes'])}")
    info = controlplane.load_info(state_dir)
    assert info is not None
    return info


def wait_until_served(service: workloads.Service, nodes: Sequence[str], timeout: float = 60) -> None:
    """A new Service is programmed before its EndpointSlice reaches kube-proxy (REJECT meanwhile):
    start counting only once it answers, so the numbers measure the migration alone."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        while workloads.tcp_probe(node, service.cluster_ip, service.port, 3).failed:
            if time.monotonic() > deadline:
                raise SystemExit(f"the demo Service {service.cluster_ip}:{service.port} does not answer from {node}")
            time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="proxyshift-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=900, help="give up after N seconds of rollout")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    state_dir = paths.default_state_dir()
    info = ensure_cluster(state_dir)
    kubeconfig, bin_dir = info.kubeconfig, info.bin_dir

    say("installing proxyshift: CRDs, RBAC, admission policies, node agents")
    install.install(bin_dir, kubeconfig)

    say("test Service: a ClusterIP whose endpoints are real listeners in their own namespaces")
    endpoints = workloads.create_endpoints(state_dir, 2, start=201)
    service = workloads.create_services(kubeconfig, endpoints, 1, prefix="demo")[0]
    blue, green = network.node_name(1), network.node_name(3)
    wait_until_served(service, (blue, green))
    probers = {node: workloads.ContinuousProber(node, service.cluster_ip, service.port).start()
               for node in (blue, green)}
    say(f"continuous TCP probes to {service.cluster_ip}:{service.port} from {blue} (blue) and {green} (green)")

    operator = install.OperatorProcess(kubeconfig, state_dir / "logs" / "operator.log").start()
    operator.wait_healthy()
    say(f"operator running (log: {operator.log_path})")

    say(f"kubectl apply -f {SAMPLE}")
    print(install.kubectl(bin_dir, kubeconfig, "apply", "-f", str(paths.repo_root() / SAMPLE)), end="")
    started = time.monotonic()
    code = status_view.main([POLICY, "--kubeconfig", str(kubeconfig), "--watch", "--until-done",
                             "--timeout", str(args.timeout)])
    elapsed = time.monotonic() - started
    results = {node: prober.stop() for node, prober in probers.items()}

    say("kubectl get proxynodes")
    print(install.kubectl(bin_dir, kubeconfig, "get", "proxynodes", "-o", "wide"), end="")
    say("traffic through the ClusterIP during the migration")
    for node, result in results.items():
        print(f"  from {node}: {result.ok} connections ok, {result.failed} failed")
    operator.stop()
    if code == 0:
        say(f"{POLICY} is Ready after {elapsed:.0f}s. The cluster stays up: "
            f"export KUBECONFIG={kubeconfig}; `make cluster-down` removes it.")
    else:
        say(f"{POLICY} did not become Ready (see `proxyshift status {POLICY}` and {operator.log_path})")
    return code


if __name__ == "__main__":
    sys.exit(main())
