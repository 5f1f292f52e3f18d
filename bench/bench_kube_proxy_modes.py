"""What the move buys: the real kube-proxy in iptables and in nftables mode, side by side.

    sudo nice -n 19 python -m bench.bench_kube_proxy_modes [--services 1000,5000,10000] [--runs 3]
        [--changes 5] [--kube-proxy PATH] [--json OUT]

For each size and run, each mode gets a fresh network namespace (ps-bench-*)
holding a live fake API server (bench/harness/live_apiserver.py, built on
tests/support/fake_apiserver.py) that serves N Services of 3 endpoints each
(every 4th a NodePort), and the real kube-proxy v1.37.2 (config from
tests/support/kube_proxy_runner.py, minSyncPeriod 0s). Measured, all from
kube-proxy's own /metrics parsed with prometheus_client:

  full sync     kubeproxy_sync_full_proxy_rules_duration_seconds of the first
                (cold, startup) full sync
  partial sync  kubeproxy_sync_partial_proxy_rules_duration_seconds, mean over
                the syncs the EndpointSlice changes caused
  programming   kubeproxy_network_programming_duration_seconds per change: from
                the change's endpoints.kubernetes.io/last-change-trigger-time
                (stamped by the fake when it sends the MODIFIED event) to the
                rules being in the kernel; after the changes, the last new
                endpoint IP is looked up in the kernel's rules as a check
  objects       iptables: `iptables-save` lines (IPv4, all tables); nftables:
                rules, chains, sets/maps and their elements in
                `nft -j list table ip kube-proxy`

Prints medians over runs and the nftables/iptables ratios. The modes alternate
inside each run so that load from other work on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

from localcluster.build import build
from proxyshift.commands import run, stop_child
from tests.support.kube_proxy_runner import API_PORT, CONFIG, KUBECONFIG
from tests.support.ps_netns import Netns

ROOT = Path(__file__).resolve().parents[1]

HARNESS = "bench.harness.live_apiserver"  # run with `-m` from ROOT
NODE, NODE_IP = "ps-node-1", "198.18.0.11"
FULL = "kubeproxy_sync_full_proxy_rules_duration_seconds"
PARTIAL = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
PROGRAMMING = "kubeproxy_network_programming_duration_seconds"
MODES = ("iptables", "nftables")


class BenchNetns(Netns):
    """ps_netns.Netns named ps-bench-* (ps-test-* belongs to the dataplane tests)."""

    def __init__(self) -> None:
        self.name = f"ps-bench-{secrets.token_hex(4)}"
        run(["ip", "netns", "add", self.name])
        self.run = functools.partial(run, netns=self.name)


def histograms(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram of interest, summed over label sets (ip_family)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for base in (FULL, PARTIAL, PROGRAMMING):
                if s.name in (base + "_sum", base + "_count"):
                    acc = out.setdefault(base, [0.0, 0.0])
                    acc[0 if s.name.endswith("_sum") else 1] += float(s.value)
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass
class Sample:
    mode: str
    services: int
    full_sync: float = 0.0
    partial_sync: float = 0.0
    programming: list[float] = field(default_factory=list)
    objects: dict[str, int] = field(default_factory=dict)
    programmed_in_kernel: bool = False
    timed_out: bool = False  # the first full sync did not finish within --sync-timeout


class Node:
    """A ps-bench namespace with the live fake API server and a real kube-proxy."""

    def __init__(self, workdir: Path, mode: str, services: int, binary: Path) -> None:
        self.ns = BenchNetns()
        self.dir, self.mode = workdir, mode
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []
        try:
            self.ns.run(["ip", "link", "set", "lo", "up"])
            self.ns.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"])
            (workdir / "kubeconfig").write_text(KUBECONFIG.format(port=API_PORT))
            # The runner's defaults for the fields CONFIG gained since (the ipvs scheduler, kube-proxy's own
            # conntrack sysctls): without them the format raised KeyError and make bench printed no table.
            (workdir / "config.yaml").write_text(CONFIG.format(mode=mode, dir=workdir, node=NODE, node_ip=NODE_IP,
                                                               scheduler="rr", conntrack_extra=""))
            prefix = ["ip", "netns", "exec", self.ns.name]
            api_log = self._log("apiserver.log")
            self.api = subprocess.Popen(
                [*prefix, sys.executable, "-m", HARNESS, "--port", str(API_PORT), "--node", NODE,
                 "--node-ip", NODE_IP, "--services", str(services), "--endpoints", "3"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=api_log, text=True, cwd=ROOT)
            self.procs.append(self.api)
            if not self.ask({"op": "noop"}, ready=True):
                raise RuntimeError(f"fake API server did not start; see {workdir / 'apiserver.log'}")
            self.kp = subprocess.Popen([*prefix, str(binary), "--config", str(workdir / "config.yaml"), "--v=1"],
                                       stdout=self._log("kube-proxy.log"), stderr=subprocess.STDOUT, text=True)
            self.procs.append(self.kp)
        except BaseException:
            self.stop()
            raise

    def _log(self, name: str) -> IO[str]:
        f = open(self.dir / name, "w")  # noqa: SIM115 - closed in stop()
        self.logs.append(f)
        return f

    def ask(self, cmd: dict[str, Any], *, ready: bool = False) -> dict[str, Any]:
        assert self.api.stdin is not None and self.api.stdout is not None
        if not ready:
            self.api.stdin.write(json.dumps(cmd) + "\n")
            self.api.stdin.flush()
        line = self.api.stdout.readline()
        if not line:
            raise RuntimeError(f"fake API server exited; see {self.dir / 'apiserver.log'}")
        return json.loads(line)

    def hist(self) -> dict[str, tuple[float, float]]:
        answer = self.ask({"op": "metrics"})
        return histograms(answer["text"]) if answer.get("ok") else {}

    def wait(self, name: str, count: float, timeout: float) -> dict[str, tuple[float, float]]:
        """Poll /metrics until histogram `name` has at least `count` observations."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kp.poll() is not None:
                raise RuntimeError(f"kube-proxy exited {self.kp.returncode}; see {self.dir / 'kube-proxy.log'}")
            h = self.hist()
            if h.get(name, (0.0, 0.0))[1] >= count:
                return h
            time.sleep(0.2)
        raise TimeoutError(f"{self.mode}: {name} did not reach {count} in {timeout:g}s; see {self.dir}")

    def objects(self) -> tuple[dict[str, int], str]:
        if self.mode == "iptables":
            text = self.ns.run(["iptables-save"], timeout=300).stdout
            lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
            return {"lines": len(lines), "rules": sum(ln.startswith("-A ") for ln in lines),
                    "chains": sum(ln.startswith(":") for ln in lines)}, text
        text = self.ns.run(["nft", "-j", "list", "table", "ip", "kube-proxy"], timeout=300).stdout
        counts = {"rules": 0, "chains": 0, "sets": 0, "elements": 0}
        for obj in json.loads(text)["nftables"]:
            for kind in ("rule", "chain"):
                if kind in obj:
                    counts[kind + "s"] += 1
            for kind in ("set", "map"):
                if kind in obj:
                    counts["sets"] += 1
                    counts["elements"] += len(obj[kind].get("elem", []))
        return counts, text

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_child(proc)
        for f in self.logs:
            f.close()
        self.ns.delete()


def measure(mode: str, services: int, changes: int, binary: Path, workdir: Path, sync_timeout: float) -> Sample:
    sample = Sample(mode, services)
    node = Node(workdir, mode, services, binary)
    try:
        try:
            h = node.wait(FULL, 1, timeout=sync_timeout)
        except TimeoutError:
            # A result too: this mode cannot sync this size within the bound. Recorded, not fatal.
            sample.full_sync, sample.timed_out = sync_timeout, True
            return sample
        sample.full_sync = h[FULL][0] / h[FULL][1]
        time.sleep(1.0)  # let the startup's follow-up syncs (if any) pass before the timed changes
        before = node.hist()
        ip = ""
        for k in range(changes):
            time.sleep(1.0)  # each change on its own: no batching with the previous one's sync
            prog_before = node.hist().get(PROGRAMMING, (0.0, 0.0))
            ip = node.ask({"op": "change", "service": (k * 7919) % services})["ip"]
            after = node.wait(PROGRAMMING, prog_before[1] + 1, timeout=120)[PROGRAMMING]
            # One change, one observation: the sum's delta is this change's own latency.
            sample.programming.append((after[0] - prog_before[0]) / (after[1] - prog_before[1]))
        end = node.hist()
        p0, p1 = before.get(PARTIAL, (0.0, 0.0)), end.get(PARTIAL, (0.0, 0.0))
        if p1[1] > p0[1]:
            sample.partial_sync = (p1[0] - p0[0]) / (p1[1] - p0[1])
        sample.objects, text = node.objects()
        sample.programmed_in_kernel = not ip or ip in text
    finally:
        node.stop()
    return sample


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(samples: list[Sample]) -> str:
    rows = ["| services | mode | full sync s | partial sync s | programming p50 s | objects | in kernel |",
            "|---:|---|---:|---:|---:|---|---|"]
    ratios = ["", "| services | full sync iptables/nftables | partial sync iptables/nftables | "
              "programming iptables/nftables |", "|---:|---:|---:|---:|"]
    for size in sorted({s.services for s in samples}):
        per: dict[str, tuple[float, float, float]] = {}
        for mode in MODES:
            ss = [s for s in samples if s.services == size and s.mode == mode]
            if not ss:
                continue
            full = med([s.full_sync for s in ss])
            if any(s.timed_out for s in ss):
                rows.append(f"| {size} | {mode} | > {max(s.full_sync for s in ss):.0f} (timed out in "
                            f"{sum(s.timed_out for s in ss)} of {len(ss)} runs) | | | | |")
                continue
            part = med([s.partial_sync for s in ss])
            prog = med([p for s in ss for p in s.programming])
            per[mode] = (full, part, prog)
            objs = ", ".join(f"{k} {v}" for k, v in ss[-1].objects.items())
            rows.append(f"| {size} | {mode} | {full:.3f} | {part:.4f} | {prog:.4f} | {objs} | "
                        f"{'yes' if all(s.programmed_in_kernel for s in ss) else 'NO'} |")
        if len(per) == 2:
            a, b = per["iptables"], per["nftables"]
            ratios.append(f"| {size} | {a[0] / b[0]:.2f}x | {a[1] / b[1]:.2f}x | {a[2] / b[2]:.2f}x |")
    return "\n".join(rows + ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", default="1000,5000,10000", help="comma-separated sizes")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--changes", type=int, default=5, help="EndpointSlice changes timed per run")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--sync-timeout", type=float, default=600, help="seconds to wait for the first full sync")
    p.add_argument("--kube-proxy", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables, nft)", file=sys.stderr)
        return 2
    os.nice(max(0, 19 - os.nice(0)))  # a benchmark must never outrank other work on the machine
    # The local cluster build's (built if missing): the same binary on every machine that runs this.
    binary = args.kube_proxy or build() / "kube-proxy"
    workdir = args.workdir or Path(f"/tmp/ps-bench-modes-{os.getpid()}")
    modes = args.modes.split(",")
    samples: list[Sample] = []
    for size in [int(s) for s in args.services.split(",")]:
        for r in range(args.runs):
            # Alternate which mode goes first so a burst of outside load does not favour one.
            for mode in modes if r % 2 == 0 else list(reversed(modes)):
                s = measure(mode, size, args.changes, binary, workdir / f"{size}-{mode}-{r}", args.sync_timeout)
                samples.append(s)
                print(f"  {size} services, {mode}, run {r + 1}: full {s.full_sync:.3f}s, partial "
                      f"{s.partial_sync:.4f}s, programming {[round(x, 4) for x in s.programming]}, {s.objects}",
                      file=sys.stderr, flush=True)
                if args.json:
                    args.json.write_text(json.dumps([asdict(x) for x in samples], indent=1))
    print(table(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
