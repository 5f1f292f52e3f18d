"""Time to flush kube-proxy's ipvs-mode objects for 1k/5k Services, inside the QEMU guest.

    sudo python -m bench.bench_flush_ipvs [--sizes 1000,5000] [--runs 1] [--kube-proxy PATH]

This machine's kernel has no IPVS, so on the host the script boots the QEMU
guest (localcluster.vm) and runs itself there (`--inside`). Each run
is a fresh network namespace holding an ipvs-mode node state for N Services
(kube-ipvs0 with N ClusterIPs, N virtual servers with two real servers each,
every fourth Service also a NodePort on the node address, the KUBE-* sets with
their members, the ipvs-mode chains) plus a user's own four virtual servers and
a set called KUBE-ALLOWED; then it times one of:

  agent       proxyshift's flush(["iptables", "ipvs"], "nftables")
  kube-proxy  `kube-proxy --cleanup` (the real binary)

and checks whether the user's virtual servers and set survived. The guest is
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


def user_objects(ns: Netns) -> tuple[list[str], bool]:
    services = [line for line in ns.run(["ipvsadm", "-Sn"], timeout=300).stdout.splitlines()
                if line.startswith("-A") and ("198.18.200.1" in line or "-f 7" in line or ":31999" in line)]
    return services, "KUBE-ALLOWED" in ns.run(["ipset", "list", "-n"]).stdout.split()


def by_agent(ns: Netns, _: Path) -> None:
    report = flush(["iptables", "ipvs"], "nftables", runner=ns.run, iptables_tools=[IptablesTool("ipv4", "nft")])
    if not report.ok:
        raise RuntimeError(report.message())


def by_kube_proxy(ns: Netns, kube_proxy: Path) -> None:
    # Its exit code is reported, not fatal: the point is what it removed and how long it took.
    done = subprocess.run(["ip", "netns", "exec", ns.name, str(kube_proxy), "--cleanup"], capture_output=True,
                          text=True, timeout=900, check=False)
    if done.returncode:
        errors = [line[:240] for line in done.stderr.splitlines() if line.startswith("E")]
        print(f"  kube-proxy --cleanup exited {done.returncode}: {errors[-3:]}", file=sys.stderr, flush=True)


METHODS: dict[str, Callable[[Netns, Path], None]] = {"agent": by_agent, "kube-proxy": by_kube_proxy}


def inside(sizes: list[int], runs: int, kube_proxy: Path) -> int:
    subprocess.run(["modprobe", "ip_vs"], check=True, timeout=60)
    rows = []
    for size in sizes:
        for name, method in METHODS.items():
            times, kept = [], True
            for _ in range(runs):
                ns = Netns()
                try:
                    started = time.perf_counter()
                    load(ns, size)
                    print(f"  {size} services loaded in {time.perf_counter() - started:.1f}s", file=sys.stderr,
                          flush=True)
                    start = time.perf_counter()
                    method(ns, kube_proxy)
                    times.append(time.perf_counter() - start)
                    services, user_set = user_objects(ns)
                    kept = kept and len(services) == 4 and user_set
                finally:
                    ns.delete()
            rows.append((size, name, statistics.median(times), "yes" if kept else "NO"))
            print(f"  {size} services, {name}: {statistics.median(times):.2f}s", file=sys.stderr, flush=True)
    release = Path("/proc/sys/kernel/osrelease").read_text().strip()
    print(f"\nin the QEMU guest (TCG), kernel {release}; median of {runs} run(s); ratios only\n")
    print("| services | method | median seconds (emulated) | vs agent | user's virtual servers + set kept |")
    print("|---:|---|---:|---:|---|")
    for size, name, median, verdict in rows:
        agent = next(m for s, n, m, _ in rows if s == size and n == "agent")
        print(f"| {size} | {name} | {median:.2f} | {median / agent:.1f}x | {verdict} |")
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

    result = vm.run_in_vm([sys.executable, "-m", "bench.bench_flush_ipvs", "--inside", "--sizes", args.sizes,
                           "--runs", str(args.runs), "--kube-proxy", str(kube_proxy)],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "operator"), "PYTHONUNBUFFERED": "1"},
                          timeout=3600, stream=sys.stdout)
    return result.returncode if result.returncode is not None else 1


if __name__ == "__main__":
    sys.exit(main())
