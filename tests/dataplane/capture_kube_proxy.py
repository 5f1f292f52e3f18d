"""Record real kube-proxy output as test fixtures: /metrics per mode and the rules it writes.

    sudo python -m tests.dataplane.capture_kube_proxy [--services 30]   # from the repository root

Runs the real kube-proxy (kube_proxy_runner.find_kube_proxy) in a fresh
namespace against tests/support/fake_apiserver.py, once per mode, waits for its first rule
sync and writes:

    tests/fixtures/metrics/kube-proxy-<mode>-<version>.txt
    tests/fixtures/iptables/kube-proxy-<version>-iptables-<n>-services.save.txt
    tests/fixtures/nft/kube-proxy-<version>-ruleset.nft
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.kube_proxy_runner import KubeProxy, find_kube_proxy
from tests.support.ps_netns import Netns

HERE = Path(__file__).resolve().parent

FIX = HERE.parent / "fixtures"


def strip_timestamps(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# ")) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--services", type=int, default=30)
    args = p.parse_args(argv)
    binary = find_kube_proxy()
    if binary is None:
        print("no kube-proxy binary", file=sys.stderr)
        return 2
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout.split()[-1]
    for mode in ("iptables", "nftables"):
        ns = Netns()
        kp = None
        try:
            with tempfile.TemporaryDirectory() as tmp:
                kp = KubeProxy(ns, Path(tmp), mode, services=args.services, binary=binary)
                answer = kp.wait_synced(1)
                kp.stop()
                kp = None
            header = (f"# Captured from the real kube-proxy {version} ({mode} mode, {args.services} Services, "
                      "first sync) by tests/dataplane/capture_kube_proxy.py\n")
            (FIX / "metrics" / f"kube-proxy-{mode}-{version}.txt").write_text(header + answer["metrics"])
            if mode == "iptables":
                out = FIX / "iptables" / f"kube-proxy-{version}-iptables-{args.services}-services.save.txt"
                out.write_text(strip_timestamps(ns.save()))
            else:
                out = FIX / "nft" / f"kube-proxy-{version}-ruleset.nft"
                out.write_text(ns.run(["nft", "list", "ruleset"]).stdout)
            print(f"{mode}: {answer['facts']}")
        finally:
            if kp is not None:
                kp.stop()
            ns.delete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
