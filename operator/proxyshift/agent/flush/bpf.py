"""Flush of the BPF attachments a stopped kube-proxy replacement leaves (Cilium's pinned links, legacy tc filters).

Cilium attaches socket-LB at its cgroup root and its tc programs on the node's devices with bpf_links, and pins
each link in its own directory of the node's BPF filesystem (`<bpffs>/cilium/socketlb/links/cgroup/<program>`,
`<bpffs>/cilium/devices/<device>/links/<program>`, ...; modes/cilium_kpr.py lists the sources). A pinned link
stays attached when the agent is gone: a node moved back to kube-proxy would still have its connects translated
by a dead agent's socket-LB, with Service maps nobody updates any more. Unpinning a link drops its last reference
(the agent that held it is gone), and the kernel detaches the program.

What is removed, by evidence and never by a guess:

- every pin under the mode's own bpffs directory (ModeFacts.owned.bpffs_dir), link pins first (any pin below a
  `links`/`plugin_links` folder, socket-LB's before the devices'), as Cilium's own unload orders them; then the
  other pins there and the emptied folders. Nothing outside that directory is named (a user's pins, iproute2's
  tc/globals with Cilium's maps in it); symlinks are removed as links, never followed; another mount below the
  directory is not entered. The path is checked to be a bpffs mount first (the agent's hostPath of the node's
  /sys/fs/bpf; on a node without one there is nothing of Cilium's to find).
- legacy tc filters (kernels before tcx, or tcx off): a bpf filter whose name is exactly "<program>-<device>"
  for one of the mode's tc programs (the name Cilium's loader gives it), on the device it names; a user's filter
  running a program of the same name keeps its own name and stays.

Pins are found and removed through the filesystem (no bpf() call: the agent has no CAP_BPF or CAP_SYS_ADMIN, and
unlinking a pin needs none); tc reads with `tc -j`, each command an argument list with a timeout. Bounded: at most
MAX_PINS pins and MAX_DEVICES devices per flush (the rest is reported, and the next flush takes it).

Never while the replacement's agent still answers on the node: `flush.flush` asks that first.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from proxyshift.agent.flush.base import FlushStep, Runner
from proxyshift.agent.flush.devices import IP_TIMEOUT, MAX_IP_JSON_BYTES, parse_link_names
from proxyshift.agent.ownership import Mode
from proxyshift.commands import CommandError, run
from proxyshift.modes import MODE_FACTS

# Where the agent's DaemonSet mounts the node's BPF filesystem (config/agent/daemonset.yaml).
DEFAULT_BPFFS = Path("/sys/fs/bpf")
TC_TIMEOUT = 10.0
MAX_TC_JSON_BYTES = 4 * 1024 * 1024
MAX_MOUNTINFO_BYTES = 4 * 1024 * 1024
# A node with 110 pods holds a few hundred of Cilium's pins; far beyond that is not Cilium's layout.
MAX_PINS = 10_000
MAX_DEVICES = 512
MAX_SKIP_NOTES = 5


def bpffs_mounts(mountinfo: str, *, max_bytes: int = MAX_MOUNTINFO_BYTES) -> set[str]:
    """The mount points of type bpf in a /proc/<pid>/mountinfo text (octal escapes decoded)."""
    if len(mountinfo) > max_bytes:
        raise ValueError(f"mountinfo larger than {max_bytes} bytes")
    found = set()
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields = before.split()
        if not sep or len(fields) < 5 or after.split(" ", 1)[0] != "bpf":
            continue
        found.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return found


def is_bpffs(path: Path, mountinfo: str) -> bool:
    """Whether `path` (resolved) is a mount point of a bpffs."""
    return os.path.realpath(path) in bpffs_mounts(mountinfo)


@dataclass
class PinPlan:
    """The pins under the mode's bpffs directory, in removal order, and the folders to remove after them."""

    links: list[Path] = field(default_factory=list)
    others: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)  # deepest first, the directory itself last
    not_entered: list[Path] = field(default_factory=list)  # another mount below the directory
    truncated: bool = False

    @property
    def pins(self) -> list[Path]:
        return [*self.links, *self.others]


def _link_rank(relative: Path, link_dirs: frozenset[str]) -> int | None:
    """0 for socket-LB's link pins, 1 for other link pins, None for a pin that is not a link's."""
    parents = relative.parts[:-1]
    if not any(part in link_dirs for part in parents):
        return None
    return 0 if parents[:1] == ("socketlb",) else 1


def plan_pins(directory: Path, link_dirs: frozenset[str], *, max_pins: int = MAX_PINS) -> PinPlan:
    """Walk the mode's own bpffs directory (never following a symlink, never into another mount).

    Everything found is the mode's: the directory is its own (ModeFacts.owned.bpffs_dir).
    """
    plan = PinPlan()
    try:
        top = os.lstat(directory)
    except FileNotFoundError:
        return plan
    if not stat.S_ISDIR(top.st_mode):
        plan.not_entered.append(directory)  # not the folder the mode makes: not its to judge
        return plan
    root_dev = top.st_dev
    ranked: list[tuple[int, str, Path]] = []
    for here, dirs, files in os.walk(directory, topdown=True, followlinks=False):
        base = Path(here)
        keep = []
        for name in sorted(dirs):
            path = base / name
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                files.append(name)  # a symlink to a folder is a pin-like entry: unlinked, not followed
            elif info.st_dev != root_dev:
                plan.not_entered.append(path)
            else:
                keep.append(name)
        dirs[:] = keep
        plan.folders.append(base)
        for name in sorted(files):
            if len(ranked) >= max_pins:
                plan.truncated = True
                break
            path = base / name
            rank = _link_rank(path.relative_to(directory), link_dirs)
            ranked.append((2 if rank is None else rank, str(path), path))
    ranked.sort()
    plan.links = [p for rank, _, p in ranked if rank < 2]
    plan.others = [p for rank, _, p in ranked if rank == 2]
    plan.folders.sort(key=lambda p: (-len(p.parts), str(p)))
    return plan


@dataclass(frozen=True)
class TcFilter:
    """One bpf filter on a device's clsact hook, as `tc filter del` names it."""

    device: str
    direction: str  # ingress or egress
    protocol: str
    pref: int
    handle: str
    name: str

    def delete_argv(self) -> list[str]:
        return ["tc", "filter", "del", "dev", self.device, self.direction, "protocol", self.protocol,
                "pref", str(self.pref), "handle", self.handle, "bpf"]


def filter_names(programs: Iterable[str], device: str) -> set[str]:
    """The exact filter names the mode's loader gives its programs on `device` ("<program>-<device>")."""
    return {f"{program}-{device}" for program in programs}


def parse_tc_filters(text: str, device: str, direction: str, programs: frozenset[str], *,
                     max_bytes: int = MAX_TC_JSON_BYTES) -> list[TcFilter]:
    """The mode's bpf filters in `tc -j filter show dev D <direction>` output, by exact name."""
    if len(text) > max_bytes:
        raise ValueError(f"tc -j filter printed more than {max_bytes} bytes")
    if not text.strip():
        return []
    doc = json.loads(text)
    if not isinstance(doc, list):
        raise ValueError("tc -j filter printed no JSON list")
    wanted = filter_names(programs, device)
    found = []
    for entry in doc:
        if not isinstance(entry, dict) or entry.get("kind") != "bpf":
            continue
        options = entry.get("options")
        if not isinstance(options, dict) or options.get("bpf_name") not in wanted:
            continue
        pref, handle, protocol = entry.get("pref"), options.get("handle"), entry.get("protocol")
        if not isinstance(pref, int) or not isinstance(handle, str) or not isinstance(protocol, str):
            continue
        found.append(TcFilter(device, direction, protocol, pref, handle, str(options["bpf_name"])))
    return found


@dataclass
class BpfFlusher:
    run: Runner = run
    bpffs: Path = DEFAULT_BPFFS
    mountinfo: Path = Path("/proc/self/mountinfo")
    dry_run: bool = False
    max_pins: int = MAX_PINS
    max_devices: int = MAX_DEVICES

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        keep = MODE_FACTS[target_mode].owned if target_mode is not None else None
        dirs = sorted({(d, MODE_FACTS[m].owned.bpffs_link_dirs) for m in remove_modes
                       if (d := MODE_FACTS[m].owned.bpffs_dir) is not None and (keep is None or d != keep.bpffs_dir)})
        programs = frozenset(p for m in remove_modes for p in MODE_FACTS[m].owned.tc_filter_programs
                             if keep is None or p not in keep.tc_filter_programs)
        steps = []
        if dirs:
            steps.append(self._pins(dirs))
        if programs:
            steps.append(self._tc(programs))
        return steps

    def _pins(self, dirs: list[tuple[str, frozenset[str]]]) -> FlushStep:
        step = FlushStep("bpffs")
        try:
            mounted = is_bpffs(self.bpffs, self.mountinfo.read_text(errors="replace"))
        except (OSError, ValueError) as exc:
            step.errors.append(f"{self.mountinfo}: {exc}")
            return step
        if not mounted:
            step.skipped.append(f"{self.bpffs} is no BPF filesystem here: no pinned link to remove")
            return step
        for owned, link_dirs in dirs:
            directory = self.bpffs / owned
            try:
                plan = plan_pins(directory, link_dirs, max_pins=self.max_pins)
            except OSError as exc:
                step.errors.append(f"{directory}: {exc}")
                continue
            for path in plan.not_entered[:MAX_SKIP_NOTES]:
                step.skipped.append(f"{path} is another mount or no folder: not entered")
            if plan.truncated:
                step.skipped.append(f"more than {self.max_pins} pins under {directory}: the rest at the next flush")
            if self.dry_run:
                step.add("link pins", len(plan.links))
                step.add("pins", len(plan.others))
                continue
            failed = 0
            for kind, pins in (("link pins", plan.links), ("pins", plan.others)):
                for pin in pins:
                    try:
                        pin.unlink()
                    except FileNotFoundError:
                        continue  # gone meanwhile (a second flush, Cilium's own cleanup)
                    except OSError as exc:
                        failed += 1
                        if failed <= MAX_SKIP_NOTES:
                            step.errors.append(f"{pin}: {exc}")
                        continue
                    step.add(kind, 1)
            if failed > MAX_SKIP_NOTES:
                step.errors.append(f"{failed - MAX_SKIP_NOTES} more pins under {directory} not removed")
            if plan.truncated or plan.not_entered or failed:
                continue  # folders still hold something: kept for the next flush
            for folder in plan.folders:
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    step.errors.append(f"{folder}: {exc}")
                    break
                step.add("folders", 1)
        if self.dry_run:
            step.skipped.append("dry run: nothing changed")
        return step

    def _tc(self, programs: frozenset[str]) -> FlushStep:
        step = FlushStep("tc")
        try:
            devices = sorted(parse_link_names(self.run(["ip", "-j", "link", "show"], timeout=IP_TIMEOUT).stdout,
                                              max_bytes=MAX_IP_JSON_BYTES))
        except (CommandError, ValueError) as exc:
            step.errors.append(f"ip -j link: {exc}")
            return step
        if len(devices) > self.max_devices:
            step.skipped.append(f"{len(devices)} devices: only the first {self.max_devices} looked at")
            devices = devices[:self.max_devices]
        for device in devices:
            for direction in ("ingress", "egress"):
                try:
                    out = self.run(["tc", "-j", "filter", "show", "dev", device, direction], timeout=TC_TIMEOUT)
                    filters = parse_tc_filters(out.stdout, device, direction, programs)
                except (CommandError, ValueError) as exc:
                    if "Cannot find device" in str(exc):
                        break  # gone meanwhile (cilium_net with cilium_host)
                    step.errors.append(f"tc filter show dev {device} {direction}: {exc}")
                    continue
                for found in filters:
                    if self.dry_run:
                        step.add("tc filters", 1)
                        continue
                    try:
                        self.run(found.delete_argv(), timeout=TC_TIMEOUT)
                    except CommandError as exc:
                        step.errors.append(f"{found.name} on {device} {direction}: {exc}")
                        continue
                    step.add("tc filters", 1)
        if self.dry_run:
            step.skipped.append("dry run: nothing changed")
        return step
