"""Time to flush kube-proxy's ipvs-mode objects for 1k/5k Services, inside the QEMU guest.

    flock /var/lock/proxyshift-localcluster.lock .venv/bin/python -m bench.bench_flush_ipvs [--sizes 1000,5000]
        [--runs 1] [--kube-proxy PATH]

(as root, under the lock every QEMU or local-cluster run on a shared machine takes)

This machine's kernel has no IPVS, so on the host the script boots the QEMU
guest (localcluster.vm) and runs itself there (`--inside`). Each run
is a fresh network namespace holding an ipvs-mode node state for N Services
(kube-ipvs0 with N ClusterIPs, N virtual servers with two real servers each,
every fourth Service also a NodePort on the node address, the KUBE-* sets with
their members, the ipvs-mode chains) plus a user's own four virtual servers and
a set called KUBE-ALLOWED; then it times one of:

  agent       proxyshift's flush(["iptables", "ipvs"], "nftables")
  kube-proxy  `kube-proxy --cleanup` (the real binary)

and checks, after each run, which of kube-proxy's objects are left and whether
the user's virtual servers and set survived. kube-proxy's exit code is recorded
per run: v1.37.2's `--cleanup` exits 1 on every ipvs-mode node (its iptables-mode
step deletes KUBE-MARK-MASQ in one nat transaction while the ipvs-mode chains
still jump to it; its ipvs-mode step then removes those chains one by one), so
a cell where it failed is printed as "exit N after S", never as a plain time,
and the "left" column says whether the removal was complete anyway. The guest is
emulated (TCG, 15-30x slower than the host for most programs), so only the
ratio between the two columns means anything.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from localcluster.build import build
from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from tests.support.kp_rules import ipvs_mode_rules
from tests.support.ps_netns import Netns

ROOT = Path(__file__).resolve().parents[1]

NODE_IP = "198.18.0.11"
USER_IPVS = ("-A -t 198.18.200.1:80 -s wlc\n-a -t 198.18.200.1:80 -r 198.18.17.1:8080 -m -w 3\n"
             "-A -u 198.18.200.1:53 -s rr -p 600\n-A -f 7 -s sh\n-A -t 198.18.0.11:31999 -s rr\n")
USER_SETS = "create KUBE-ALLOWED hash:ip family inet hashsize 1024 maxelem 65536\nadd KUBE-ALLOWED 198.18.5.5\n"


def cluster_ip(i: int) -> str:
    return str(ipaddress.IPv4Address("198.19.0.10") + i)


def endpoint(i: int) -> str:
    return str(ipaddress.IPv4Address("198.18.32.0") + i)


def load(ns: Netns, services: int) -> None:
    """An ipvs-mode node for `services` Services, plus the user's objects; each tool loaded in one call."""
    ns.run(["ip", "link", "set", "lo", "up"])
    ns.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"])
    ns.run(["ip", "link", "add", "kube-ipvs0", "type", "dummy"])
    ns.run(["ip", "-batch", "-"], input="".join(f"addr add {cluster_ip(i)}/32 dev kube-ipvs0\n"
                                                for i in range(services)), timeout=900)
    vs, sets = [], ["create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536",
                    "create KUBE-LOOP-BACK hash:ip,port,ip family inet hashsize 1024 maxelem 65536",
                    "create KUBE-IPVS-IPS hash:ip family inet hashsize 1024 maxelem 65536",
                    "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535"]
    for i in range(services):
        ip = cluster_ip(i)
        vs.append(f"-A -t {ip}:80 -s rr")
        vs += [f"-a -t {ip}:80 -r {endpoint(2 * i + k)}:8080 -m -w 1" for k in range(2)]
        sets += [f"add KUBE-CLUSTER-IP {ip},tcp:80", f"add KUBE-IPVS-IPS {ip}"]
        if i % 4 == 0:
            vs += [f"-A -t {NODE_IP}:{30000 + i} -s rr", f"-a -t {NODE_IP}:{30000 + i} -r {endpoint(2 * i)}:8080 -m"]
            sets.append(f"add KUBE-NODE-PORT-TCP {30000 + i}")
    ns.run(["ipvsadm", "-R"], input="\n".join(vs) + "\n" + USER_IPVS, timeout=900)
    ns.run(["ipset", "restore"], input="\n".join(sets) + "\n" + USER_SETS, timeout=900)
    ns.restore(ipvs_mode_rules())


USER_SET_NAMES = {"KUBE-ALLOWED"}


def user_objects(ns: Netns) -> tuple[list[str], bool]:
    services = [line for line in ns.run(["ipvsadm", "-Sn"], timeout=300).stdout.splitlines()
                if line.startswith("-A") and ("198.18.200.1" in line or "-f 7" in line or ":31999" in line)]
    return services, "KUBE-ALLOWED" in ns.run(["ipset", "list", "-n"]).stdout.split()


def leftovers(ns: Netns, user_services: int) -> list[str]:
    """What of kube-proxy's ipvs-mode state is still there; empty when the removal was complete.

    Checked for both methods, because an exit code alone says neither that a
    cleanup which exited 0 removed everything nor that one which exited 1 did not.
    """
    left = []
    virtual = sum(line.startswith("-A") for line in ns.run(["ipvsadm", "-Sn"], timeout=300).stdout.splitlines())
    if virtual > user_services:
        left.append(f"{virtual - user_services} virtual servers")
    if ns.run(["ip", "link", "show", "kube-ipvs0"], check=False).returncode == 0:
        left.append("kube-ipvs0")
    sets = [name for name in ns.run(["ipset", "list", "-n"]).stdout.split()
            if name.startswith("KUBE-") and name not in USER_SET_NAMES]
    if sets:
        left.append(f"{len(sets)} sets")
    chains = [line for line in ns.save().splitlines() if line.startswith(":KUBE-")]
    if chains:
        left.append(f"{len(chains)} chains")
    return left


def by_agent(ns: Netns, _: Path) -> tuple[int, str]:
    report = flush(["iptables", "ipvs"], "nftables", runner=ns.run, iptables_tools=[IptablesTool("ipv4", "nft")])
    return (0, "") if report.ok else (1, report.message())


def by_kube_proxy(ns: Netns, kube_proxy: Path) -> tuple[int, str]:
    # Its exit code is recorded, not fatal: the table marks the cell, and `leftovers` says what it removed.
    done = subprocess.run(["ip", "netns", "exec", ns.name, str(kube_proxy), "--cleanup"], capture_output=True,
                          text=True, timeout=900, check=False)
    errors = [line[:300] for line in done.stderr.splitlines() if line.startswith(("E", "\t"))]
    return done.returncode, " | ".join(errors)


METHODS: dict[str, Callable[[Netns, Path], tuple[int, str]]] = {"agent": by_agent, "kube-proxy": by_kube_proxy}


@dataclass
class Cell:
    size: int
    method: str
    seconds: list[float] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # the union over the runs
    kept: bool = True
    error: str = ""  # the first failed run's error lines

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def failed(self) -> bool:
        return any(self.exits)


def table(cells: list[Cell]) -> list[str]:
    """Markdown rows; a cell with any non-zero exit shows its exit, its time only as "after", its ratio bracketed."""
    rows = ["| services | method | exit codes | median seconds (emulated) | runs' range | vs agent "
            "| kube-proxy's objects left | user's virtual servers + set kept |",
            "|---:|---|---|---:|---:|---:|---|---|"]
    for cell in cells:
        agent = next(c for c in cells if c.size == cell.size and c.method == "agent")
        ratio = f"{cell.median / agent.median:.1f}x"
        worst = max(cell.exits, key=abs)
        seconds = f"exit {worst} after {cell.median:.2f}" if cell.failed else f"{cell.median:.2f}"
        spread = f"{min(cell.seconds):.2f}-{max(cell.seconds):.2f}"
        rows.append(f"| {cell.size} | {cell.method} | {','.join(map(str, cell.exits))} | {seconds} | {spread} | "
                    f"{f'({ratio})' if cell.failed or agent.failed else ratio} | {', '.join(cell.left) or 'none'} | "
                    f"{'yes' if cell.kept else 'NO'} |")
    return rows


def inside(sizes: list[int], runs: int, kube_proxy: Path) -> int:
    subprocess.run(["modprobe", "ip_vs"], check=True, timeout=60)
    user_services = USER_IPVS.count("-A ")
    cells = []
    for size in sizes:
        for name, method in METHODS.items():
            cell = Cell(size, name)
            for _ in range(runs):
                ns = Netns()
                try:
                    started = time.perf_counter()
                    load(ns, size)
                    print(f"  {size} services loaded in {time.perf_counter() - started:.1f}s", file=sys.stderr,
                          flush=True)
                    start = time.perf_counter()
                    code, error = method(ns, kube_proxy)
                    cell.seconds.append(time.perf_counter() - start)
                    cell.exits.append(code)
                    print(f"  {name}: {cell.seconds[-1]:.2f}s, exit {code}", file=sys.stderr, flush=True)
                    if code:
                        cell.error = cell.error or error
                        print(f"  {name} exited {code}: {error}", file=sys.stderr, flush=True)
                    services, user_set = user_objects(ns)
                    cell.kept = cell.kept and len(services) == user_services and user_set
                    cell.left += [item for item in leftovers(ns, len(services)) if item not in cell.left]
                finally:
                    ns.delete()
            cells.append(cell)
            print(f"  {size} services, {name}: {cell.median:.2f}s, exits {cell.exits}, left {cell.left or 'none'}",
                  file=sys.stderr, flush=True)
    release = Path("/proc/sys/kernel/osrelease").read_text().strip()
    print(f"\nin the QEMU guest (TCG), kernel {release}; median of {runs} run(s); ratios only\n")
    print("\n".join(table(cells)))
    for cell in cells:
        if cell.failed:
            print(f"\n{cell.size} {cell.method}, first failure: {cell.error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,5000")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--kube-proxy", type=Path, default=None)
    p.add_argument("--inside", action="store_true", help="already in the guest (set by the host side)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.inside:
        if args.kube_proxy is None:  # the host side always passes the one it found
            print("--inside needs --kube-proxy", file=sys.stderr)
            return 2
        return inside(sizes, args.runs, args.kube_proxy)
    # The local cluster build's (built if missing), never a guessed path: the table compares against it.
    kube_proxy = args.kube_proxy or build() / "kube-proxy"
    if os.geteuid() != 0:
        print("needs root (QEMU's shares of /, network namespaces in the guest)", file=sys.stderr)
        return 2
    from localcluster import vm

    # What docs/benchmarks.md quotes with the table: when, which code, which kube-proxy, how busy the host was.
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}, {version(kube_proxy)}, "
          f"host load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    result = vm.run_in_vm([sys.executable, "-m", "bench.bench_flush_ipvs", "--inside", "--sizes", args.sizes,
                           "--runs", str(args.runs), "--kube-proxy", str(kube_proxy)],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "operator"), "PYTHONUNBUFFERED": "1"},
                          timeout=3600, stream=sys.stdout)
    print(f"host load average {os.getloadavg()[0]:.1f} at the end, guest ran {result.seconds:.0f}s", flush=True)
    return result.returncode if result.returncode is not None else 1


def commit() -> str:
    """The checkout's short commit, "+changes" when tracked files differ from it (untracked ones don't count)."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=30, check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"], timeout=30, check=False).returncode
    return head + ("+changes" if dirty else "")


def version(kube_proxy: Path) -> str:
    done = subprocess.run([str(kube_proxy), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() or f"{kube_proxy} (no --version output)"


if __name__ == "__main__":
    sys.exit(main())
