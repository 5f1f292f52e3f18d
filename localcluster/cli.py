"""`localcluster up|down|status|build|kubeconfig|workloads|serve|vm`: the local cluster from the command line.

Also reachable as `proxyshift localcluster ...` (the main CLI hands its
remaining arguments to `main`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from localcluster import (
    baseline,
    build,
    cilium,
    cilium_install,
    controlplane,
    gotools,
    network,
    paths,
    state,
    vm,
    vmkernel,
)
from proxyshift.commands import CommandError


class UsageError(ValueError):
    pass


def parse_pools(text: str) -> dict[str, int]:
    """'blue=2,green=1' -> {'blue': 2, 'green': 1} (order kept: node numbering follows it)."""
    pools: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, count = part.partition("=")
        if not sep or not name or not count.isdigit():
            raise UsageError(f"bad pool {part!r}: expected name=count, e.g. blue=2,green=1")
        if name in pools:
            raise UsageError(f"pool {name!r} given twice")
        pools[name] = int(count)
    return pools


def pools_for(nodes: int | None, pools: str | None) -> dict[str, int]:
    if pools:
        parsed = parse_pools(pools)
        if nodes is not None and nodes != sum(parsed.values()):
            raise UsageError(f"--nodes {nodes} disagrees with --pools (total {sum(parsed.values())})")
        return parsed
    # Without pools every node is in one pool named "default".
    return {"default": 3 if nodes is None else nodes}


def create_nodes(state_dir: Path, info: controlplane.ClusterInfo, pools: dict[str, int]) -> list[str]:
    """Hand over to the node half (localcluster.network.create_nodes)."""
    if sum(pools.values()) == 0:
        return []
    return list(network.create_nodes(state_dir, info, pools))


def up(state_dir: Path, pools: dict[str, int], *, with_cilium: bool = False) -> dict[str, Any]:
    started = time.monotonic()
    bin_dir = build.build()  # outside the machine lock: a cold build must not hold up a `down`
    if with_cilium:
        gotools.build(cilium.AGENT_TOOL)  # outside the lock too: minutes from a cold Go cache
    with state.machine_lock():
        existing = controlplane.load_info(state_dir)
        was_running = existing is not None and controlplane.is_ready(existing)
        info = controlplane.up_controlplane(state_dir, bin_dir=bin_dir)
        if not was_running:
            # Only on a fresh control plane: re-applying on a running cluster would
            # undo what a test or the operator changed in the baseline since.
            baseline.install(info.kubeconfig, info.bin_dir / "kubectl", env=controlplane.daemon_env())
        nodes = create_nodes(state_dir, info, pools)
        if with_cilium:
            cilium_install.install(info.kubeconfig, info.bin_dir / "kubectl")
    return {"kubeconfig": str(info.kubeconfig), "api_url": info.api_url, "nodes": nodes,
            "seconds": round(time.monotonic() - started, 1)}


def _print_status(report: dict[str, Any]) -> None:
    print(f"state dir: {report['state_dir']}")
    print(f"api ready: {'yes' if report['ready'] else 'no'}")
    if report["info"]:
        print(f"kubeconfig: {report['info']['kubeconfig']}  api: {report['info']['api_url']}")
    for proc in report["processes"]:
        rss = f"{proc['rss_mib']:>7.1f} MiB" if proc.get("rss_mib") is not None else " " * 11
        print(f"  {'up  ' if proc['alive'] else 'DOWN'} {proc['name']:<28} pid {proc['pid']:<8} {rss}  "
              f"{proc['log'] or ''}")
    missing = [p["path"] for p in report["paths"] if not p["exists"]]
    print(f"files: {len(report['paths'])} recorded, {len(missing)} missing")
    if "nodes" in report:
        print(json.dumps(report["nodes"], indent=2, default=str))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localcluster", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"runtime state (default $PROXYSHIFT_CLUSTER_DIR or {paths.DEFAULT_STATE_DIR})")
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="build if needed, start the control plane, baseline and nodes")
    up_parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default 3)")
    up_parser.add_argument("--pools", default=None, help="node pools, e.g. blue=2,green=1")
    up_parser.add_argument("--with-cilium", action="store_true",
                           help="also install Cilium (CRDs, RBAC, DaemonSet kube-system/cilium); its agent runs "
                                "only on Nodes labelled proxyshift.io/kube-proxy-replacement=cilium")
    sub.add_parser("down", help="remove every process, namespace, interface and file the cluster made")
    status_parser = sub.add_parser("status", help="show what runs")
    status_parser.add_argument("--json", action="store_true")
    build_parser_ = sub.add_parser("build", help="build the pinned binaries; print their folder")
    build_parser_.add_argument("--force", action="store_true")
    sub.add_parser("kubeconfig", help="print the admin kubeconfig path")
    workloads_parser = sub.add_parser("workloads", help="make test workloads in the running cluster")
    workloads_parser.add_argument("--behaviour", action="store_true", required=True,
                                  help="one Service of every kind the behaviour gate judges, in ps-behaviour")
    workloads_parser.add_argument("--json", action="store_true", help="print what was made as JSON")
    serve_parser = sub.add_parser("serve", help="(in a test pod) answer every HTTP GET with $HOSTNAME")
    serve_parser.add_argument("--listen", default="0.0.0.0:8080", metavar="HOST:PORT")
    # The QEMU guest with a stock Debian kernel (IPVS, dummy, modules): `vm -- CMD ARGS...`.
    vm.add_arguments(sub.add_parser("vm", help="run one command as root in the QEMU guest (IPVS kernel)"))
    return parser


def make_workloads(state_dir: Path, as_json: bool) -> int:
    from localcluster import behaviour_workloads  # the kubernetes client: only when asked

    info = controlplane.load_info(state_dir)
    if info is None:
        print(f"no cluster in {state_dir} (run `localcluster up`)", file=sys.stderr)
        return 1
    made = behaviour_workloads.create(state_dir, info.kubeconfig)
    if as_json:
        print(json.dumps(made.to_dict(), indent=2))
        return 0
    for svc in made.services:
        address = svc.cluster_ip or "-"
        node_port = f" nodePort {svc.node_port}" if svc.node_port else ""
        print(f"{svc.key:<32} {svc.kind or '-':<14} {svc.protocol} {address}:{svc.port}{node_port}  "
              f"endpoints: {', '.join(f'{e}@{made.endpoint(e).node}' for e in svc.endpoints) or 'none'}")
    for node in made.nodes:
        print(f"{node.name}: {node.ip} (second address {node.second_address}), pod {node.pod_ip} in "
              f"{node.pod_netns}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    state_dir: Path = args.state_dir or paths.default_state_dir()
    try:
        if args.command == "vm":
            return vm.main_from_args(args)
        if args.command == "build":
            print(build.build(force=args.force))
        elif args.command == "up":
            result = up(state_dir, pools_for(args.nodes, args.pools), with_cilium=args.with_cilium)
            print(f"cluster up in {result['seconds']}s; nodes: {', '.join(result['nodes']) or 'none'}",
                  file=sys.stderr)
            print(f"export KUBECONFIG={result['kubeconfig']}")
        elif args.command == "down":
            stopped = controlplane.down(state_dir)
            print(f"stopped: {', '.join(stopped) or 'nothing running'}; removed {state_dir}", file=sys.stderr)
        elif args.command == "status":
            report = controlplane.status(state_dir)
            if args.json:
                print(json.dumps(report, indent=2, default=str))
            else:
                _print_status(report)
            return 0 if report["ready"] else 3
        elif args.command == "kubeconfig":
            info = controlplane.load_info(state_dir)
            if info is None:
                print(f"no cluster in {state_dir} (run `localcluster up`)", file=sys.stderr)
                return 1
            print(info.kubeconfig)
        elif args.command == "workloads":
            return make_workloads(state_dir, args.json)
        elif args.command == "serve":
            from localcluster import identity_server

            identity_server.serve(args.listen)
    except (UsageError, build.BuildError, controlplane.ControlPlaneError, CommandError, TimeoutError,
            vm.VmError, vmkernel.VmKernelError, cilium.CiliumError, cilium_install.CiliumInstallError,
            gotools.GoToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.command == "up" and state_dir.exists():
            print(f"(state kept for inspection: logs in {state_dir}/logs; `localcluster down` removes it)",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
