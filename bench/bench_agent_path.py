"""The agent's own time on a node's switch: the preflight (with its rule hold) and the path after the sync.

    sudo python -m bench.bench_agent_path [--services 20,1000] [--runs 5]

Each run makes a fresh network namespace shaped like a node in the middle of an iptables -> nftables
migration (tests/support/kp_rules.py): kubelet's chains, a user's own rules and kube-proxy's iptables-mode
rules, IPv4 and IPv6. Inside it (a child process under `ip netns exec`, so every command the agent runs is
the plain argument list it runs on a node, with no `ip netns exec` of its own), the real agent loop
(agent/loop.py, with KernelNodeEffects) runs, with only kube-proxy's HTTP endpoints answered from memory:

  preflight   a Preflight operation for nftables that also makes the rule hold, timed after the agent's
              start-up read of the node's facts (as in the agent: node_facts() runs once at its start)
  post-sync   a gate Probe whose kube-proxy has just synced, with the in-gate cleanup of iptables mode:
              the hold's release, the flush and the inventory after it (the conntrack step and the connects
              are left out: the Probe asks for neither here)

Before the post-sync step kube-proxy's own start is played: scenario `clean` removes iptables mode's chains
as an nftables kube-proxy does at its start (so the flush finds only the hold), `stale` leaves them (the flush
removes them and the hold in one round). Then the nftables kube-proxy's tables are loaded.

Every command is counted (subprocess.run, which proxyshift.commands.run calls). After the post-sync step the
run checks the node: no hold chain, no iptables-mode chain, the user's rules intact. Prints a table of medians.
Needs root.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("clean", "stale")


def _inside(services: int, scenario: str) -> dict[str, Any]:
    """Runs in the namespace: the agent's steps, timed and counted."""
    from proxyshift.agent import probe as probe_mod
    from proxyshift.agent.effects import KernelNodeEffects
    from proxyshift.agent.flush import flush
    from proxyshift.agent.iptables_save import parse
    from proxyshift.agent.loop import Agent, AgentConfig
    from proxyshift.api.proxynode import (
        CleanupParams,
        HoldParams,
        KubeProxyFacts,
        Operation,
        PreflightParams,
        ProbeParams,
    )
    from tests.support.kp_rules import nftables_mode_ruleset

    calls: list[str] = []
    lock = threading.Lock()
    real = subprocess.run

    def counted(argv: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            calls.append(" ".join(argv[:2]) if argv[0] == "nft" else os.path.basename(argv[0]))
        return real(argv, *args, **kwargs)

    subprocess.run = counted  # type: ignore[assignment]  # proxyshift.commands.run looks it up at each call

    now = time.time()
    kube_proxy = {"start": now - 3600.0}

    class BenchEffects(KernelNodeEffects):
        """The real node, but kube-proxy's endpoints from memory: the old process, then the new one, synced."""

        def probe(self) -> KubeProxyFacts:
            start = kube_proxy["start"]
            return KubeProxyFacts(proxy_mode="nftables" if start > now else "iptables", healthz_status=200,
                                  process_start_time=start, last_sync_timestamp=start + 1.0, sync_count=1)

        def health(self) -> probe_mod.KubeProxyHealth:
            return probe_mod.KubeProxyHealth(200, None)

    class NoAPI:
        """The steps timed here write nothing; the agent's API is never reached."""

        def get(self, name: str) -> dict[str, Any] | None:
            return None

        def watch(self, name: str, resource_version: str | None,
                  timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
            return iter(())

        def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
            return {}

    agent = Agent(AgentConfig(node="bench"), NoAPI(), BenchEffects())
    # What the agent reads once at its start (its first tick): the node's facts and an inventory.
    agent.node_facts()
    agent.observe(inventory=True)
    out: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> Any:
        del calls[:]
        began = time.perf_counter()
        result = fn()
        out[name] = {"seconds": time.perf_counter() - began, "commands": list(calls)}
        return result

    pre = Operation.request("m1.Preflight.0", PreflightParams(
        mode="nftables", hold=HoldParams(from_mode="iptables", to_mode="nftables")))
    status, _ = timed("preflight", lambda: agent._run_preflight(pre, "now"))
    if status.state != "Succeeded" or agent.hold is None:
        raise RuntimeError(f"preflight: {status.message}")

    # kube-proxy's restart in nftables mode: its start-up cleanup (clean), then its first sync.
    if scenario == "clean":
        report = flush(["iptables"], "nftables")
        if not report.ok:
            raise RuntimeError(report.message())
    for family in ("ip", "ip6"):
        real(["nft", "-f", "-"], input=nftables_mode_ruleset(services, family=family), text=True, check=True,
             timeout=300)
    kube_proxy["start"] = time.time() + 1.0

    probe = Operation.request("m1.Probe.0", ProbeParams(
        await_mode="nftables", await_syncs=1, await_seconds=5.0,
        cleanup=CleanupParams(remove_modes=["iptables"], target_mode="nftables")))
    status, extra = timed("post-sync", lambda: agent._run_probe(probe, "now"))
    cleanup = (status.details or {}).get("cleanup") or {}
    if not cleanup.get("ok"):
        raise RuntimeError(f"post-sync: {status.message}")
    for stem in ("iptables", "ip6tables"):
        dump = parse(real([f"{stem}-nft-save"], capture_output=True, text=True, check=True, timeout=120).stdout)
        left = [c for t in dump.tables.values() for c in t.user_defined()
                if c.startswith("PSHOLD-") or c.startswith("KUBE-SVC-") or c == "KUBE-SERVICES"]
        if left:
            raise RuntimeError(f"{stem}: left after the cleanup: {left[:5]}")
    if agent.hold is not None or extra.get("leftovers"):
        raise RuntimeError(f"hold {agent.hold}, leftovers {extra.get('leftovers')}")
    out["message"] = status.message
    return out


def _run_one(services: int, scenario: str) -> dict[str, Any]:
    from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, user_rules
    from tests.support.ps_netns import Netns

    ns = Netns()
    try:
        for v6 in (False, True):
            before, after = user_rules(v6=v6)
            for text in (kubelet_rules(v6=v6), before, iptables_mode_rules(services, v6=v6), after):
                ns.restore(text, v6=v6)
        res = subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-m", "bench.bench_agent_path",
                              "--inside", "--services", str(services), "--scenario", scenario],
                             capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"the run inside {ns.name} failed: {res.stderr[-2000:]}")
        return dict(json.loads(res.stdout.strip().splitlines()[-1]))
    finally:
        ns.delete()


def _tally(commands: list[str]) -> str:
    counts = collections.Counter(commands)
    return ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", default="20,1000", help="Services per family, comma-separated")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scenario", default="clean", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inside:
        print(json.dumps(_inside(int(args.services), args.scenario)))
        return 0
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables, nft)", file=sys.stderr)
        return 2
    rows = []
    for services in [int(s) for s in args.services.split(",")]:
        for scenario in args.scenarios.split(","):
            runs = [_run_one(services, scenario) for _ in range(args.runs)]
            for stage in ("preflight", "post-sync"):
                if stage == "preflight" and scenario != SCENARIOS[0]:
                    continue  # the same preflight either way
                seconds = [r[stage]["seconds"] for r in runs]
                commands = runs[-1][stage]["commands"]
                rows.append((stage, services, scenario if stage == "post-sync" else "-", statistics.median(seconds),
                             min(seconds), max(seconds), len(commands), _tally(commands)))
                print(f"  {services} services, {scenario}, {stage}: {statistics.median(seconds):.3f}s",
                      file=sys.stderr)
            print(f"  last message: {runs[-1]['message']}", file=sys.stderr)
    print(f"\nmedian of {args.runs} runs; {os.cpu_count()} CPUs\n")
    print("| step | services | scenario | median s | min s | max s | commands | which |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for stage, services, scenario, median, lo, hi, n, which in rows:
        print(f"| {stage} | {services} | {scenario} | {median:.3f} | {lo:.3f} | {hi:.3f} | {n} | {which} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
