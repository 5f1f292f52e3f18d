"""CPU time to parse kube-proxy's /metrics text: a real capture and the generated 8 MiB worst cases.

    python -m bench.bench_metrics_parse [--runs 5]

The agent reads at most 8 MiB of /metrics and hands it to planner/metrics.py's
parse_kube_proxy_metrics; whatever answers on kube-proxy's metrics port decides
that text. The cases are tests/support/hostile_metrics.py's (the unit test asserts
each one's verdict and a bound on the parse's work; this prints the time), plus the
real kube-proxy v1.37.2 captures of tests/fixtures/metrics. Per case: its size and
lines, the median and the largest process CPU time of --runs parses, and the
outcome (the facts, or the refusal that the gate reports as InvalidMetrics).
Pure Python, one core, no root.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from proxyshift.planner.metrics import MetricsError, parse_kube_proxy_metrics
from tests.support.hostile_metrics import WORST_CASES

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "metrics"


def one(text: str) -> tuple[float, str]:
    """CPU seconds of one parse, and its outcome in a few words."""
    started = time.process_time()
    try:
        facts = parse_kube_proxy_metrics(text)
    except MetricsError as exc:
        outcome = f"refused: {exc}"
    else:
        outcome = f"parsed: sync_count={facts.sync_count}"
    return time.process_time() - started, outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="parses per case (median and max printed)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    cases: list[tuple[str, Callable[[], str]]] = [
        (f"real: {path.name}", path.read_text) for path in sorted(FIXTURES.glob("*.txt"))]
    cases += [(name, build) for name, (build, _) in WORST_CASES.items()]
    print(f"{'case':<58} {'bytes':>9} {'lines':>9} {'median s':>9} {'max s':>7}  outcome")
    for name, build in cases:
        text = build()
        times, outcome = [], ""
        for _ in range(args.runs):
            took, outcome = one(text)
            times.append(took)
        print(f"{name:<58} {len(text):>9} {text.count(chr(10)):>9} {statistics.median(times):>9.3f} "
              f"{max(times):>7.3f}  {outcome[:70]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
