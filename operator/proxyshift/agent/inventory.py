"""Which kube-proxy modes have objects on this node right now, and which of them are leftovers.

Read-only: iptables-save per family/backend, `nft -j list tables`, `ipvsadm -Sn`
(only when the kernel has IPVS), `ip -j addr show dev kube-ipvs0`, `ipset save`.
kube-ipvs0's addresses (every ClusterIP, external and load-balancer address an ipvs
kube-proxy bound) are parsed by agent/ip_addr.py (bounded) and kept
sorted, the first MAX_DUMMY_ADDRESSES of them, with their true count.
IPVS virtual servers are split into kube-proxy's and foreign ones (a user's,
keepalived's) by the flush's own decision (flush/ipvs.py select_owned): the
foreign ones are never kube-proxy's objects, but an nftables kube-proxy deletes
them at every start, so they are reported apart (status.foreignIPVS).
A chain used by both iptables and ipvs mode (KUBE-SERVICES, ...) is counted
for the mode that runs or that left other traces, and is never a leftover
while kube-proxy runs in one of the two.

Which mode an object counts for is the modes' facts: chains by their owners
(ownership.py), every other kind (IPVS objects, nft tables) for the modes whose
ModeFacts.objects name it; this module has one probe, count and summary per kind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from proxyshift.agent.flush.base import Runner
from proxyshift.agent.flush.bpf import DEFAULT_BPFFS, is_bpffs, plan_pins
from proxyshift.agent.flush.devices import parse_link_names
from proxyshift.agent.flush.iptables import IptablesTool, available_tools
from proxyshift.agent.flush.ipvs import (
    IpsetState,
    VirtualServer,
    parse_ipset_save,
    parse_ipvsadm_save,
    select_foreign,
    select_owned,
)
from proxyshift.agent.flush.nftables import parse_tables
from proxyshift.agent.ip_addr import addresses
from proxyshift.agent.iptables_save import Dump, parse
from proxyshift.agent.ownership import IPVS_DUMMY_INTERFACE, MODES, NFT_TABLES, Mode, iptables_chain_modes
from proxyshift.api.proxynode import MAX_FOREIGN_VIRTUAL_SERVERS, ForeignIPVS, ModeObjects
from proxyshift.commands import CommandError, Result, ToolMissingError, run, side_by_side
from proxyshift.modes import DEFAULT_MODE, KUBE_PROXY_MODES, MODE_FACTS, ObjectKind

# The addresses kept in the inventory (the count is always the true one).
MAX_DUMMY_ADDRESSES = 1024


@dataclass
class ChainInventory:
    """kube-proxy chains found by one iptables family/backend: (table, chain, modes)."""

    label: str
    chains: list[tuple[str, str, frozenset[Mode]]] = field(default_factory=list)


@dataclass
class Inventory:
    iptables: list[ChainInventory] = field(default_factory=list)
    nft_tables: list[tuple[str, str]] = field(default_factory=list)
    ipvs_available: bool = False
    virtual_servers: list[VirtualServer] = field(default_factory=list)
    kube_virtual_servers: list[VirtualServer] = field(default_factory=list)
    foreign_virtual_servers: list[VirtualServer] = field(default_factory=list)
    dummy_interface: bool = False
    dummy_addresses: list[str] = field(default_factory=list)  # kube-ipvs0's, the first MAX_DUMMY_ADDRESSES
    dummy_address_count: int = 0  # all of them
    ipsets: list[str] = field(default_factory=list)
    # A replacement's devices here (Cilium's cilium_host/cilium_net), by the exact names its facts list.
    replacement_devices: list[str] = field(default_factory=list)
    # A replacement's pinned BPF links in the node's bpffs (Cilium's under /sys/fs/bpf/cilium), at most
    # MAX_PINS counted: each keeps one of its programs attached.
    bpf_link_pins: int = 0
    errors: list[str] = field(default_factory=list)

    def kind_count(self, kind: ObjectKind) -> int:
        """Objects of a kind other than chains (chains are counted per mode, shared ones by attribution)."""
        return KIND_COUNTS[kind].count(self) if kind in KIND_COUNTS else 0

    def _evidence(self) -> set[Mode]:
        """Modes with at least one object no other mode uses."""
        found: set[Mode] = {m for inv in self.iptables for _, _, modes in inv.chains if len(modes) == 1
                            for m in modes}
        found |= {m for m, f in MODE_FACTS.items() if any(self.kind_count(k) for k in f.objects)}
        return found

    @staticmethod
    def _attributed(modes: frozenset[Mode], observed: str | None, evidence: set[Mode]) -> set[Mode]:
        # A chain iptables and ipvs share (KUBE-SERVICES, ...) belongs to the mode that
        # runs, or to the mode whose own objects are here too; failing both, to iptables,
        # the mode every cluster starts in. Never to a mode with no other trace on the node.
        # `evidence` is _evidence(), read once per count or summary by the caller: it walks every chain, and
        # read per chain it made each count quadratic (200 Services a family: seconds for one observe).
        hits = set(modes & evidence)
        if observed in modes:
            hits.add(observed)
        if not hits:
            hits = {DEFAULT_MODE} if DEFAULT_MODE in modes else set(modes)
        return hits

    def count(self, mode: Mode, *, observed: str | None = None, stale_only: bool = False) -> int:
        """Objects of `mode`; stale_only: leave out the chains the observed mode uses too."""
        evidence = self._evidence()
        n = sum(1 for inv in self.iptables for _, _, modes in inv.chains
                if mode in self._attributed(modes, observed, evidence) and not (stale_only and observed in modes))
        return n + sum(self.kind_count(k) for k in MODE_FACTS[mode].objects)

    def summary(self, mode: Mode, observed: str | None = None) -> str:
        parts: list[str] = []
        evidence = self._evidence()
        for inv in self.iptables:
            per_table: dict[str, int] = {}
            for table, _, modes in inv.chains:
                if mode in self._attributed(modes, observed, evidence):
                    per_table[table] = per_table.get(table, 0) + 1
            if per_table:
                parts.append(f"{inv.label}: " + ", ".join(f"{t} {n} chains" for t, n in sorted(per_table.items())))
        for kind in MODE_FACTS[mode].objects:
            if kind in KIND_COUNTS:
                parts += KIND_COUNTS[kind].summary(self)
        return "; ".join(parts)[:512]


def _ipvs_summary(inv: Inventory) -> list[str]:
    parts: list[str] = []
    if inv.kube_virtual_servers:
        parts.append(f"{len(inv.kube_virtual_servers)} virtual servers")
    if inv.dummy_interface:
        n = inv.dummy_address_count
        parts.append(f"{IPVS_DUMMY_INTERFACE} with {n} address{'' if n == 1 else 'es'}")
    if inv.ipsets:
        parts.append(f"{len(inv.ipsets)} ipsets")
    return parts


@dataclass(frozen=True)
class _Kind:
    """How the inventory counts and names one kind of object (chains have their own attribution above)."""

    count: Callable[[Inventory], int]
    summary: Callable[[Inventory], list[str]]


KIND_COUNTS: dict[ObjectKind, _Kind] = {
    # kube-ipvs0 counts once as an interface and once per address bound on it (kube-proxy's too).
    "ipvs-objects": _Kind(lambda inv: len(inv.kube_virtual_servers) + int(inv.dummy_interface)
                          + inv.dummy_address_count + len(inv.ipsets), _ipvs_summary),
    "nft-tables": _Kind(lambda inv: len(inv.nft_tables),
                        lambda inv: ["tables " + ", ".join(f"{f} {n}" for f, n in inv.nft_tables)]
                        if inv.nft_tables else []),
    "replacement-devices": _Kind(lambda inv: len(inv.replacement_devices),
                                 lambda inv: ["devices " + ", ".join(inv.replacement_devices)]
                                 if inv.replacement_devices else []),
    "bpf-attachments": _Kind(lambda inv: inv.bpf_link_pins,
                             lambda inv: [f"{inv.bpf_link_pins} pinned BPF links"] if inv.bpf_link_pins else []),
}

_REPLACEMENT_DEVICES = frozenset(d for f in MODE_FACTS.values() for d in f.owned.devices)
_FIELDS = frozenset(f.name for f in fields(Inventory))


def _fills(*names: str) -> frozenset[str]:
    """The Inventory fields one reader fills, and its `errors` (what it could not read)."""
    unknown = set(names) - _FIELDS
    if unknown:
        raise ValueError(f"not Inventory fields: {sorted(unknown)}")
    return frozenset((*names, "errors"))


# What each reader below fills: the merge takes these fields of its part and no other, so what a reader found
# to be a field's default (no IPVS, no pins) counts as read.
_IPTABLES_FILLS = _fills("iptables")
_NFT_FILLS = _fills("nft_tables")
_IPVS_FILLS = _fills("ipvs_available", "dummy_interface", "dummy_addresses", "dummy_address_count", "ipsets",
                     "virtual_servers", "kube_virtual_servers", "foreign_virtual_servers")
_DEVICES_FILLS = _fills("replacement_devices")
_BPF_LINKS_FILLS = _fills("bpf_link_pins")


@dataclass(frozen=True)
class _Part:
    """One reader's share of an inventory: what it read, and which of its fields it filled."""

    inventory: Inventory
    filled: frozenset[str]


def _devices(inv: Inventory, runner: Runner) -> None:
    try:
        names = parse_link_names(runner(["ip", "-j", "link", "show"], timeout=10.0).stdout)
    except (CommandError, ValueError) as exc:
        inv.errors.append(f"ip -j link: {exc}")
        return
    inv.replacement_devices = sorted(names & _REPLACEMENT_DEVICES)


def _bpf_links(inv: Inventory, bpffs: Path) -> None:
    """Count the replacements' link pins (a filesystem walk of their own bpffs folders; no bpf() call)."""
    try:
        if not is_bpffs(bpffs, Path("/proc/self/mountinfo").read_text(errors="replace")):
            return
        inv.bpf_link_pins = sum(len(plan_pins(bpffs / f.owned.bpffs_dir, f.owned.bpffs_link_dirs).links)
                                for f in MODE_FACTS.values() if f.owned.bpffs_dir is not None)
    except (OSError, ValueError) as exc:
        inv.errors.append(f"bpffs: {exc}")


def _iptables(inv: Inventory, tool: IptablesTool, runner: Runner, read: Dump | None = None) -> None:
    """One family/backend's kube-proxy chains, from its save, or from `read` (a save taken just now)."""
    try:
        dump = read if read is not None else parse(runner([tool.save], timeout=120).stdout)
    except (CommandError, ValueError) as exc:
        inv.errors.append(f"{tool.label}: {exc}")
        return
    found = ChainInventory(tool.label)
    for table in dump.tables.values():
        for chain in table.user_defined():
            modes = iptables_chain_modes(table.name, chain)
            if modes:
                found.chains.append((table.name, chain, modes))
    if found.chains:
        inv.iptables.append(found)


def _nft(inv: Inventory, runner: Runner) -> None:
    try:
        tables = set(parse_tables(runner(["nft", "-j", "list", "tables"], timeout=30).stdout))
        inv.nft_tables = [t for t in NFT_TABLES if t in tables]
    except ToolMissingError:
        pass  # no nft: nftables mode cannot have run here
    except (CommandError, ValueError) as exc:
        inv.errors.append(f"nft: {exc}")


def _read(runner: Runner, argv: list[str], timeout: float) -> Callable[[], Result]:
    """Run `argv` now; the returned call gives its result or raises what the run raised, where it is used."""
    try:
        result = runner(argv, timeout=timeout)
    except CommandError as exc:
        failed = exc

        def again() -> Result:
            raise failed
        return again
    return lambda: result


def _ipvs(inv: Inventory, runner: Runner, proc_root: Path) -> None:
    dummy_addrs: set[str] = set()
    # Without /proc/net/ip_vs there is no IPVS, and ipvsadm would only try to load it.
    inv.ipvs_available = (proc_root / "net" / "ip_vs").exists()
    # The four reads share nothing: side by side, then taken apart one by one as they always were (the node's
    # own addresses are read even when ipvsadm fails; only its answer is then not used).
    argvs = [(["ip", "-j", "addr", "show", "dev", IPVS_DUMMY_INTERFACE], 10.0), (["ipset", "save"], 60.0)]
    if inv.ipvs_available:
        argvs += [(["ipvsadm", "-Sn"], 60.0), (["ip", "-j", "addr", "show"], 10.0)]
    reads = side_by_side([functools.partial(_read, runner, argv, timeout) for argv, timeout in argvs],
                         name="inventory-ipvs")
    try:
        out = reads[0]()
        inv.dummy_interface = True
        found = addresses(out.stdout)
        dummy_addrs = set(found)
        inv.dummy_addresses, inv.dummy_address_count = found[:MAX_DUMMY_ADDRESSES], len(found)
    except CommandError as exc:
        if "does not exist" not in (exc.stderr or str(exc)):
            inv.errors.append(f"ip: {exc}")
    except ValueError as exc:
        # The interface is there; its addresses are unknown (ownership then rests on the ipsets).
        inv.errors.append(f"ip: {IPVS_DUMMY_INTERFACE}: {exc}")
    ipsets = IpsetState()
    try:
        ipsets = parse_ipset_save(reads[1]().stdout)
        inv.ipsets = ipsets.names
    except ToolMissingError:
        pass
    except CommandError as exc:
        inv.errors.append(f"ipset: {exc}")
    if inv.ipvs_available:
        try:
            inv.virtual_servers = parse_ipvsadm_save(reads[2]().stdout)
            local = set(addresses(reads[3]().stdout))
            node_addrs = local - dummy_addrs
            inv.kube_virtual_servers = select_owned(inv.virtual_servers, dummy_addrs, ipsets, node_addrs)
            inv.foreign_virtual_servers = select_foreign(inv.virtual_servers, dummy_addrs, ipsets, node_addrs)
        except (CommandError, ValueError) as exc:
            inv.errors.append(f"ipvsadm: {exc}")


def take_ipvs_inventory(*, runner: Runner = run, proc_root: Path = Path("/proc")) -> Inventory:
    """Only the IPVS part (virtual servers, kube-ipvs0, ipsets): what preflight for nftables needs."""
    return _merged(side_by_side([_part(lambda inv: _ipvs(inv, runner, proc_root), _IPVS_FILLS),
                                 _part(lambda inv: _devices(inv, runner), _DEVICES_FILLS)], name="inventory"))


def _part(fill: Callable[[Inventory], None], filled: frozenset[str]) -> Callable[[], _Part]:
    """A reader as a call side_by_side can run: `fill` writes the `filled` fields of a fresh inventory."""
    def read() -> _Part:
        inv = Inventory()
        fill(inv)
        return _Part(inv, filled)
    return read


def _merged(parts: list[_Part]) -> Inventory:
    """The parts' filled fields in one inventory, in the parts' order: a list is joined (the chains of each
    family, the errors), any other field is the value of the last part that filled it, its default or not (a
    value is no sign of whether it was read)."""
    inv = Inventory()
    for part in parts:
        for f in fields(Inventory):
            if f.name not in part.filled:
                continue
            value = getattr(part.inventory, f.name)
            if isinstance(value, list):
                getattr(inv, f.name).extend(value)
            else:
                setattr(inv, f.name, value)
    return inv


def take_inventory(*, runner: Runner = run, iptables_tools: list[IptablesTool] | None = None,
                   proc_root: Path = Path("/proc"), bpffs: Path = DEFAULT_BPFFS,
                   fresh: Mapping[str, Dump] | None = None) -> Inventory:
    """Every kind's objects on the node. `fresh`: per iptables tool label, a save the caller read from the kernel
    after its own last change there (a flush's verifying save, agent/flush/iptables.py), taken instead of saving
    that tool again: it is a read of the node as it is, not an assumption. Every other tool is read here."""
    # Every read side by side (each family's save, the nft listing, the IPVS reads, the bpffs walk): they share
    # nothing, and the time is the tools'. Merged in a fixed order, so the result does not depend on the race.
    tools = iptables_tools if iptables_tools is not None else available_tools()
    known = fresh or {}
    return _merged(side_by_side([*(_part(functools.partial(_iptables, tool=tool, runner=runner,
                                                           read=known.get(tool.label)), _IPTABLES_FILLS)
                                   for tool in tools),
                                 _part(lambda inv: _nft(inv, runner), _NFT_FILLS),
                                 _part(lambda inv: _ipvs(inv, runner, proc_root), _IPVS_FILLS),
                                 _part(lambda inv: _bpf_links(inv, bpffs), _BPF_LINKS_FILLS)], name="inventory"))


def mode_objects(inv: Inventory, observed_mode: str | None = None) -> list[ModeObjects]:
    """The status `objects` list: every mode with at least one object here."""
    return [ModeObjects(mode=m, count=inv.count(m, observed=observed_mode), summary=inv.summary(m, observed_mode))
            for m in MODES if inv.count(m, observed=observed_mode)]


def leftovers(inv: Inventory, observed_mode: str | None) -> list[Mode]:
    """Modes other than kube-proxy's own that still have objects it does not use.

    Unknown observed mode (kube-proxy not answering): nothing can be called stale.
    """
    if observed_mode not in MODES:
        return []
    # A replacement's objects (Cilium's chains and devices) are no leftover of kube-proxy: in a cluster where
    # Cilium is the CNI they are on every node, in use. The move away from cilium-kpr removes them.
    return [m for m in KUBE_PROXY_MODES
            if m != observed_mode and inv.count(m, observed=observed_mode, stale_only=True) > 0]


def leftover_objects(inv: Inventory, observed_mode: str | None) -> int:
    """How many stale objects the `leftovers` modes still have: the count `kubectl get proxynodes` shows."""
    return sum(inv.count(m, observed=observed_mode, stale_only=True) for m in leftovers(inv, observed_mode))


def foreign_ipvs(inv: Inventory) -> ForeignIPVS:
    """The status `foreignIPVS`: the IPVS virtual servers here that are not kube-proxy's, bounded."""
    names = [vs.describe() for vs in inv.foreign_virtual_servers]
    return ForeignIPVS(count=len(names), virtual_servers=names[:MAX_FOREIGN_VIRTUAL_SERVERS])
