"""`make bench`: every benchmark once, at sizes that finish in minutes, each printing its table.

    sudo python bench/run_all.py            # quick sizes (about 20 minutes on 2 cores)
    sudo python bench/run_all.py --full     # the sizes docs/benchmarks.md quotes (hours)

The benchmarks run one after another (they measure CPU time; two at once would
measure each other). The rollout and Cilium benchmarks need the machine-wide local
cluster, so they run under the same lock the tests take (/var/lock/proxyshift-localcluster.lock).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_LOCK = "/var/lock/proxyshift-localcluster.lock"
QUICK_TIMEOUT = 3600.0
FULL_TIMEOUT = 8 * 3600.0

# (script, quick args, full args, needs the local cluster)
BENCHES: list[tuple[str, list[str], list[str], bool]] = [
    ("bench_flush.py", ["--sizes", "1000,5000", "--runs", "1"], ["--sizes", "1000,5000,10000", "--runs", "3"],
     False),
    # The agent's preflight and its path after kube-proxy's sync, in a netns; seconds.
    ("bench_agent_path.py", ["--services", "20", "--runs", "3"], ["--services", "20,200", "--runs", "7"], False),
    # Boots the QEMU guest (IPVS); quick: one 1k size, about 2 min under emulation.
    ("bench_flush_ipvs.py", ["--sizes", "1000", "--runs", "1"], ["--sizes", "1000,5000", "--runs", "3"], False),
    ("bench_kube_proxy_modes.py", ["--services", "1000", "--runs", "1", "--changes", "3"],
     ["--services", "1000,5000,10000", "--runs", "3", "--changes", "5"], False),
    ("bench_rollout_overhead.py", ["--runs", "1"], ["--runs", "5"], True),
    # Cilium's agent beside kube-proxy on the local cluster (builds the pinned agent if the cache lacks it).
    ("bench_cilium_kpr.py", ["--runs", "1"], ["--runs", "3"], True),
    ("bench_controller_scale.py", ["--nodes", "500"], ["--nodes", "1000,5000", "--timeout", "2400"], False),
    # Its own control plane on its own ports; both back-offs side by side. Quick: 500 agents, about 3 min.
    ("bench_reconnect_storm.py", ["--agents", "500"], ["--agents", "5000"], False),
    # Pure Python, seconds: the /metrics parse on a real capture and the 8 MiB worst cases.
    ("bench_metrics_parse.py", ["--runs", "3"], ["--runs", "5"], False),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the sizes docs/benchmarks.md quotes")
    p.add_argument("--only", help="comma-separated script names to run (e.g. bench_flush.py)")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    failed = []
    # Each benchmark is a module of the `bench` package, run from the repository root (which also holds
    # the tests.support helpers it shares), against this checkout's proxyshift even where it is not
    # pip-installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "operator"),
                                                                     os.environ.get("PYTHONPATH")]))}
    for script, quick, full, needs_cluster in BENCHES:
        if only is not None and script not in only:
            continue
        argv_ = [sys.executable, "-m", f"bench.{Path(script).stem}", *(full if args.full else quick)]
        if needs_cluster:
            argv_ = ["flock", CLUSTER_LOCK, *argv_]
        print(f"\n===== {script} {' '.join(full if args.full else quick)}", flush=True)
        started = time.monotonic()
        # Each benchmark bounds its own waits; this is the backstop for one that hangs.
        try:
            code = subprocess.run(argv_, check=False, timeout=FULL_TIMEOUT if args.full else QUICK_TIMEOUT, cwd=ROOT,
                                  env=env).returncode
        except subprocess.TimeoutExpired:
            code = -1
        print(f"===== {script}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
