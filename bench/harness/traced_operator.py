"""The operator under tracemalloc, for bench_controller_scale.py --tracemalloc: where its memory goes.

    python -m bench.harness.traced_operator SNAPSHOT_DIR -- operator --standalone ...

Not the product: it starts tracemalloc (a few frames per allocation), then runs `proxyshift` with the
arguments after `--`. A snapshot is written to SNAPSHOT_DIR every INTERVAL seconds (the newest kept as
`latest.snap`) and on SIGUSR1 (`usr1-<n>.snap`), so the bench can take one at the policy's Ready while
the operator still holds everything. tracemalloc costs CPU and memory of its own: RSS and converge
times of a traced run are not the bench's numbers.

    python -m bench.harness.traced_operator --report SNAPSHOT [BASE]

prints the largest allocation sites (and, with BASE, what grew since it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import tracemalloc
from pathlib import Path
from types import FrameType

FRAMES = 6
INTERVAL = 60.0
TOP = 30


def _dump(folder: Path, name: str) -> None:
    tmp = folder / f".{name}.tmp"
    tracemalloc.take_snapshot().dump(str(tmp))
    tmp.replace(folder / name)


def _periodic(folder: Path, stop: threading.Event) -> None:
    while not stop.wait(INTERVAL):
        _dump(folder, "latest.snap")


def run(folder: Path, argv: list[str]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(FRAMES)
    count = 0

    def on_usr1(_sig: int, _frame: FrameType | None) -> None:
        nonlocal count
        count += 1
        _dump(folder, f"usr1-{count}.snap")

    signal.signal(signal.SIGUSR1, on_usr1)
    stop = threading.Event()
    threading.Thread(target=_periodic, args=(folder, stop), daemon=True, name="tracemalloc").start()
    from proxyshift.cli import main

    try:
        return main(argv)
    finally:
        stop.set()


def _filtered(snap: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    return snap.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__),
                               tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")])


def report(path: Path, base: Path | None = None, top: int = TOP) -> str:
    snap = _filtered(tracemalloc.Snapshot.load(str(path)))
    total = sum(s.size for s in snap.statistics("filename"))
    lines = [f"{path}: {total / 2**20:.1f} MiB traced"]
    if base is not None:
        old = _filtered(tracemalloc.Snapshot.load(str(base)))
        lines.append(f"grown since {base}, by line:")
        for diff in snap.compare_to(old, "lineno")[:top]:
            lines.append(f"  {diff.size_diff / 2**20:+8.2f} MiB {diff.count_diff:+9d}  {diff.traceback[0]}")
    lines.append("by file:")
    for stat in snap.statistics("filename")[:top]:
        lines.append(f"  {stat.size / 2**20:8.2f} MiB {stat.count:9d}  {stat.traceback[0].filename}")
    lines.append("by line:")
    for stat in snap.statistics("lineno")[:top]:
        lines.append(f"  {stat.size / 2**20:8.2f} MiB {stat.count:9d}  {stat.traceback[0]}")
    lines.append(f"by allocation site ({FRAMES} frames), the largest {top // 3}:")
    for stat in snap.statistics("traceback")[: top // 3]:
        lines.append(f"  {stat.size / 2**20:8.2f} MiB {stat.count:9d}")
        lines += [f"      {frame}" for frame in stat.traceback.format(most_recent_first=True)[::2]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--report":
        p = argparse.ArgumentParser(prog="traced_operator --report")
        p.add_argument("snapshot", type=Path)
        p.add_argument("base", type=Path, nargs="?")
        p.add_argument("--top", type=int, default=TOP)
        ns = p.parse_args(args[1:])
        print(report(ns.snapshot, ns.base, ns.top))
        return 0
    if len(args) < 2 or "--" not in args:
        print(__doc__, file=sys.stderr)
        return 2
    split = args.index("--")
    return run(Path(args[0]), args[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
