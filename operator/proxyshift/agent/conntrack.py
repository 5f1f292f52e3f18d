"""The node's conntrack table: read flows (for endpoint identities) and the post-switch cleanup.

NAT is decided on a flow's first packet. A connection attempted while the node had no Service rules
(between the old kube-proxy's cleanup and the new one's first sync) gets a conntrack entry without
DNAT, and the client's retransmissions keep matching it after the rules exist: a TCP connect hangs
through its SYN retries, a UDP flow with a fixed source port goes nowhere until the entry times out.
kube-proxy 1.37 deletes such UDP entries itself (pkg/proxy/conntrack CleanStaleEntries: for every UDP
Service with serving endpoints, entries to its ClusterIP/LB/external IP:port or NodePort whose reply
source is not a serving endpoint) and nothing for TCP. `clean_unnated` deletes exactly the entries
that are still un-NATed after the new kube-proxy synced: TCP SYN_SENT, UDP unreplied, original
destination a Service address, reply source equal to the original destination. Nothing else.

The table is read with `conntrack -L -o xml` (structured, one element per flow) and parsed with the
standard library's XML parser, bounded in bytes and flows. Netlink (pyroute2) would save the
process start, but it is not in the image and the CLI is what a person on the node would run too.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from proxyshift.api.behaviour import MAX_REPORTED_ENTRIES, ConntrackParams, ConntrackReport, Protocol
from proxyshift.commands import CommandError, Result, run

Runner = Callable[..., Result]

MAX_XML_BYTES = 8 * 1024 * 1024  # ~15,000 flows; more is cut, never parsed whole
MAX_FLOWS = 20_000
FEED_BYTES = 64 * 1024  # the XML is parsed this much at a time (parse_flows)
LIST_TIMEOUT_SECONDS = 5.0
DELETE_TIMEOUT_SECONDS = 2.0
PROTOCOL_NAMES: dict[Protocol, str] = {"TCP": "tcp", "UDP": "udp"}


# A whole-table dump is parsed at ~75 us a flow here (8 MiB, ~15,000 flows, in 1.1 s); a kernel-filtered
# look-up costs a process start (10-100 ms). Up to this many entries one dump beats a dozen look-ups;
# above it the callers let the kernel filter, as a busy node's table is too large to print and parse.
DUMP_MAX_ENTRIES = 2_000


def table_entries(proc_root: Path = Path("/proc")) -> int | None:
    """How many entries the table holds now (every protocol and family), None when it cannot be read."""
    try:
        return int((proc_root / "sys" / "net" / "netfilter" / "nf_conntrack_count").read_text(encoding="ascii",
                                                                                             errors="replace"))
    except (OSError, ValueError):
        return None


def dump_pays(entries: int | None) -> bool:
    """Whether to read the whole table once rather than filter in the kernel per look-up. An unknown
    size is tried: the dump is bounded, and a cut one falls back to the filtered look-ups."""
    return entries is None or entries <= DUMP_MAX_ENTRIES


class ConntrackOutputError(ValueError):
    """conntrack printed something that is not its XML flow list."""


@dataclass(frozen=True)
class Flow:
    """One conntrack entry, as far as the agent needs it."""

    protocol: str  # "tcp", "udp", ...
    src: str
    dst: str
    sport: int | None
    dport: int | None
    reply_src: str
    reply_dst: str
    reply_sport: int | None
    reply_dport: int | None
    state: str | None  # TCP state (SYN_SENT, ESTABLISHED, ...); None for other protocols
    unreplied: bool

    @property
    def nated(self) -> bool:
        """Whether the reply comes from somewhere else than the original destination (DNAT happened)."""
        return (self.reply_src, self.reply_sport) != (self.dst, self.dport)

    def describe(self) -> str:
        return f"{self.protocol} {self.src}:{self.sport} -> {self.dst}:{self.dport}"


def _port(text: str | None) -> int | None:
    if text is None or not text.strip().isdigit():
        return None
    value = int(text)
    return value if 0 <= value <= 65535 else None


def _flow(elem: ET.Element) -> Flow | None:
    metas = {m.get("direction"): m for m in elem.findall("meta")}
    orig, reply, independent = metas.get("original"), metas.get("reply"), metas.get("independent")
    if orig is None or reply is None:
        return None

    def layer(meta: ET.Element) -> tuple[str | None, str | None, str | None, int | None, int | None]:
        l3, l4 = meta.find("layer3"), meta.find("layer4")
        src = l3.findtext("src") if l3 is not None else None
        dst = l3.findtext("dst") if l3 is not None else None
        proto = l4.get("protoname") if l4 is not None else None
        sport = _port(l4.findtext("sport")) if l4 is not None else None
        dport = _port(l4.findtext("dport")) if l4 is not None else None
        return proto, src, dst, sport, dport

    proto, src, dst, sport, dport = layer(orig)
    _, rsrc, rdst, rsport, rdport = layer(reply)
    if not (proto and src and dst and rsrc and rdst):
        return None
    state = independent.findtext("state") if independent is not None else None
    unreplied = independent is not None and independent.find("unreplied") is not None
    return Flow(proto[:16], src[:45], dst[:45], sport, dport, rsrc[:45], rdst[:45], rsport, rdport,
                state[:16] if state else None, unreplied)


def parse_flows(text: str, *, max_flows: int = MAX_FLOWS,
                max_bytes: int = MAX_XML_BYTES) -> tuple[list[Flow], bool]:
    """`conntrack -L -o xml` output -> (flows, truncated). Empty output is an empty table.

    Raises ConntrackOutputError when the text is not conntrack's XML. Output beyond `max_bytes` is
    not parsed (truncated), and at most `max_flows` flows are returned.
    """
    if not text.strip():
        return [], False
    truncated = False
    data = text.encode("utf-8", "replace")
    if len(data) > max_bytes:
        # Cut at the last whole flow inside the bound and close the document ourselves.
        cut = data.rfind(b"</flow>", 0, max_bytes)
        data = data[:cut + len(b"</flow>")] + b"</conntrack>" if cut >= 0 else b"<conntrack></conntrack>"
        truncated = True
    parser: ET.XMLPullParser[ET.Element] = ET.XMLPullParser(events=("end",))
    flows: list[Flow] = []
    root_seen = False
    # Fed a slice at a time, each flow cleared once read: fed whole, a 2,000-flow dump (~1 MB) became a tree
    # of ~110,000 objects before the first flow was read, a ~12 MiB peak per dump that fragmented the agent's
    # heap (its RSS grew ~1.4 MiB per migration in the soak). None closes the document.
    slices = (data[offset:offset + FEED_BYTES] for offset in range(0, len(data), FEED_BYTES))
    try:
        for piece in itertools.chain(slices, [None]):
            if piece is None:
                parser.close()
            else:
                parser.feed(piece)
            # Only "end" events were asked for: each is (event, element), never the namespace tuples.
            for _, elem in cast(Iterator[tuple[str, ET.Element]], parser.read_events()):
                if elem.tag == "flow":
                    if len(flows) < max_flows:
                        flow = _flow(elem)
                        if flow is not None:
                            flows.append(flow)
                    else:
                        truncated = True
                    elem.clear()
                elif elem.tag == "conntrack":
                    root_seen = True
    except ET.ParseError as exc:
        raise ConntrackOutputError(f"conntrack output is not its XML flow list: {exc}") from None
    if not root_seen:
        raise ConntrackOutputError("conntrack output has no <conntrack> document")
    return flows, truncated


def list_flows(protocol: Protocol, *, source: str | None = None, state: str | None = None, family: int = 4,
               runner: Runner = run, timeout: float = LIST_TIMEOUT_SECONDS) -> tuple[list[Flow], bool]:
    """The table's flows of one protocol and IP family (conntrack lists IPv4 unless told), optionally
    only those from `source` (an address) or in a TCP `state`: the kernel filters, so a busy node's
    table is not printed whole."""
    filters = [*(["-f", "ipv6"] if family == 6 else []), *(["-s", source] if source else []),
               *(["--state", state] if state else [])]
    # conntrack exits 0 with an empty table; non-zero means it could not read it.
    result = runner(["conntrack", "-L", "-p", PROTOCOL_NAMES[protocol], "-o", "xml", *filters], timeout=timeout)
    return parse_flows(result.stdout)


class ServiceDestinations:
    """Whether an address:port is a Service frontend: a ClusterIP/external address, or a NodePort here."""

    def __init__(self, params: ConntrackParams, local_addresses: Iterable[str]) -> None:
        self.networks = [ipaddress.ip_network(c, strict=False) for c in params.service_cidrs]
        self.addresses = {ipaddress.ip_address(a) for a in params.service_ips}
        self.node_ports = set(params.node_ports)
        self.local = {ipaddress.ip_address(a) for a in local_addresses}

    @property
    def families(self) -> list[int]:
        """The IP families the Service destinations are in: the table is listed once per family."""
        found = {n.version for n in self.networks} | {a.version for a in self.addresses}
        if self.node_ports:
            found |= {a.version for a in self.local} or {4}
        return sorted(found)

    def __contains__(self, dest: tuple[str, int | None]) -> bool:
        address, port = dest
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if ip in self.addresses or any(ip in net for net in self.networks):
            return True
        return port is not None and port in self.node_ports and (ip in self.local or ip.is_loopback)


def stale_flows(flows: Iterable[Flow], services: ServiceDestinations, protocol: Protocol) -> list[Flow]:
    """The flows the step deletes: un-NATed, not yet answered, to a Service frontend. Pure."""
    out = []
    for flow in flows:
        if flow.protocol != PROTOCOL_NAMES[protocol] or flow.nated or (flow.dst, flow.dport) not in services:
            continue
        if protocol == "TCP" and flow.state != "SYN_SENT":
            continue
        if protocol == "UDP" and not flow.unreplied:
            continue
        out.append(flow)
    return out


def delete_argv(flow: Flow) -> list[str]:
    """Delete exactly this entry: its full original tuple, and a reply source equal to the original
    destination, so a NATed entry made meanwhile by a retransmission for the same tuple stays."""
    family = ["-f", "ipv6"] if ":" in flow.dst else []
    return ["conntrack", "-D", *family, "-p", flow.protocol, "-s", flow.src, "-d", flow.dst,
            "--sport", str(flow.sport), "--dport", str(flow.dport), "-r", flow.dst]


def delete_destination_argv(flow: Flow) -> list[str]:
    """Delete every un-NATed SYN_SENT entry to this flow's destination in one call.

    The filters are the step's own predicate: original destination X:port, reply source X (no DNAT),
    TCP SYN_SENT. A NATed entry made meanwhile by a retransmission has the endpoint as its reply
    source and stays. One call per destination instead of one per entry: the step runs right after
    the new kube-proxy's first sync, and every ~10 ms saved is a retransmission more that is NATed.
    """
    family = ["-f", "ipv6"] if ":" in flow.dst else []
    return ["conntrack", "-D", *family, "-p", "tcp", "-d", flow.dst, "--dport", str(flow.dport),
            "-r", flow.dst, "--state", "SYN_SENT"]


_DELETED = re.compile(r"(\d+) flow entries have been deleted")


def _deleted_count(result: Result, fallback: int) -> int:
    """conntrack -D says on stderr how many entries it deleted; exit 1 with 0 deleted is no error."""
    found = _DELETED.search(result.stderr or "")
    return int(found.group(1)) if found else (fallback if result.returncode == 0 else 0)


def _delete_tcp(candidates: list[Flow], budget: int, runner: Runner, report: ConntrackReport) -> int:
    """Batched per destination while the whole destination fits the budget, entry by entry after."""
    by_destination: dict[tuple[str, int | None], list[Flow]] = {}
    for flow in candidates:
        by_destination.setdefault((flow.dst, flow.dport), []).append(flow)
    for flows in by_destination.values():
        if budget <= 0:
            break
        if len(flows) <= budget:
            result = runner(delete_destination_argv(flows[0]), timeout=DELETE_TIMEOUT_SECONDS, check=False)
            deleted = min(_deleted_count(result, len(flows)), budget)
            chosen = flows[:deleted]
        else:
            chosen = [f for f in flows[:budget]
                      if runner(delete_argv(f), timeout=DELETE_TIMEOUT_SECONDS, check=False).returncode == 0]
            deleted = len(chosen)
        budget -= deleted
        report.deleted_tcp += deleted
        room = MAX_REPORTED_ENTRIES - len(report.entries)
        report.entries.extend(f.describe() for f in chosen[:max(room, 0)])
    return budget


def clean_unnated(params: ConntrackParams, local_addresses: Sequence[str], *,
                  runner: Runner = run) -> ConntrackReport:
    """Delete the un-NATed entries to Service addresses left from before the new rules existed."""
    report = ConntrackReport()
    try:
        services = ServiceDestinations(params, local_addresses)
    except ValueError as exc:
        return report.model_copy(update={"error": f"bad conntrack params: {exc}"[:300]})
    budget = params.max_deletions
    for protocol, family in ((p, f) for p in params.protocols for f in services.families):
        try:
            flows, cut = list_flows(protocol, state="SYN_SENT" if protocol == "TCP" else None, family=family,
                                    runner=runner)
        except (CommandError, ConntrackOutputError) as exc:
            return report.model_copy(update={"error": str(exc)[:300]})
        candidates = stale_flows(flows, services, protocol)
        report.scanned += sum(1 for f in flows if (f.dst, f.dport) in services)
        report.truncated |= cut or len(candidates) > budget
        if protocol == "TCP":
            budget = _delete_tcp(candidates, budget, runner, report)
            continue
        for flow in candidates[:budget]:
            # An entry that went away by itself meanwhile (answered, timed out) is no failure.
            result = runner(delete_argv(flow), timeout=DELETE_TIMEOUT_SECONDS, check=False)
            if result.returncode != 0:
                continue
            budget -= 1
            report.deleted_udp += 1
            if len(report.entries) < MAX_REPORTED_ENTRIES:
                report.entries.append(flow.describe())
    return report
