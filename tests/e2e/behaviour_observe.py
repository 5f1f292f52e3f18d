"""The behaviour matrix as a test sees it from outside the product: every Service of the local cluster's
behaviour workloads dialled from each node's namespace and from its pod namespace, and what kube-proxy
in a given mode should answer there (behaviour_workloads.expected_outcome, the bed's oracle).

Shared by the workload tests and the behaviour-gate tests; independent of the agent's own probe, so
it can check the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from localcluster import behaviour_workloads, workloads
from localcluster.behaviour_workloads import BehaviourService, BehaviourWorkloads

ATTEMPT_TIMEOUT = 0.5
AFFINITY_ATTEMPTS = 5


@dataclass(frozen=True)
class Cell:
    node: str
    path: str  # node | pod
    service: str
    address: str
    port: int
    protocol: str
    outcome: str  # answered | refused | timeout | error
    endpoints: tuple[str, ...]
    detail: str = ""


def _outcome(errors: dict[str, int]) -> str:
    text = " ".join(errors)
    if "Refused" in text:
        return "refused"
    if "Timeout" in text or "timed out" in text:
        return "timeout"
    return "error"


def _dial(netns: str, svc: BehaviourService, address: str, port: int,
          attempts: int) -> tuple[str, tuple[str, ...], str]:
    if svc.protocol == "UDP":
        result = workloads.udp_probe(netns, address, port, attempts, timeout=ATTEMPT_TIMEOUT)
    else:
        result = workloads.tcp_probe(netns, address, port, attempts, timeout=ATTEMPT_TIMEOUT)
    if result.failed == 0:
        return "answered", tuple(sorted(result.served_by)), ""
    if result.ok == 0:
        return _outcome(dict(result.errors)), (), ", ".join(result.errors)
    return "error", tuple(sorted(result.served_by)), f"{result.ok}/{result.total} answered: {dict(result.errors)}"


def observe(made: BehaviourWorkloads) -> list[Cell]:
    """One pass over the matrix: every Service with a ClusterIP, and each NodePort on every address."""
    cells = []
    for node in made.nodes:
        for path, netns in (("node", node.name), ("pod", node.pod_netns)):
            for svc in made.services:
                if svc.cluster_ip in (None, "None"):
                    continue
                attempts = AFFINITY_ATTEMPTS if svc.session_affinity_seconds else 1
                targets = [(svc.cluster_ip, svc.port)]
                if svc.node_port:
                    # 127.0.0.1 in a pod is the pod's own loopback, not the node's.
                    addresses = [node.ip, node.second_address] + (["127.0.0.1"] if path == "node" else [])
                    targets += [(a, svc.node_port) for a in addresses]
                for address, port in targets:
                    outcome, endpoints, detail = _dial(netns, svc, address, port, attempts)
                    cells.append(Cell(node.name, path, svc.name, address, port, svc.protocol, outcome, endpoints,
                                      detail))
    return cells


def expected_problems(made: BehaviourWorkloads, cells: list[Cell],
                      mode: behaviour_workloads.ProxyMode = "iptables") -> list[str]:
    """Every cell that differs from what kube-proxy in `mode` does here (empty: all as expected)."""
    problems = []
    for cell in cells:
        svc = made.service(cell.service)
        path: Literal["pod", "node"] = "pod" if cell.path == "pod" else "node"
        want, allowed = behaviour_workloads.expected_outcome(made, cell.service, cell.node, path, cell.address, mode)
        if cell.outcome != want:
            problems.append(f"{cell}: want {want}")
        elif cell.endpoints and not set(cell.endpoints) <= allowed:
            problems.append(f"{cell}: answered by {set(cell.endpoints) - allowed}, want only {sorted(allowed)}")
        elif svc.session_affinity_seconds and len(cell.endpoints) != 1:
            problems.append(f"{cell}: ClientIP affinity, want one endpoint")
    return problems


def table(cells: list[Cell]) -> str:
    lines = [f"{'node':<10} {'path':<4} {'service':<15} {'address:port/proto':<26} {'outcome':<9} endpoints"]
    for c in cells:
        lines.append(f"{c.node:<10} {c.path:<4} {c.service:<15} {f'{c.address}:{c.port}/{c.protocol}':<26} "
                     f"{c.outcome:<9} {','.join(c.endpoints) or '-'}")
    return "\n".join(lines)
