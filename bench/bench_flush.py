"""Time to flush kube-proxy's iptables-mode rules for 1k/5k/10k Services, three ways.

    sudo python -m bench.bench_flush [--sizes 1000,5000,10000] [--runs 3] [--kube-proxy PATH]

Each run loads a fresh network namespace with kubelet's chains, a user's own
rules and kube-proxy's iptables-mode rules (tests/support/kp_rules.py), then
times one of:

  agent       proxyshift's surgical flush (one iptables-save, one
              iptables-restore --noflush, one verifying iptables-save)
  kube-proxy  `kube-proxy --cleanup` (the real binary)
  grep        `iptables-save | grep -v KUBE | iptables-restore`, as three
              argument-list processes joined by pipes (no shell)

and checks whether every non-kube-proxy line (the user's and kubelet's)
survived, against a reference namespace that never had kube-proxy's rules.
Prints a table of medians. Needs root; IPv4, nf_tables backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from localcluster.build import build
from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, merge_restore, user_rules
from tests.support.ps_netns import Netns

ROOT = Path(__file__).resolve().parents[1]


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def load(ns: Netns, rules: str | None) -> None:
    # One plain restore into the empty namespace (see merge_restore: --noflush loads are quadratic).
    before, after = user_rules()
    ns.run(["iptables-nft-restore"], input=merge_restore(kubelet_rules(), before, rules or "", after), timeout=900)


def by_agent(ns: Netns, _: Path) -> None:
    report = flush(["iptables", "ipvs"], "nftables", runner=ns.run, iptables_tools=[IptablesTool("ipv4", "nft")])
    if not report.ok:
        raise RuntimeError(report.message())


def by_kube_proxy(ns: Netns, kube_proxy: Path) -> None:
    subprocess.run(["ip", "netns", "exec", ns.name, str(kube_proxy), "--cleanup"], check=True,
                   capture_output=True, timeout=600)


def by_grep(ns: Netns, _: Path) -> None:
    prefix = ["ip", "netns", "exec", ns.name]
    save = subprocess.Popen([*prefix, "iptables-nft-save"], stdout=subprocess.PIPE)
    grep = subprocess.Popen(["grep", "-v", "KUBE"], stdin=save.stdout, stdout=subprocess.PIPE)
    assert save.stdout is not None
    save.stdout.close()  # grep owns the pipe now: save gets SIGPIPE if grep dies
    restore = subprocess.Popen([*prefix, "iptables-nft-restore"], stdin=grep.stdout)
    assert grep.stdout is not None
    grep.stdout.close()
    if restore.wait(timeout=600) or save.wait(timeout=60) or grep.wait(timeout=60) not in (0, 1):
        raise RuntimeError("iptables-save | grep -v KUBE | iptables-restore failed")


METHODS: dict[str, Callable[[Netns, Path], None]] = {"agent": by_agent, "kube-proxy": by_kube_proxy,
                                                     "grep": by_grep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,5000,10000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kube-proxy", type=Path, default=None,
                   help="default: the local cluster build's (localcluster.build, built if missing)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables)", file=sys.stderr)
        return 2
    # The build's own cache folder, never a guessed path: a missing binary used to drop the kube-proxy
    # column without a word, so the table that compares against it compared against nothing.
    kube_proxy = args.kube_proxy or build() / "kube-proxy"
    if not kube_proxy.is_file():
        print(f"no kube-proxy binary at {kube_proxy}", file=sys.stderr)
        return 2
    methods = dict(METHODS)
    ref = Netns()
    try:
        load(ref, None)
        expected = body(ref.save())
    finally:
        ref.delete()

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        rules = iptables_mode_rules(size)
        lines = rules.count("\n-A ") + rules.count("\n:")
        for name, method in methods.items():
            times, intact = [], True
            for _ in range(args.runs):
                ns = Netns()
                try:
                    load(ns, rules)
                    start = time.perf_counter()
                    method(ns, kube_proxy)
                    times.append(time.perf_counter() - start)
                    after = body(ns.save())
                    intact = intact and after == expected
                finally:
                    ns.delete()
            rows.append((size, lines, name, statistics.median(times), "yes" if intact else "NO"))
            print(f"  {size} services, {name}: {statistics.median(times):.3f}s", file=sys.stderr)

    version = subprocess.run(["iptables", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"\nmedian of {args.runs} runs; {version}; {os.cpu_count()} CPUs\n")
    print("| services | kube-proxy lines | method | median seconds | user + kubelet rules intact |")
    print("|---:|---:|---|---:|---|")
    for size, lines, name, median, verdict in rows:
        print(f"| {size} | {lines} | {name} | {median:.3f} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
