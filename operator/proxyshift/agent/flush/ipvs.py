"""Flush of ipvs mode: only kube-proxy's virtual servers, then kube-ipvs0, then its ipsets.

kube-proxy's own ipvs cleanup flushes every virtual server on the host,
including a keepalived or a user's own. Here a virtual server is removed only
when kube-proxy demonstrably owned its address: bound on kube-ipvs0 or listed
in its service-address ipsets (KUBE-CLUSTER-IP, ...), or it is a NodePort whose
port is in kube-proxy's NodePort sets. Everything else stays.

When the kernel has no IPVS (no /proc/net/ip_vs), no virtual server can exist:
the flusher says so, never calls ipvsadm (which would try to load ip_vs), and
still removes a kube-ipvs0 dummy or KUBE-* sets if an old kube-proxy left them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from proxyshift.agent.flush.base import FlushStep, Runner
from proxyshift.agent.ip_addr import addresses
from proxyshift.agent.ownership import (
    IPVS_ADDRESS_SETS,
    IPVS_DUMMY_INTERFACE,
    IPVS_NODEPORT_SETS,
    Mode,
    is_kube_proxy_ipset,
)
from proxyshift.commands import CommandError, ToolMissingError, run
from proxyshift.modes import kind_is_stale

_PROTO_FLAGS = {"-t": "tcp", "-u": "udp", "--sctp-service": "sctp", "-f": "fwmark"}


class IpvsadmOutputError(ValueError):
    """ipvsadm -Sn printed a line we do not understand."""


@dataclass(frozen=True)
class VirtualServer:
    protocol: str            # tcp, udp, sctp or fwmark
    address: str | None      # normalised IP text (None for fwmark services)
    port: int | None
    fwmark: int | None
    service_arg: str         # "-t 10.96.0.1:443": what `ipvsadm -D` needs
    scheduler: str | None = None

    def key(self) -> str:
        return self.service_arg

    def describe(self) -> str:
        """For a person, as ipvsadm -Ln names it: "TCP 198.18.5.1:80 rr", "FWM 7 sh"."""
        if self.protocol == "fwmark":
            where = f"FWM {self.fwmark}"
        else:
            host = f"[{self.address}]" if self.address and ":" in self.address else self.address
            where = f"{self.protocol.upper()} {host}:{self.port}"
        return f"{where} {self.scheduler}" if self.scheduler else where


def _split_hostport(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    return str(ipaddress.ip_address(host)), int(port)


def parse_ipvsadm_save(text: str) -> list[VirtualServer]:
    """Virtual servers (the -A lines) of `ipvsadm -Sn` output; real servers (-a) are ignored."""
    services: list[VirtualServer] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        tokens = line.split()
        if not tokens or tokens[0] != "-A":
            continue
        if len(tokens) < 3 or tokens[1] not in _PROTO_FLAGS:
            raise IpvsadmOutputError(f"ipvsadm -Sn line {lineno}: {line[:80]!r}")
        proto = _PROTO_FLAGS[tokens[1]]
        options = tokens[3:]
        scheduler = options[options.index("-s") + 1] if "-s" in options[:-1] else None
        try:
            if proto == "fwmark":
                services.append(VirtualServer(proto, None, None, int(tokens[2]), f"-f {tokens[2]}", scheduler))
            else:
                addr, port = _split_hostport(tokens[2])
                services.append(VirtualServer(proto, addr, port, None, f"{tokens[1]} {tokens[2]}", scheduler))
        except ValueError as exc:
            raise IpvsadmOutputError(f"ipvsadm -Sn line {lineno}: {line[:80]!r} ({exc})") from exc
    return services


@dataclass
class IpsetState:
    """kube-proxy's ipsets: their names and the members that matter for ownership."""

    names: list[str] = field(default_factory=list)
    service_addresses: set[str] = field(default_factory=set)
    nodeports: dict[str, set[int]] = field(default_factory=dict)


def parse_ipset_save(text: str) -> IpsetState:
    """kube-proxy's sets in `ipset save` output; a user's sets are not looked at."""
    state = IpsetState()
    nodeport_set_proto = {name: proto for proto, names in IPVS_NODEPORT_SETS.items() for name in names}
    for line in text.splitlines():
        tokens = line.split()
        if len(tokens) < 2 or not is_kube_proxy_ipset(tokens[1]):
            continue
        if tokens[0] == "create":
            state.names.append(tokens[1])
        elif tokens[0] == "add" and len(tokens) >= 3:
            name, member = tokens[1], tokens[2]
            if name in IPVS_ADDRESS_SETS:
                # hash:ip,port members: "10.96.0.1,tcp:443" or "fd00::1,tcp:443"
                host = member.split(",", 1)[0]
                try:
                    state.service_addresses.add(str(ipaddress.ip_address(host)))
                except ValueError:
                    continue
            elif name in nodeport_set_proto:
                port = member.rsplit(":", 1)[-1]
                if port.isdigit():
                    state.nodeports.setdefault(nodeport_set_proto[name], set()).add(int(port))
    return state


def select_owned(services: list[VirtualServer], dummy_addresses: set[str], ipsets: IpsetState,
                 node_addresses: set[str]) -> list[VirtualServer]:
    """Pure: the virtual servers kube-proxy created, by the evidence it left behind."""
    service_addresses = dummy_addresses | ipsets.service_addresses
    owned = []
    for vs in services:
        if vs.address is None:
            continue  # kube-proxy never creates fwmark services
        is_service = vs.address in service_addresses
        is_nodeport = vs.address in node_addresses and vs.port in ipsets.nodeports.get(vs.protocol, set())
        if is_service or is_nodeport:
            owned.append(vs)
    return owned


def select_foreign(services: list[VirtualServer], dummy_addresses: set[str], ipsets: IpsetState,
                   node_addresses: set[str]) -> list[VirtualServer]:
    """Pure: the virtual servers kube-proxy did not create (a keepalived's, a hand-made LVS), by the
    same evidence as select_owned: everything it does not claim."""
    owned = {vs.key() for vs in select_owned(services, dummy_addresses, ipsets, node_addresses)}
    return [vs for vs in services if vs.key() not in owned]


@dataclass
class IpvsFlusher:
    run: Runner = run
    proc_root: Path = Path("/proc")
    dry_run: bool = False

    def kernel_has_ipvs(self) -> bool:
        return (self.proc_root / "net" / "ip_vs").exists()

    def _dummy_addresses(self) -> tuple[bool, set[str]]:
        try:
            out = self.run(["ip", "-j", "addr", "show", "dev", IPVS_DUMMY_INTERFACE], timeout=10)
        except CommandError as exc:
            if "does not exist" in (exc.stderr or str(exc)):
                return False, set()
            raise
        return True, set(addresses(out.stdout))

    def _ipsets(self, step: FlushStep) -> IpsetState:
        try:
            return parse_ipset_save(self.run(["ipset", "save"], timeout=60).stdout)
        except ToolMissingError:
            step.skipped.append("ipset not installed: no kube-proxy ipsets can be listed or removed")
            return IpsetState()

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        if not kind_is_stale("ipvs-objects", remove_modes, target_mode):
            return []
        step = FlushStep("ipvs")
        try:
            has_dummy, dummy_addrs = self._dummy_addresses()
            ipsets = self._ipsets(step)
            if self.kernel_has_ipvs():
                services = parse_ipvsadm_save(self.run(["ipvsadm", "-Sn"], timeout=60).stdout)
                all_addrs = set(addresses(self.run(["ip", "-j", "addr", "show"], timeout=10).stdout))
                owned = select_owned(services, dummy_addrs, ipsets, all_addrs - dummy_addrs)
                if owned and not self.dry_run:
                    script = "".join(f"-D {vs.service_arg}\n" for vs in owned)
                    self.run(["ipvsadm", "-R"], input=script, timeout=120)
                step.add("virtual servers", len(owned))
                kept = len(services) - len(owned)
                if kept:
                    step.skipped.append(f"{kept} virtual servers not created by kube-proxy left in place")
            else:
                step.skipped.append("this kernel has no IPVS (no /proc/net/ip_vs): no virtual servers can "
                                    "exist, none touched")
            if self.dry_run:
                step.add("interfaces", int(has_dummy))
                step.add("ipsets", len(ipsets.names))
                if step.removed:
                    step.skipped.append("dry run: nothing changed")
                return [step]
            if has_dummy:
                self.run(["ip", "link", "del", IPVS_DUMMY_INTERFACE], timeout=10)
                step.add("interfaces", 1)
            if ipsets.names:
                script = "".join(f"destroy {name}\n" for name in ipsets.names)
                try:
                    self.run(["ipset", "restore"], input=script, timeout=60)
                    step.add("ipsets", len(ipsets.names))
                except CommandError:
                    # ipset restore stops at the first set it cannot destroy, typically one
                    # still referenced by a user's rule. Go on set by set and name the rest.
                    in_use = []
                    for name in parse_ipset_save(self.run(["ipset", "save"], timeout=60).stdout).names:
                        try:
                            self.run(["ipset", "destroy", name], timeout=30)
                        except CommandError:
                            in_use.append(name)
                    step.add("ipsets", len(ipsets.names) - len(in_use))
                    if in_use:
                        step.errors.append(f"ipsets still referenced (by a rule outside kube-proxy's chains?), "
                                           f"left in place: {in_use}")
        except (CommandError, IpvsadmOutputError, ValueError) as exc:
            step.errors.append(str(exc))
        return [step]
