"""Node side of `proxyshift diagnose`: what this node's kernel itself counted for a Service, per endpoint.

Per mode, the counters that exist:
- iptables: `iptables-save -c -t nat`. Only a flow's first packet traverses the nat table, so the packet
  counter of a KUBE-SEP- chain's DNAT rule is the number of new flows kube-proxy sent to that endpoint
  since the rule was written. kube-proxy's rule comments name the Service port (`ns/name:port`).
- ipvs: `ipvsadm -Ln --stats --exact` (Conns, InPkts per real server) and `ipvsadm -Sn` (scheduler,
  persistence, weights). Asked only when /proc/net/ip_vs exists: ipvsadm would otherwise load ip_vs.
- nftables: kube-proxy's rules keep no per-endpoint counters, so conntrack is the source there.
Everywhere conntrack is read as a second source (`conntrack -L -o xml`, parsed by agent/conntrack.py;
one dump per IP family and protocol for a whole request, bucketed per Service port in Python):
entries by reply source (the endpoint the flow was NATed to), and how many are ESTABLISHED
(long-lived connections pin load where they first landed).

Read-only, every tool an argument list with a timeout; output read up to a bound and parsed with
linear scans, so a node with 10,000 Services answers in bounded time and size.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxyshift.agent import conntrack as conntrack_mod
from proxyshift.agent.flush.base import Runner
from proxyshift.api.diagnostics import (
    MAX_DIAGNOSE_SERVICES,
    MAX_ENDPOINTS,
    MAX_ERRORS,
    MAX_RULES,
    CounterSource,
    DiagnoseRequest,
    DiagnoseService,
    EndpointCounters,
    NodeDiagnostics,
    ServiceCounters,
)
from proxyshift.commands import CommandError, run
from proxyshift.modes import facts_of

MAX_SAVE_BYTES = 64 * 1024 * 1024  # iptables-save of 10,000 Services is ~20 MiB
MAX_CONNTRACK_FLOWS = 20_000  # per dump (or per query on a table too large to dump); the XML is cut at 8 MiB anyway
MAX_IPVS_BYTES = 16 * 1024 * 1024
TOOL_TIMEOUT_SECONDS = 20.0
ERROR_LENGTH = 200

_COUNTED_RULE = re.compile(r"^\[(\d+):(\d+)\] -A (\S+) (.*)$")
_COMMENT = re.compile(r'--comment "((?:[^"\\]|\\.)*)"')
_TO_DESTINATION = re.compile(r"-j DNAT .*--to-destination (\S+)")
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")


class DiagnosticsOutputError(ValueError):
    """A tool printed something this parser does not understand."""


# ---- iptables ----

def _names_service(comment: str, key: str) -> bool:
    """kube-proxy's comments carry the ServicePortName as one word: `ns/name:port`, or `ns/name` unnamed."""
    return any(word == key or word.startswith(key + ":") for word in comment.split())


@dataclass
class IptablesCounters:
    chains: dict[str, int] = field(default_factory=dict)  # chain -> rules of this Service in it
    flows: dict[str, int] = field(default_factory=dict)  # endpoint ip:port -> DNAT rule packets
    chains_cut: bool = False  # more chains than MAX_RULES: the list is cut, the flows are whole


def parse_iptables_counters(text: str, service_key: str) -> IptablesCounters:
    """Flows per endpoint of one Service from `iptables-save -c -t nat` text.

    Only lines that mention the Service are looked at closely; everything else costs one substring test.
    """
    out = IptablesCounters()
    for raw in text.splitlines():
        if service_key not in raw:
            continue
        match = _COUNTED_RULE.match(raw)
        if match is None:
            continue
        packets, chain, rest = int(match.group(1)), match.group(3), match.group(4)
        if not chain.startswith(SERVICE_CHAIN_PREFIXES):
            continue
        comment = _COMMENT.search(rest)
        if comment is None or not _names_service(comment.group(1), service_key):
            continue
        # The list of chains is for a person and bounded; every endpoint's flows are counted regardless.
        if chain in out.chains or len(out.chains) < MAX_RULES:
            out.chains[chain] = out.chains.get(chain, 0) + 1
        else:
            out.chains_cut = True
        dnat = _TO_DESTINATION.search(rest)
        if chain.startswith("KUBE-SEP-") and dnat is not None:
            endpoint = dnat.group(1)
            out.flows[endpoint] = out.flows.get(endpoint, 0) + packets
    return out


# ---- ipvs ----

@dataclass
class RealServer:
    address: str
    conns: int = 0
    in_packets: int = 0
    weight: int | None = None


@dataclass
class VirtualService:
    protocol: str  # TCP, UDP, SCTP or FWM
    address: str  # ip:port ([v6]:port), or the fwmark
    scheduler: str | None = None
    persistence_seconds: int | None = None
    real_servers: dict[str, RealServer] = field(default_factory=dict)


_SUFFIX = {"K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_IPVS_PROTOCOLS = {"TCP", "UDP", "SCTP", "FWM"}
_SAVE_FLAGS = {"-t": "TCP", "-u": "UDP", "--sctp-service": "SCTP", "-f": "FWM"}


def _ipvs_number(token: str) -> int:
    """ipvsadm's counters, exact (--exact) or with its K/M/G/T suffixes (powers of 1000)."""
    if token and token[-1] in _SUFFIX:
        return int(token[:-1]) * _SUFFIX[token[-1]]
    return int(token)


def parse_ipvs_stats(text: str) -> dict[tuple[str, str], VirtualService]:
    """`ipvsadm -Ln --stats [--exact]`: (protocol, address) -> virtual service with Conns/InPkts per real server."""
    services: dict[tuple[str, str], VirtualService] = {}
    current: VirtualService | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("IP Virtual Server", "Prot ", "-> RemoteAddress")):
            continue
        tokens = line.split()
        try:
            if tokens[0] in _IPVS_PROTOCOLS and len(tokens) >= 7:
                for token in tokens[2:7]:
                    _ipvs_number(token)
                key = (tokens[0], tokens[1])
                current = services.setdefault(key, VirtualService(tokens[0], tokens[1]))
            elif tokens[0] == "->" and len(tokens) >= 7 and current is not None:
                numbers = [_ipvs_number(t) for t in tokens[2:7]]
                server = current.real_servers.setdefault(tokens[1], RealServer(tokens[1]))
                server.conns, server.in_packets = numbers[0], numbers[1]
            else:
                raise DiagnosticsOutputError(f"ipvsadm --stats line {lineno}: {line[:80]!r}")
        except ValueError as exc:
            raise DiagnosticsOutputError(f"ipvsadm --stats line {lineno}: {line[:80]!r} ({exc})") from None
    return services


def merge_ipvs_save(services: dict[tuple[str, str], VirtualService], text: str) -> None:
    """Add scheduler, persistence and weights from `ipvsadm -Sn` to what --stats found."""
    current: VirtualService | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        tokens = raw.split()
        if not tokens:
            continue
        if len(tokens) < 3 or tokens[0] not in ("-A", "-a") or tokens[1] not in _SAVE_FLAGS:
            raise DiagnosticsOutputError(f"ipvsadm -Sn line {lineno}: {raw[:80]!r}")
        key = (_SAVE_FLAGS[tokens[1]], tokens[2])
        opts = dict(zip(tokens[3::2], tokens[4::2], strict=False))
        try:
            if tokens[0] == "-A":
                current = services.setdefault(key, VirtualService(*key))
                current.scheduler = opts.get("-s")
                current.persistence_seconds = int(opts["-p"]) if "-p" in opts else None
            elif current is not None and "-r" in tokens:
                real = tokens[tokens.index("-r") + 1]
                server = current.real_servers.setdefault(real, RealServer(real))
                weight = tokens[tokens.index("-w") + 1] if "-w" in tokens else None
                server.weight = int(weight) if weight is not None else None
        except (ValueError, IndexError) as exc:
            raise DiagnosticsOutputError(f"ipvsadm -Sn line {lineno}: {raw[:80]!r} ({exc})") from None


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def service_virtual_addresses(service: DiagnoseService) -> set[tuple[str, str]]:
    """(protocol, ip:port) of the Service's ClusterIP virtual servers."""
    return {(p.protocol, _host_port(ip, p.port)) for ip in service.cluster_ips for p in service.ports}


# ---- conntrack ----

@dataclass
class ConntrackCounts:
    entries: dict[str, int] = field(default_factory=dict)  # reply source ip:port -> entries
    established: dict[str, int] = field(default_factory=dict)
    truncated: bool = False


def count_flows(flows: Iterable[conntrack_mod.Flow], counts: ConntrackCounts | None = None) -> ConntrackCounts:
    """Entries by the endpoint they were NATed to: the reply direction's source.

    ESTABLISHED is TCP's state; a UDP flow that has seen its reply counts as established too (it is
    what keeps a UDP client on one endpoint).
    """
    counts = counts if counts is not None else ConntrackCounts()
    for flow in flows:
        endpoint = _host_port(flow.reply_src, flow.reply_sport) if flow.reply_sport is not None else flow.reply_src
        counts.entries[endpoint] = counts.entries.get(endpoint, 0) + 1
        if flow.state == "ESTABLISHED" or (flow.protocol == "udp" and not flow.unreplied):
            counts.established[endpoint] = counts.established.get(endpoint, 0) + 1
    return counts


@dataclass(frozen=True)
class ConntrackQuery:
    """Which of a Service's flows one look-up counts: original destination (address and) port."""

    family: int  # 4 or 6
    protocol: str  # conntrack's name: tcp, udp, sctp
    dport: int
    dst: str | None = None  # None: any destination address (a NodePort, on whichever node address)

    def matches(self, flow: conntrack_mod.Flow) -> bool:
        if flow.protocol != self.protocol or flow.dport != self.dport:
            return False
        if self.dst is None:
            return ":" not in flow.dst if self.family == 4 else ":" in flow.dst
        return flow.dst == self.dst

    def argv(self) -> list[str]:
        """The same look-up filtered by the kernel: for a table too large to be read whole."""
        family = "ipv6" if self.family == 6 else "ipv4"
        return ["conntrack", "-L", "-f", family, "-p", self.protocol, "-o", "xml", "--orig-port-dst",
                str(self.dport), *(["--orig-dst", self.dst] if self.dst is not None else [])]


def conntrack_queries(service: DiagnoseService) -> list[ConntrackQuery]:
    """One look-up per ClusterIP and port, and one per nodePort (any IPv4 node address)."""
    queries: list[ConntrackQuery] = []
    for ip in service.cluster_ips:
        family = ipaddress.ip_address(ip).version
        for p in service.ports:
            queries.append(ConntrackQuery(family, p.protocol.lower(), p.port, ip))
    for p in service.ports:
        if p.node_port:
            queries.append(ConntrackQuery(4, p.protocol.lower(), p.node_port))
    return queries


def dump_argv(family: int, protocol: str) -> list[str]:
    """The whole table of one family and protocol: one dump serves every Service of a request."""
    return ["conntrack", "-L", "-f", "ipv6" if family == 6 else "ipv4", "-p", protocol, "-o", "xml"]


def bucket_flows(flows: Iterable[conntrack_mod.Flow],
                 queries: Iterable[ConntrackQuery]) -> dict[ConntrackQuery, list[conntrack_mod.Flow]]:
    """Each query's flows out of one dump, as the kernel's filter would have chosen them. Pure.

    One pass over the flows with an index by (protocol, destination port), so a dump of N flows and
    Q look-ups costs about N + Q, not N * Q. A flow two queries match is in both, as it was when each
    query was its own `conntrack -L`.
    """
    by_port: dict[tuple[str, int], list[ConntrackQuery]] = {}
    out: dict[ConntrackQuery, list[conntrack_mod.Flow]] = {}
    for query in queries:
        by_port.setdefault((query.protocol, query.dport), []).append(query)
        out[query] = []
    for flow in flows:
        if flow.dport is None:
            continue
        for query in by_port.get((flow.protocol, flow.dport), ()):
            if query.matches(flow):
                out[query].append(flow)
    return out


# ---- one Service ----

def _endpoint_matches(listed: str, counted: str) -> bool:
    """A request's endpoint (ip:port, or ip alone) and a counted ip:port name the same endpoint."""
    if listed == counted:
        return True
    ip = counted.rsplit(":", 1)[0].strip("[]")
    return listed.strip("[]") == ip


def _error(tool: str, exc: Exception) -> str:
    return f"{tool}: {exc}"[:ERROR_LENGTH]


@dataclass
class Readers:
    """The node's tools, as seams: tests give text, the agent runs the programs.

    Within one request each command runs once (serve() gives every request a fresh cache): eight
    Services on a node with 10,000 must not cost eight iptables-save dumps.
    """

    runner: Runner = run
    proc_root: Path = Path("/proc")
    _cache: dict[tuple[str, ...], tuple[str, bool]] = field(default_factory=dict, init=False, repr=False)

    _dumps: dict[tuple[int, str], tuple[list[conntrack_mod.Flow], bool] | Exception] = field(
        default_factory=dict, init=False, repr=False)
    _dump_pays: bool | None = field(default=None, init=False, repr=False)  # asked once per request

    def text(self, argv: list[str], limit: int) -> tuple[str, bool]:
        key = tuple(argv)
        if key not in self._cache:
            out = self.runner(argv, timeout=TOOL_TIMEOUT_SECONDS).stdout
            self._cache[key] = (out[:limit], True) if len(out) > limit else (out, False)
        return self._cache[key]

    def conntrack_dump(self, family: int, protocol: str) -> tuple[list[conntrack_mod.Flow], bool]:
        """The table's flows of one family and protocol, read and parsed once per request (flows, cut).

        A failure is kept too: the next Service of the request gets the same error, not another try.
        """
        key = (family, protocol)
        if key not in self._dumps:
            try:
                text, cut = self.text(dump_argv(family, protocol), MAX_SAVE_BYTES)
                flows, cut_flows = conntrack_mod.parse_flows(text, max_flows=MAX_CONNTRACK_FLOWS)
                self._dumps[key] = (flows, cut or cut_flows)
            except (CommandError, conntrack_mod.ConntrackOutputError) as exc:
                self._dumps[key] = exc
        found = self._dumps[key]
        if isinstance(found, Exception):
            raise found
        return found

    def conntrack_flows(self, queries: list[ConntrackQuery]) -> tuple[dict[ConntrackQuery, list[conntrack_mod.Flow]],
                                                                      bool]:
        """Each query's flows (query -> flows, truncated).

        From one dump per family and protocol, bucketed here: the look-ups of a request were one
        `conntrack -L` each (0.3-0.45 s per node for eight Services, a process start apiece). On a
        table larger than conntrack_mod.DUMP_MAX_ENTRIES (nf_conntrack_count), or where the dump is
        cut at its bounds, the kernel filters each query instead, as before: a busy node's table is
        not printed and parsed whole, and its counts stay whole.
        """
        out: dict[ConntrackQuery, list[conntrack_mod.Flow]] = {}
        truncated = False
        groups: dict[tuple[int, str], list[ConntrackQuery]] = {}
        for query in queries:
            groups.setdefault((query.family, query.protocol), []).append(query)
        if groups and self._dump_pays is None:
            self._dump_pays = conntrack_mod.dump_pays(conntrack_mod.table_entries(self.proc_root))
        for (family, protocol), group in groups.items():
            if self._dump_pays:
                flows, cut = self.conntrack_dump(family, protocol)
                if not cut:
                    out.update(bucket_flows(flows, group))
                    continue
            for query in group:
                text, cut_text = self.text(query.argv(), MAX_SAVE_BYTES)
                found, cut_flows = conntrack_mod.parse_flows(text, max_flows=MAX_CONNTRACK_FLOWS)
                # The kernel's filter and ours agree; ours also drops what a lenient filter let through.
                out[query] = bucket_flows(found, [query])[query]
                truncated |= cut_text or cut_flows
        return out, truncated


@dataclass
class _RuleCounts:
    """What a mode's own rules or tables counted for one Service (nothing for a mode that counts nothing)."""

    rules: list[str] = field(default_factory=list)
    flows: dict[str, int] = field(default_factory=dict)
    packets: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    scheduler: str | None = None
    persistence: int | None = None
    truncated: bool = False
    errors: list[str] = field(default_factory=list)


def _iptables_counters(service: DiagnoseService, readers: Readers, out: _RuleCounts) -> None:
    families = {ipaddress.ip_address(ip).version for ip in service.cluster_ips} or {4}
    for version in sorted(families):
        tool = "iptables-save" if version == 4 else "ip6tables-save"
        try:
            text, cut = readers.text([tool, "-c", "-t", "nat"], MAX_SAVE_BYTES)
            chain_counts = parse_iptables_counters(text, service.key)
            out.truncated |= cut
            out.rules += [f"{chain[:80]} ({n} rules)" for chain, n in chain_counts.chains.items()]
            if chain_counts.chains_cut:
                out.rules.append(f"... more than {MAX_RULES} chains of it in {tool}, not listed")
            for endpoint, n in chain_counts.flows.items():
                out.flows[endpoint] = out.flows.get(endpoint, 0) + n
        except (CommandError, DiagnosticsOutputError) as exc:
            out.errors.append(_error(tool, exc))


def _ipvs_counters(service: DiagnoseService, readers: Readers, out: _RuleCounts) -> None:
    if not (readers.proc_root / "net" / "ip_vs").exists():
        out.errors.append("ipvs: the kernel has no IPVS (/proc/net/ip_vs is missing)")
        return
    try:
        text, cut = readers.text(["ipvsadm", "-Ln", "--stats", "--exact"], MAX_IPVS_BYTES)
        virtual = parse_ipvs_stats(text)
        save, cut2 = readers.text(["ipvsadm", "-Sn"], MAX_IPVS_BYTES)
        merge_ipvs_save(virtual, save)
        out.truncated |= cut or cut2
        for vkey in sorted(service_virtual_addresses(service)):
            vs = virtual.get(vkey)
            if vs is None:
                continue
            out.rules.append((f"{vs.protocol} {vs.address} {vs.scheduler or '?'}"
                              + (f" persistent {vs.persistence_seconds}" if vs.persistence_seconds else ""))[:96])
            out.scheduler = out.scheduler or vs.scheduler
            out.persistence = out.persistence or vs.persistence_seconds
            for real in vs.real_servers.values():
                out.flows[real.address] = out.flows.get(real.address, 0) + real.conns
                out.packets[real.address] = out.packets.get(real.address, 0) + real.in_packets
                if real.weight is not None:
                    out.weights[real.address] = real.weight
    except (CommandError, DiagnosticsOutputError) as exc:
        out.errors.append(_error("ipvsadm", exc))


# One reader per source of per-endpoint counters; which source a mode has is its fact (ModeFacts.counters).
RULE_COUNTERS: dict[CounterSource, Callable[[DiagnoseService, Readers, _RuleCounts], None]] = {
    "iptables": _iptables_counters,
    "ipvs": _ipvs_counters,
}


def read_service(service: DiagnoseService, mode: str | None, readers: Readers | None = None) -> ServiceCounters:
    """What the kernel counted for one Service on this node; errors are reported, never raised."""
    readers = readers or Readers()
    key = service.key
    facts = facts_of(mode)
    source: CounterSource = facts.counters if facts is not None else "conntrack"
    counted_by_rules = RULE_COUNTERS.get(source)
    found = _RuleCounts()
    if counted_by_rules is not None:
        counted_by_rules(service, readers, found)
    errors, truncated, rules, flows, packets, weights = (found.errors, found.truncated, found.rules, found.flows,
                                                          found.packets, found.weights)
    scheduler, persistence = found.scheduler, found.persistence
    conntrack = ConntrackCounts()
    try:
        by_query, cut = readers.conntrack_flows(conntrack_queries(service))
        for flows_seen in by_query.values():
            count_flows(flows_seen, conntrack)
        truncated |= cut
    except (CommandError, conntrack_mod.ConntrackOutputError) as exc:
        errors.append(_error("conntrack", exc))
    counted = [*flows, *conntrack.entries]
    # Listed endpoints first (a request may name one by ip alone); then anything the kernel still sends
    # to that no EndpointSlice lists any more (a stale rule or old flows), which is worth seeing.
    strays = [c for c in counted if not any(_endpoint_matches(e, c) for e in service.endpoints)]
    endpoints: list[EndpointCounters] = []
    for name in dict.fromkeys([*service.endpoints, *strays]):
        def total(table: dict[str, int], name: str = name) -> int:
            return sum(v for k, v in table.items() if _endpoint_matches(name, k))
        endpoints.append(EndpointCounters(
            address=name[:64],
            flows=total(flows) if source != "conntrack" else None,
            packets=total(packets) if packets else None,
            weight=next((w for k, w in weights.items() if _endpoint_matches(name, k)), None),
            conntrack_entries=total(conntrack.entries),
            conntrack_established=total(conntrack.established),
        ))
    if len(rules) > MAX_RULES:
        rules = [*rules[:MAX_RULES - 1], f"... {len(rules) - MAX_RULES + 1} more not listed"]
    if len(endpoints) > MAX_ENDPOINTS:
        endpoints, truncated = endpoints[:MAX_ENDPOINTS], True
    if not rules and not flows and counted_by_rules is not None and not errors:
        errors.append(f"no {mode} rules for {key} on this node")
    return ServiceCounters(service=key, source=source if (rules or flows or conntrack.entries) else "none",
                           rules=rules, scheduler=scheduler, persistence_seconds=persistence,
                           endpoints=endpoints, errors=errors[:MAX_ERRORS], truncated=truncated)


def serve(request: DiagnoseRequest, mode: str | None, readers: Readers | None = None,
          clock: Callable[[], float] = time.time) -> NodeDiagnostics:
    """Answer one request: every Service in it, read from the kernel now."""
    started = clock()
    fresh = dataclasses.replace(readers) if readers is not None else Readers()
    services = [read_service(s, mode, fresh) for s in request.services[:MAX_DIAGNOSE_SERVICES]]
    return NodeDiagnostics(id=request.id, mode=mode,
                           taken_at=datetime.fromtimestamp(clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           duration_seconds=round(max(0.0, clock() - started), 3), services=services)


def pending_request(obj: dict[str, Any], answered: str | None) -> dict[str, Any] | None:
    """The ProxyNode's spec.diagnose if its id is not answered yet (in status, or by this agent in memory)."""
    body = (obj.get("spec") or {}).get("diagnose")
    if not isinstance(body, dict) or not isinstance(body.get("id"), str):
        return None
    status = obj.get("status") or {}
    distribution = status.get("distribution") or {}
    done = {(status.get("diagnostics") or {}).get("id"), (distribution.get("before") or {}).get("id"),
            (distribution.get("after") or {}).get("id"), answered}
    return None if body["id"] in done else body


def answer_patch(body: dict[str, Any], mode: str | None,
                 read: Callable[[DiagnoseRequest, str | None], NodeDiagnostics] = serve) -> dict[str, Any]:
    """The status patch answering a request, its counters from `read` (the agent's NodeEffects.diagnose);
    a bad request is answered with its error rather than ignored."""
    record = body.get("record") if body.get("record") in ("before", "after") else None
    try:
        answer = read(DiagnoseRequest.model_validate(body), mode)
    except Exception as exc:  # an answer must come, whatever the request or the node says
        answer = NodeDiagnostics(id=str(body.get("id"))[:253], mode=mode,
                                 error=f"{exc.__class__.__name__}: {exc}"[:400])
    # The whole object with nulls, so no field of the previous answer survives the merge patch.
    data = answer.model_dump(by_alias=True, mode="json")
    return {"distribution": {record: data}} if record else {"diagnostics": data}
