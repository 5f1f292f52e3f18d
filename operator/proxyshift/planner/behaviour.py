"""The behaviour matrix, pure: which Services a node probes, and how two matrices differ.

`behaviour_params` picks a bounded, deterministic sample of the cluster's Services per kind (plus
the policy's named ones) for one node; the agent probes it before the switch and in the gate.
`compare_matrices` names every difference between the two answers: reachability, stickiness and
locality must hold, endpoint identities may change (affinity state does not survive a restart).
A documented difference (api.behaviour.ChangeName) fails the gate unless the policy allows it; any
other lost Service is Reachability, which no policy can allow by name.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proxyshift.api.behaviour import (
    MAX_CELLS,
    MAX_LOCAL_ENDPOINTS,
    MAX_TARGETS,
    BehaviourCell,
    BehaviourChange,
    BehaviourMatrix,
    BehaviourParams,
    BehaviourTarget,
    ChangeName,
    Protocol,
    ServiceKind,
)
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicySpec
from proxyshift.modes import facts_of, node_port_default
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView, endpoints_by_service

AFFINITY_ATTEMPTS = 4
MAX_NODE_IPS = 8
MESSAGE_LENGTH = 400

# The order kinds are probed in, and which protocol each stands for: ClusterIP comes twice, once
# per protocol, because UDP (a DNS-like request/response) fails differently from TCP.
SampleKind = tuple[ServiceKind, Literal["TCP", "UDP"]]
SAMPLE_KINDS: tuple[SampleKind, ...] = (
    ("ClusterIP", "TCP"), ("ClusterIP", "UDP"), ("NodePort", "TCP"), ("Affinity", "TCP"),
    ("InternalLocal", "TCP"), ("ExternalLocal", "TCP"), ("NoEndpoints", "TCP"),
)


def stable_rank(service: str) -> str:
    """The sample's order: a hash of namespace/name, so a cluster always gives the same sample and no
    namespace (or name prefix) crowds out the others."""
    return hashlib.sha256(service.encode()).hexdigest()


def _first_port(service: ServiceView, protocol: str, *, node_port: bool = False) -> ServicePortView | None:
    for port in service.ports:
        if port.protocol == protocol and (port.node_port if node_port else True):
            return port
    return None


def _pick(service: ServiceView, kind: ServiceKind, protocol: Protocol, ready: Sequence[EndpointView],
          node_name: str) -> BehaviourTarget | None:
    """The target `service` stands for as `kind`, or None when it cannot stand for that kind."""
    if service.headless or service.type == "ExternalName":
        return None  # nothing to dial: DNS answers with the endpoints themselves
    address = service.cluster_ips[0] if service.cluster_ips else None
    plain = service.session_affinity == "None"
    # Sorted and unique: EndpointSlices list their endpoints in no fixed order, and the sample must not move.
    local = sorted({e.address for e in ready if e.node_name == node_name})[:MAX_LOCAL_ENDPOINTS]
    if kind == "NoEndpoints":
        port = _first_port(service, protocol)
        if ready or address is None or port is None:
            return None
        return BehaviourTarget(service=service.key, kind=kind, protocol=protocol, port=port.port, address=address)
    if not ready:
        return None
    if kind in ("NodePort", "ExternalLocal"):
        port = _first_port(service, protocol, node_port=True)
        wanted = "Local" if kind == "ExternalLocal" else "Cluster"
        if port is None or service.external_traffic_policy != wanted or not plain:
            return None
        # Locality of an external Local policy is never judged from here: kube-proxy sends traffic from the
        # node itself and from the cluster's own pods to every endpoint in every mode (pkg/proxy's
        # short-circuit for local and cluster-CIDR sources), so which endpoint answers a probe is chance.
        # What the cell still shows is whether the NodePort answers at all.
        return BehaviourTarget(service=service.key, kind=kind, protocol=protocol, port=port.node_port or 0)
    port = _first_port(service, protocol)
    if address is None or port is None:
        return None
    if kind == "ClusterIP" and plain and service.internal_traffic_policy == "Cluster":
        return BehaviourTarget(service=service.key, kind=kind, protocol=protocol, port=port.port, address=address)
    if kind == "Affinity" and not plain and service.internal_traffic_policy == "Cluster":
        return BehaviourTarget(service=service.key, kind=kind, protocol=protocol, port=port.port, address=address,
                               attempts=AFFINITY_ATTEMPTS)
    if kind == "InternalLocal" and plain and service.internal_traffic_policy == "Local":
        return BehaviourTarget(service=service.key, kind=kind, protocol=protocol, port=port.port, address=address,
                               local_endpoints=local)
    return None


def node_ips_from_k8s(node: Mapping[str, Any]) -> list[str]:
    """The Node object's InternalIP and ExternalIP addresses (BehaviourParams.node_ips), bounded."""
    addresses = (node.get("status") or {}).get("addresses") if isinstance(node.get("status"), Mapping) else None
    found: list[str] = []
    for entry in addresses if isinstance(addresses, list) else []:
        if not isinstance(entry, Mapping) or entry.get("type") not in ("InternalIP", "ExternalIP"):
            continue
        address = entry.get("address")
        if isinstance(address, str) and len(address) <= 45 and address not in found:
            found.append(address)
        if len(found) == MAX_NODE_IPS:
            break
    return found


def estimated_cells(target: BehaviourTarget, node_ips: Sequence[str]) -> int:
    """Cells a target gives at most: a NodePort is dialled on each node IP, one other address (the
    operator cannot see the node's other addresses; one is what the test bed adds) and 127.0.0.1."""
    if target.address is not None:
        return len(target.paths)
    per_path = len(node_ips) + 1
    return per_path * len(target.paths) + ("node" in target.paths)


def _target_id(target: BehaviourTarget) -> tuple[str, str | None, int, str]:
    return (target.service, target.address, target.port, target.protocol)


def behaviour_params(
    services: Iterable[ServiceView],
    endpoints: Iterable[EndpointView],
    node_name: str,
    node_ips: Sequence[str],
    spec: ProxyPolicySpec,
    pod_probe: str | None,
) -> BehaviourParams:
    """The behaviour probe's params for one node. With gate.behaviour.enabled false: no targets.

    Named Services (gate.probeServices) come first, then the kinds in turn (the first Service of
    every kind, then the second of every kind...), so when MAX_TARGETS cuts the list every kind is
    still in it. A Service stands for each kind it qualifies for, but a port is dialled once. The
    sample stops at MAX_TARGETS targets and at what fits in MAX_CELLS cells, so the matrix the agent
    writes to the ProxyNode status stays bounded whatever the cluster holds.
    """
    settings = spec.gate.behaviour
    params = BehaviourParams(node_ips=list(node_ips)[:MAX_NODE_IPS], pod_probe=pod_probe,
                             budget_seconds=settings.budget_seconds)
    if not settings.enabled:
        return params
    by_key = {s.key: s for s in services}
    ready_by_service = {k: [e for e in v if e.ready] for k, v in endpoints_by_service(endpoints).items()}
    ordered = sorted(by_key.values(), key=lambda s: stable_rank(s.key))

    chosen: list[BehaviourTarget] = []
    seen: set[tuple[str, str | None, int, str]] = set()
    cells = 0

    def add(target: BehaviourTarget) -> None:
        nonlocal cells
        cost = estimated_cells(target, params.node_ips)
        if _target_id(target) in seen or len(chosen) == MAX_TARGETS or cells + cost > MAX_CELLS:
            return
        seen.add(_target_id(target))
        chosen.append(target)
        cells += cost

    for ref in spec.gate.probe_services or []:
        service = by_key.get(f"{ref.namespace}/{ref.name}")
        if service is None or service.headless or not service.cluster_ips:
            continue  # the gate's own probeServices check reports a missing Service
        add(BehaviourTarget(service=service.key, kind="Named", protocol="TCP", port=ref.port,
                            address=service.cluster_ips[0]))

    per_kind: list[list[BehaviourTarget]] = []
    for kind, protocol in SAMPLE_KINDS:
        picked: list[BehaviourTarget] = []
        for service in ordered:
            target = _pick(service, kind, protocol, ready_by_service.get(service.key, []), node_name)
            if target is not None:
                picked.append(target)
                if len(picked) == settings.sample_per_kind:
                    break
        per_kind.append(picked)
    for rank in range(settings.sample_per_kind):
        for picked in per_kind:
            if rank < len(picked):
                add(picked[rank])
    params.targets = chosen
    return params


# ---- comparison -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BehaviourVerdict:
    """What changed between the matrix before the switch and the one after."""

    changes: list[BehaviourChange] = field(default_factory=list)  # every difference, allowed or not
    failing: list[BehaviourChange] = field(default_factory=list)  # the ones the policy does not allow
    recovered: list[str] = field(default_factory=list)  # cells that failed before and answer now
    notes: list[str] = field(default_factory=list)  # what was not compared, and why
    compared: int = 0  # cells present in both matrices and compared

    @property
    def passed(self) -> bool:
        return not self.failing

    @property
    def reason(self) -> str:
        """One line for the gate's failure: the first failing change, and how many more there are."""
        if not self.failing:
            return ""
        more = len(self.failing) - 1
        return self.failing[0].message + (f" (and {more} more change{'s' if more > 1 else ''})" if more else "")


_HOW = {"refused": "is refused now", "timeout": "times out now", "unreachable": "is unreachable now",
        "error": "fails now"}


def _where(cell: BehaviourCell) -> str:
    origin = " from a pod" if cell.path == "pod" else ""
    if cell.address_role == "clusterIP":
        return f"{cell.service} {cell.address}:{cell.port}/{cell.protocol}{origin}"
    udp = "UDP " if cell.protocol == "UDP" else ""
    return f"{udp}NodePort {cell.port} on {cell.address} ({cell.service}){origin}"


def serves_node_ports_on(address: str, role: str, mode: str | None, node_port_addresses: list[str] | None) -> bool:
    """Does kube-proxy's nodePortAddresses (after its 1.37 defaulting) cover this local address?"""
    if not node_port_addresses:
        # Unset: as the mode defaults it (all in iptables/ipvs, primary in nftables).
        return node_port_default(mode) == "all" or role == "nodeIP"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return True  # not ours to judge
    same_family = [e for e in node_port_addresses if e in ("primary", "localhost", "all") or (":" in e) == (
        ip.version == 6)]
    if not same_family:
        return True  # kube-proxy gives a family the list leaves out its zero CIDR
    for entry in same_family:
        if entry == "all" or (entry == "primary" and role == "nodeIP") or (entry == "localhost" and ip.is_loopback):
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _mode_name(mode: str | None) -> str:
    return f"{mode} mode" if mode else "the new kube-proxy"


def _localhost_cause(cell: BehaviourCell, to_mode: str | None, to_config: KubeProxyConfiguration | None) -> str:
    facts = facts_of(to_mode)
    if facts is not None and facts.localhost_cause is not None:
        return facts.localhost_cause(cell.protocol, to_config)
    return f"{_mode_name(to_mode)} serves no localhost NodePorts (allow the change LocalhostNodePorts)"


def _node_port_addresses_cause(to_mode: str | None, to_config: KubeProxyConfiguration | None) -> str:
    addresses = to_config.node_port_addresses if to_config else None
    if addresses:
        return (f"the new revision's nodePortAddresses {addresses} leaves this address out (add it to "
                "nodePortAddresses, or allow the change NodePortAddresses)")
    if node_port_default(to_mode) == "primary":
        return (f"{to_mode} mode serves NodePorts only on the node's primary IPs when nodePortAddresses is unset (set "
                "nodePortAddresses, e.g. [0.0.0.0/0], or allow the change NodePortAddresses)")
    return f"{_mode_name(to_mode)} no longer serves NodePorts on it (set nodePortAddresses, or allow NodePortAddresses)"


def _lost_reachability(cell: BehaviourCell, now: BehaviourCell, to_mode: str | None,
                       to_config: KubeProxyConfiguration | None) -> tuple[ChangeName | Literal["Reachability"], str]:
    head = f"{_where(cell)} answered before the switch and {_HOW.get(now.outcome, 'fails now')}"
    if cell.address_role == "localhost":
        return "LocalhostNodePorts", f"{head}: {_localhost_cause(cell, to_mode, to_config)}"
    addresses = to_config.node_port_addresses if to_config else None
    if cell.address_role in ("nodeIP", "otherAddress") and not serves_node_ports_on(
            cell.address, cell.address_role, to_mode, addresses):
        return "NodePortAddresses", f"{head}: {_node_port_addresses_cause(to_mode, to_config)}"
    detail = f" ({now.detail})" if now.detail else ""
    return "Reachability", (f"{head}{detail}: {_mode_name(to_mode)} does not serve it; no policy setting accepts "
                            "this (fix the Service or its rules, or turn gate.behaviour off)")


def _change(name: ChangeName | Literal["Reachability"], service: str, message: str) -> BehaviourChange:
    if len(message) > MESSAGE_LENGTH:
        message = message[: MESSAGE_LENGTH - 3] + "..."
    return BehaviourChange(name=name, service=service, message=message)


def compare_matrices(
    before: BehaviourMatrix,
    after: BehaviourMatrix,
    allow: Collection[ChangeName],
    *,
    to_mode: str | None = None,
    to_config: KubeProxyConfiguration | None = None,
) -> BehaviourVerdict:
    """Every difference between `before` and `after` that users would see, and which ones fail.

    Cells are matched on BehaviourCell.key; only cells present in both are compared (a truncated
    matrix, or a pod path that could not be probed on one side, narrows the comparison and the
    verdict says so). `to_mode` (default: the mode `after` reports) and `to_config` (the revision's
    KubeProxyConfiguration) name the cause and the setting that keeps today's behaviour.
    """
    to_mode = to_mode or after.mode
    notes: list[str] = []
    skip_pod = bool(before.pod_path_error or after.pod_path_error)
    if skip_pod:
        why = after.pod_path_error or before.pod_path_error
        notes.append(f"pod path not compared: {why}")
    if before.truncated or after.truncated:
        side = "both" if before.truncated and after.truncated else ("before" if before.truncated else "after")
        notes.append(f"the probe ran out of time ({side}): only cells probed both times were compared")
    earlier = {c.key: c for c in before.cells if not (skip_pod and c.path == "pod")}
    later = {c.key: c for c in after.cells if not (skip_pod and c.path == "pod")}
    unmatched = [k for k in earlier if k not in later]
    if unmatched and not after.truncated:
        notes.append(f"{len(unmatched)} cell(s) probed before the switch were not probed after it")

    changes: list[BehaviourChange] = []
    recovered: list[str] = []
    compared = 0
    for key, old in earlier.items():
        new = later.get(key)
        if new is None:
            continue
        compared += 1
        if old.outcome == "answered" and new.outcome != "answered":
            name, message = _lost_reachability(old, new, to_mode, to_config)
            changes.append(_change(name, old.service, message))
            continue
        if old.outcome != "answered":
            if new.outcome == "answered":
                recovered.append(f"{_where(old)} was {old.outcome} before the switch and answers now")
            continue
        if old.sticky is True and new.sticky is False:
            changes.append(_change("SessionAffinity", old.service, (
                f"{_where(old)}: repeated connections from one client reached one endpoint before the switch and "
                f"several now ({', '.join(new.endpoints[:4])}): ClientIP affinity does not hold in "
                f"{_mode_name(to_mode)} (allow the change SessionAffinity)")))
        if old.local is True and new.local is False:
            changes.append(_change("TrafficPolicyLocal", old.service, (
                f"{_where(old)}: only endpoints on this node answered before the switch, now "
                f"{', '.join(new.endpoints[:4]) or 'another node'} did: the Local traffic policy does not hold in "
                f"{_mode_name(to_mode)} (allow the change TrafficPolicyLocal)")))
    allowed = set(allow)
    failing = [c for c in changes if c.name == "Reachability" or c.name not in allowed]
    return BehaviourVerdict(changes=changes, failing=failing, recovered=recovered, notes=notes, compared=compared)
