"""Why is a Service's load uneven? A verdict from the kernel's counters, pure (no I/O).

Input: the Service and its EndpointSlices (planner.services views) and what one node's kernel counted
(api.diagnostics.ServiceCounters, from agent/diagnostics.py). Output: balanced, uneven, too few
connections to tell, no traffic, or no endpoints, with the likely causes named.

"Uneven" is a statistical statement, not a glance at percentages: kube-proxy picks an endpoint at
random per new flow (iptables `statistic --mode random`, nftables numgen, ipvs rr), so 7 against 3
over 10 connections is ordinary chance. A chi-square goodness-of-fit test against each endpoint's
expected share decides; with fewer connections than the test needs, the verdict says so and names
"random choice over too few connections" rather than inventing a cause.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from proxyshift.api.diagnostics import (
    MAX_DIAGNOSE_SERVICES,
    MAX_ENDPOINTS,
    DiagnosePort,
    DiagnoseRequest,
    DiagnoseService,
    EndpointCounters,
    NodeDiagnostics,
    ServiceCounters,
)
from proxyshift.planner.behaviour import stable_rank
from proxyshift.planner.services import EndpointView, ServiceView

Verdict = Literal["balanced", "uneven", "too-few", "no-traffic", "no-endpoints"]
CauseName = Literal[
    "EndpointNotReady",  # kube-proxy sends nothing to an endpoint its EndpointSlice calls not ready
    "ClientIPAffinity",  # sessionAffinity ClientIP (ipvs: persistence) pins each client to one endpoint
    "LongLivedConnections",  # a few established connections, kept by conntrack, carry the load
    "TooFewConnections",  # random choice over too few connections: the counts are what chance gives
    "LocalPolicyNoLocalEndpoint",  # Local traffic policy and this node has no ready local endpoint
    "LocalPolicyLocalOnly",  # Local traffic policy: this node sends only to its own endpoints
    "IPVSScheduler",  # the ipvs scheduler or its weights (sh/mh hash by source, wrr weights)
    "StaleEndpoint",  # the kernel still counts flows to an address no EndpointSlice lists
    "Unknown",  # uneven, and none of the above explains it
]

# p below this: the counts are not what the expected shares give by chance. 0.001 rather than the
# customary 0.01: a diagnosis that calls a healthy Service uneven once in a hundred runs is noise.
ALPHA = 0.001
# "Balanced" is claimed only with enough flows to know each share within half its size at 99%
# confidence (normal bound: Z * sqrt(p(1-p)/n) <= REL * p): 27 flows for two endpoints, 80 for four.
Z_99 = 2.576
RELATIVE_PRECISION = 0.5
HASHING_SCHEDULERS = frozenset({"sh", "mh"})
# Schedulers that weigh real servers; lc/wlc/sed/nq also follow the active connection counts.
WEIGHTED_SCHEDULERS = frozenset({"wrr", "wlc", "lc", "sed", "nq", "lblc", "lblcr", "fo", "ovf"})


@dataclass(frozen=True)
class Cause:
    name: CauseName
    message: str


@dataclass(frozen=True)
class EndpointShare:
    address: str
    ready: bool | None  # None: no EndpointSlice lists it
    local: bool | None  # on the diagnosed node (None: the slice names no node)
    count: int
    share: float  # of all counted traffic on this node
    expected: float  # share kube-proxy would give it, over the endpoints the user listed
    established: int


@dataclass(frozen=True)
class Diagnosis:
    service: str
    node: str
    mode: str | None
    source: str
    basis: str  # what `count` is: "new flows" (rule counters, ipvs Conns) or "conntrack entries"
    verdict: Verdict
    total: int
    p_value: float | None
    shares: tuple[EndpointShare, ...]
    causes: tuple[Cause, ...] = field(default=())


# ---- statistics ----

def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x): series below a+1, continued fraction above."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(500):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Lentz's method for the continued fraction of Q.
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


def chi_square_p(observed: Sequence[int], expected_shares: Sequence[float]) -> float:
    """P(a chi-square statistic at least this large | the shares are right). 1.0 for fewer than two cells."""
    total = sum(observed)
    # Counts where nothing was expected make the shares plainly wrong.
    if any(o > 0 for o, s in zip(observed, expected_shares, strict=True) if s <= 0):
        return 0.0
    cells = [(o, s) for o, s in zip(observed, expected_shares, strict=True) if s > 0]
    if total == 0 or len(cells) < 2:
        return 1.0
    statistic = sum((o - total * s) ** 2 / (total * s) for o, s in cells)
    return _gamma_q((len(cells) - 1) / 2, statistic / 2)


def enough_flows(share: float) -> float:
    """Flows needed before an endpoint's observed share says something about `share`."""
    return Z_99**2 * (1 - share) / (RELATIVE_PRECISION**2 * share)


def _judge(counts: Sequence[int], shares: Sequence[float]) -> tuple[Verdict, float | None]:
    total = sum(counts)
    if total == 0:
        return "no-traffic", None
    p = chi_square_p(counts, shares)
    if p < ALPHA:
        return "uneven", p
    positive = [s for s in shares if s > 0]
    if len(positive) < 2:
        return "balanced", p  # one endpoint to choose from: nothing to balance
    if total < enough_flows(min(positive)):
        return "too-few", p
    return "balanced", p


# ---- the verdict ----

def _address_ip(address: str) -> str:
    """ip of "ip", "ip:port" or "[v6]:port"."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def _weights(candidates: Sequence[str], counters: dict[str, EndpointCounters], scheduler: str | None) -> list[float]:
    """Expected shares over `candidates`: equal, or by ipvs weight where the scheduler weighs."""
    if scheduler in WEIGHTED_SCHEDULERS:
        raw = [float(weight) if (weight := counters[a].weight) is not None else 1.0 for a in candidates]
    else:
        raw = [1.0] * len(candidates)
    total = sum(raw)
    return [w / total if total else 0.0 for w in raw]


def diagnose(service: ServiceView, endpoints: Iterable[EndpointView], node: str, counters: ServiceCounters,
             mode: str | None = None) -> Diagnosis:
    """The verdict for one Service on one node (or on the sum of several, node="all nodes")."""
    slices = {e.address: e for e in endpoints}
    by_ip = {_address_ip(c.address): c for c in counters.endpoints}
    use_flows = counters.source in ("iptables", "ipvs") and any(c.flows is not None for c in counters.endpoints)
    basis = "new flows" if use_flows else "conntrack entries"

    def count(c: EndpointCounters | None) -> int:
        if c is None:
            return 0
        return (c.flows or 0) if use_flows else c.conntrack_entries

    listed = list(slices)
    strays = [c for ip, c in by_ip.items() if ip not in slices and count(c) > 0]
    counts = [count(by_ip.get(a)) for a in listed]
    total = sum(counts) + sum(count(c) for c in strays)
    expected_all = _weights(listed, {a: by_ip.get(a) or EndpointCounters(address=a) for a in listed},
                            counters.scheduler)
    shares = tuple(
        EndpointShare(address=a, ready=slices[a].ready,
                      local=None if slices[a].node_name is None else slices[a].node_name == node,
                      count=n, share=n / total if total else 0.0, expected=e,
                      established=(by_ip[a].conntrack_established if a in by_ip else 0))
        for a, n, e in zip(listed, counts, expected_all, strict=True)
    ) + tuple(
        EndpointShare(address=c.address, ready=None, local=None, count=count(c), share=count(c) / total,
                      expected=0.0, established=c.conntrack_established) for c in strays
    )
    causes: list[Cause] = []

    def done(verdict: Verdict, p: float | None) -> Diagnosis:
        return Diagnosis(service=service.key, node=node, mode=mode, source=counters.source, basis=basis,
                         verdict=verdict, total=total, p_value=p, shares=shares, causes=tuple(causes))

    not_ready = [s for s in shares if s.ready is False]
    policy_local = service.internal_traffic_policy == "Local" or service.external_traffic_policy == "Local"
    local_ready = [s for s in shares if s.ready and s.local]
    if policy_local and node != "all nodes" and not local_ready:
        which = "internal" if service.internal_traffic_policy == "Local" else "external"
        causes.append(Cause("LocalPolicyNoLocalEndpoint",
                            f"{which}TrafficPolicy is Local and {node} has no ready endpoint of its own: this node "
                            f"serves none of the Service's {which} traffic"))
    if not listed:
        return done("no-endpoints", None)
    if strays:
        causes.append(Cause("StaleEndpoint", "the kernel counts traffic to " + ", ".join(s.address for s in strays)
                            + ", which no EndpointSlice lists (old flows or rules written before it went)"))
    verdict, p = _judge([s.count for s in shares], [s.expected for s in shares])
    if verdict == "no-traffic":
        return done(verdict, p)
    if verdict != "uneven" and (not_ready or strays):
        # Not chance: kube-proxy gives a not-ready endpoint nothing by construction, and traffic to an
        # unlisted address is wrong at any count.
        verdict = "uneven"
    if verdict == "balanced":
        return done(verdict, p)

    # Explain: remove what kube-proxy rightly skips, then test again among what it chooses from.
    candidates = [s for s in shares if s.ready is not False and s.ready is not None]
    if not_ready:
        causes.append(Cause("EndpointNotReady", "; ".join(
            f"{s.address} is not ready in its EndpointSlice, so kube-proxy sends it no new traffic "
            f"({_pct(s.share)} of {basis})" for s in not_ready)))
    if policy_local and node != "all nodes" and local_ready:
        elsewhere = sum(s.count for s in candidates if not s.local)
        if len(local_ready) < len(candidates) and elsewhere == 0:
            causes.append(Cause("LocalPolicyLocalOnly",
                                f"the traffic policy is Local: {node} sends only to its own endpoints "
                                + ", ".join(s.address for s in local_ready)))
            candidates = local_ready
    sub_counts = [s.count for s in candidates]
    sub_shares = _weights([s.address for s in candidates],
                          {s.address: by_ip.get(s.address) or EndpointCounters(address=s.address) for s in candidates},
                          counters.scheduler)
    sub_verdict, sub_p = _judge(sub_counts, sub_shares) if candidates else ("no-traffic", None)
    if sub_verdict in ("uneven", "too-few"):
        top = max(candidates, key=lambda s: s.count)
        affinity = service.session_affinity == "ClientIP" or bool(counters.persistence_seconds)
        if affinity:
            timeout = counters.persistence_seconds or service.affinity_timeout_seconds
            causes.append(Cause("ClientIPAffinity",
                                f"sessionAffinity is ClientIP (timeout {timeout}s): each client address sticks to "
                                f"one endpoint, so a few clients give a few choices ({top.address} has "
                                f"{_pct(top.share)})"))
        if counters.scheduler in HASHING_SCHEDULERS:
            causes.append(Cause("IPVSScheduler", f"the ipvs scheduler {counters.scheduler} hashes the client "
                                "address: a few clients land on a few endpoints"))
        elif counters.scheduler in WEIGHTED_SCHEDULERS and len({s.expected for s in candidates}) > 1:
            causes.append(Cause("IPVSScheduler", f"the ipvs scheduler {counters.scheduler} weighs the real "
                                "servers unequally (ipvsadm weights)"))
        established = sum(s.established for s in candidates)
        if established and (not use_flows or established * 2 >= sum(sub_counts)):
            top_held = max(candidates, key=lambda s: s.established)
            if top_held.established * len(candidates) > established:
                causes.append(Cause("LongLivedConnections",
                                    f"{established} established connections are held by conntrack, "
                                    f"{top_held.established} of them to {top_held.address}: requests on a kept "
                                    "connection are never balanced again, only new connections are"))
        if sub_verdict == "too-few" and not any(c.name in ("ClientIPAffinity", "IPVSScheduler") for c in causes):
            causes.append(Cause("TooFewConnections",
                                f"random choice over too few connections: {sum(sub_counts)} {basis} over "
                                f"{len(candidates)} endpoints (p={sub_p:.2f}); counts this uneven are what "
                                "chance gives, count again after more traffic"))
    if verdict == "uneven" and not causes:
        causes.append(Cause("Unknown", "uneven, and no known cause applies: compare the endpoints' own "
                            "request counters, and look for clients behind one NAT address"))
    return done(verdict, p)


def combine(parts: Sequence[ServiceCounters]) -> ServiceCounters:
    """Several nodes' counters of one Service added up per endpoint (the cluster-wide picture)."""
    if not parts:
        raise ValueError("nothing to combine")
    merged: dict[str, EndpointCounters] = {}
    for part in parts:
        for c in part.endpoints:
            key = _address_ip(c.address)
            old = merged.get(key)
            if old is None:
                merged[key] = c.model_copy()
                continue
            merged[key] = old.model_copy(update={
                "flows": None if old.flows is None and c.flows is None else (old.flows or 0) + (c.flows or 0),
                "packets": None if old.packets is None and c.packets is None
                else (old.packets or 0) + (c.packets or 0),
                "conntrack_entries": old.conntrack_entries + c.conntrack_entries,
                "conntrack_established": old.conntrack_established + c.conntrack_established,
            })
    sources = {p.source for p in parts} - {"none"}
    source = sources.pop() if len(sources) == 1 else ("conntrack" if sources else "none")
    return ServiceCounters(service=parts[0].service, source=source, scheduler=parts[0].scheduler,
                           persistence_seconds=parts[0].persistence_seconds,
                           endpoints=list(merged.values())[:MAX_ENDPOINTS],
                           truncated=any(p.truncated for p in parts))


def request_service(service: ServiceView, endpoints: Iterable[EndpointView]) -> DiagnoseService:
    """The part of a DiagnoseRequest that names one Service: what the node needs to find its counters."""
    return DiagnoseService(
        namespace=service.namespace, name=service.name, clusterIPs=list(service.cluster_ips),
        # ServicePortView keeps the API's protocol as text (SCTP too); DiagnosePort validates it at run time.
        ports=[DiagnosePort(name=p.name, port=p.port, protocol=p.protocol, node_port=p.node_port)  # type: ignore[arg-type]
               for p in service.ports[:16]],
        endpoints=list(dict.fromkeys(e.address for e in endpoints))[:MAX_ENDPOINTS],
    )


# ---- around a migration (for the planner; the lead wires it) ----

def migration_request(services: Iterable[ServiceView], endpoints: Mapping[str, Sequence[EndpointView]],
                      request_id: str, record: Literal["before", "after"], *, named: Sequence[str] = (),
                      limit: int = MAX_DIAGNOSE_SERVICES) -> DiagnoseRequest | None:
    """The request the operator puts in ProxyNode.spec.diagnose before (with Preflight) or after a node's move.

    Services worth a distribution: a ClusterIP and at least two endpoints to share between. The
    policy's named ones first, then the others in the behaviour sample's stable order, so every node
    of a cluster records the same Services and a re-plan asks for the same again. None: nothing to record.
    """
    by_key = {s.key: s for s in services if s.cluster_ips and not s.headless}
    eligible = [k for k, s in by_key.items() if len(endpoints.get(k, ())) >= 2]
    chosen = [k for k in dict.fromkeys(named) if k in eligible]
    chosen += sorted((k for k in eligible if k not in chosen), key=stable_rank)
    chosen = chosen[:min(limit, MAX_DIAGNOSE_SERVICES)]
    if not chosen:
        return None
    return DiagnoseRequest(id=request_id, record=record,
                           services=[request_service(by_key[k], endpoints.get(k, ())) for k in chosen])


def _summary(d: Diagnosis) -> str:
    shares = "/".join(_pct(s.share) for s in d.shares) if d.total else "-"
    return f"{d.verdict} ({shares} of {d.total} {d.basis}, {d.mode or d.source})"


def distribution_change(service: ServiceView, endpoints: Sequence[EndpointView], node: str,
                        before: NodeDiagnostics | None, after: NodeDiagnostics | None) -> str | None:
    """One line for `proxyshift status`: how a Service's load on a node looked before and after the move.

    Counters restart with the new mode's rules (and nftables keeps none per endpoint, so its side is
    conntrack), so each side is judged on its own basis; the line says which.
    """
    def side(answer: NodeDiagnostics | None) -> str:
        counters = next((c for c in (answer.services if answer else []) if c.service == service.key), None)
        if answer is None or counters is None:
            return "not recorded"
        return _summary(diagnose(service, endpoints, node, counters, answer.mode))

    if before is None and after is None:
        return None
    return f"{service.key} on {node}: before {side(before)} -> after {side(after)}"


def distribution_lines(node: str, before: NodeDiagnostics | None, after: NodeDiagnostics | None,
                       services: Mapping[str, ServiceView],
                       endpoints: Mapping[str, Sequence[EndpointView]]) -> list[str]:
    """Every recorded Service of a node's status.distribution as `distribution_change` lines, in record order.

    A Service deleted since it was recorded is skipped: there is nothing left to judge it against.
    """
    keys = [c.service for c in (before.services if before else [])]
    keys += [c.service for c in (after.services if after else []) if c.service not in keys]
    lines = []
    for key in keys:
        view = services.get(key)
        line = distribution_change(view, endpoints.get(key, ()), node, before, after) if view else None
        if line:
            lines.append(line)
    return lines
