"""Soak: migrations back and forth iptables <-> nftables on all 3 nodes under continuous traffic (issue 8, item 4).

One policy selects every node; its mode is flipped PROXYSHIFT_SOAK_MIGRATIONS times (default 10,
about 16 s a flip here, so the whole reliability layer stays under 20 min; docs/reliability.md
records a 20-flip run), each flip a full rollout with
cordon+drain. TCP probes run through a ClusterIP from every node the whole time. Measured and
asserted:

- failed connections per flip and node (cordon+drain: 0);
- RSS of the operator and of each agent after every flip (/proc/<pid>/status): flat;
- after the soak, on every node, kube-proxy's chains and nft tables are exactly what one mode
  leaves (nothing accumulated), the same number of processes in the node's namespace, one
  kube-proxy and one agent process per node on the host, and the same network namespaces.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import StepInjector, agent_pid, container_pid, loss_facts
from test_faults import ALL_NODES, check_end_state, record, service_answers_everywhere

from localcluster import state
from proxyshift.commands import run
from tests.support.operator_harness import Harness, migration

pytestmark = pytest.mark.reliability

MIGRATIONS = int(os.environ.get("PROXYSHIFT_SOAK_MIGRATIONS", "10"))
GATE_TIMEOUT = 60
FLIP_TIMEOUT = 420
# RSS may grow by this much from the first flip (imports, caches, kopf's indexes warming up) to the last.
RSS_GROWTH_MIB = 15.0
TERMINAL = {"Done", "Failed", "RolledBack"}
KUBE_PROXY_TABLES = {"ip kube-proxy", "ip6 kube-proxy"}


def soak_policy(mode: str) -> dict[str, Any]:
    return {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "soak"},
            "spec": {"nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In",
                                                            "values": ["blue", "green"]}]},
                     "mode": mode, "rollout": {"maxUnavailable": 1, "cordon": True, "drain": True},
                     "gate": {"timeout": f"{GATE_TIMEOUT}s", "minSyncs": 1}}}


def rss_mib(pid: int | None) -> float | None:
    return state.rss_mib(pid) if pid else None


# Tools the agent runs for a moment (inventory, cleanup): not part of what may leak.
TRANSIENT = ("iptables", "ip6tables", "xtables", "nft", "ipset", "conntrack", "modprobe", "ip")


def node_processes(node: str) -> list[str]:
    """The long-lived processes in a node's network namespace, by command name."""
    names = []
    for pid in run(["ip", "netns", "pids", node]).stdout.split():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile: it was not long-lived
        if not comm.startswith(TRANSIENT):
            names.append(comm)
    return sorted(names)


def host_netns() -> list[str]:
    return sorted(line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines()
                  if line.startswith(("ps-node-", "ps-ep-")))


def snapshot(h: Harness, state_dir: Path) -> dict[str, Any]:
    return {
        "chains": {n: h.iptables_chains(n) for n in ALL_NODES},
        "tables": {n: h.nft_tables(n) for n in ALL_NODES},
        "processes": {n: node_processes(n) for n in ALL_NODES},
        "kube_proxy": {n: container_pid(state_dir, n, "kube-system", "kube-proxy-", "kube-proxy") is not None
                       for n in ALL_NODES},
        "netns": host_netns(),
    }


def all_ready(h: Harness, mode: str, generation: int) -> bool:
    body = h.get("soak") or {}
    status = body.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ready or status.get("observedGeneration") != generation:
        return False
    pns = h.proxynodes()
    return all(migration(pns[n]).get("phase") == "Done" and migration(pns[n]).get("toMode", mode) == mode
               for n in ALL_NODES)


# pyproject's 900 s per test is for one migration's worth of work; a soak scales with its count.
@pytest.mark.timeout(300 + MIGRATIONS * 120)
def test_soak_back_and_forth(harness: Harness, cluster: Any, kube: Any, test_service: Any,
                             tcp_probe: Callable[..., Any], continuous_prober: Callable[..., Any]) -> None:
    h = harness
    state_dir = cluster.require_local("soak")
    assert MIGRATIONS >= 2, "a soak needs at least one migration each way"
    service_answers_everywhere(h, tcp_probe, test_service)
    before = snapshot(h, state_dir)
    assert all(h.proxy_mode(n) == "iptables" for n in ALL_NODES)
    probers = {n: continuous_prober(n, test_service.cluster_ip, test_service.port, interval=0.1) for n in ALL_NODES}
    injector = StepInjector(kube, ALL_NODES, None).start()
    flips: list[dict[str, Any]] = []
    windows: list[tuple[str, float, float]] = []  # (node, start, end) of every node migration
    seen_failures = {n: 0 for n in ALL_NODES}
    mode = "iptables"
    started_all = time.monotonic()
    for i in range(MIGRATIONS):
        mode = "nftables" if mode == "iptables" else "iptables"
        started = time.monotonic()
        body = h.apply(soak_policy(mode)) if i == 0 else h.patch("soak", {"spec": {"mode": mode}})
        generation = body["metadata"]["generation"]
        try:
            h.wait_for(lambda m=mode, g=generation: all_ready(h, m, g), FLIP_TIMEOUT, f"soak flip {i + 1} to {mode}",
                       interval=1.0)
        except BaseException:
            print(h.describe("soak"))
            raise
        assert all(h.proxy_mode(n) == mode for n in ALL_NODES)
        windows += h.migration_windows(ALL_NODES)
        failed = {n: p.result.failed - seen_failures[n] for n, p in probers.items()}
        seen_failures = {n: p.result.failed for n, p in probers.items()}
        flips.append({"flip": i + 1, "mode": mode, "seconds": round(time.monotonic() - started, 1),
                      "failed": failed, "operator_rss_mib": rss_mib(h.operator.proc.pid if h.operator.proc else None),
                      "agent_rss_mib": {n: rss_mib(agent_pid(state_dir, n)) for n in ALL_NODES},
                      "agent_pid": {n: agent_pid(state_dir, n) for n in ALL_NODES}})
        print(flips[-1])
    history = injector.stop()
    results = {n: p.stop() for n, p in probers.items()}
    facts = check_end_state(h, "soak", history, tcp_probe, test_service, {n: p.failures for n, p in probers.items()},
                            GATE_TIMEOUT)
    after = snapshot(h, state_dir)

    # No leaks: the rules one mode leaves, nothing accumulated.
    for node in ALL_NODES:
        if mode == "iptables":
            assert after["chains"][node] == before["chains"][node], \
                f"{node} chains changed: +{after['chains'][node] - before['chains'][node]} " \
                f"-{before['chains'][node] - after['chains'][node]}"
            assert after["tables"][node] == before["tables"][node], (node, before["tables"], after["tables"])
        else:
            assert after["tables"][node] == before["tables"][node] | KUBE_PROXY_TABLES, (node, after["tables"][node])
    assert after["processes"] == before["processes"], f"processes per node namespace: {before['processes']} -> " \
                                                      f"{after['processes']}"
    assert all(after["kube_proxy"].values()), after["kube_proxy"]
    assert after["netns"] == before["netns"], (before["netns"], after["netns"])
    # check_end_state saw one switch per migration record; one migration record per node and flip:
    assert all(len([k for k in history.switched_at if k[0] == n]) == MIGRATIONS for n in ALL_NODES), \
        sorted(history.switched_at)

    # Memory flat: from after the first flip (warm) to after the last.
    operator_rss = [f["operator_rss_mib"] for f in flips]
    agents_restarted = {n for n in ALL_NODES if len({f["agent_pid"][n] for f in flips}) > 1}
    growth = {"operator": operator_rss[-1] - operator_rss[0]}
    for node in ALL_NODES:
        if node not in agents_restarted:
            growth[f"agent {node}"] = flips[-1]["agent_rss_mib"][node] - flips[0]["agent_rss_mib"][node]
    total_failed = {n: r.failed for n, r in results.items()}
    record(cluster, {"fault": f"soak x{MIGRATIONS}", "seconds": round(time.monotonic() - started_all, 1),
                     "node_switches": len(windows),
                     "flips": flips, "failed": total_failed, "ok": {n: r.ok for n, r in results.items()},
                     "rss_growth_mib": growth, "agents_restarted": sorted(agents_restarted),
                     "processes": after["processes"], **facts,
                     # Which step of its node each failure fell in, as in the fault runs; the soak's rule stays the
                     # rate below, not a per-step budget (no budget: each is charged to the step it was seen in).
                     **loss_facts(history, {n: p.failures for n, p in probers.items()}, ALL_NODES, None,
                                  probe_timeout=max(p.timeout for p in probers.values()), with_timeline=False)})
    assert not agents_restarted, f"agents restarted during the soak: {agents_restarted}"
    assert all(g <= RSS_GROWTH_MIB for g in growth.values()), f"memory grew: {growth} MiB; per flip: {flips}"
    assert all(r.ok > 0 for r in results.values())
    # Target 0. What holds today (with the agent's rule hold): a node's own connections can fail only inside
    # its own switch, rarely (1 in 60 switches in the recorded 20-flip run); other nodes never see a failure.
    own = {n: [t for t, _ in probers[n].failures if any(w[0] == n and w[1] - 1 <= t <= w[2] + 1 for w in windows)]
           for n in ALL_NODES}
    outside = {n: [t for t, _ in probers[n].failures if t not in own[n]] for n in ALL_NODES}
    print(f"soak: failed connections {total_failed} of {sum(r.ok for r in results.values())}; inside the node's "
          f"own switch: { {n: len(v) for n, v in own.items()} }")
    assert not any(outside.values()), f"failures outside the failing node's own switch: {outside}"
    assert sum(total_failed.values()) <= len(windows) // 20, \
        f"more than one failed connection per 20 node switches: {total_failed}; per flip: " \
        f"{[f['failed'] for f in flips]}"
