"""Flush of the network devices a kube-proxy replacement leaves (Cilium's cilium_host/cilium_net), with the
routes through them.

Cilium's agent creates the veth pair cilium_host/cilium_net and routes the node's pod CIDR through
cilium_host; a stopped agent leaves them (and its CILIUM_* chains, which the iptables flusher removes by
their exact names). Only devices named exactly as the removed mode's facts list them are deleted; the kernel
removes their routes with them (counted first, from `ip -j route`). A user's device or route is never named.

Never while the replacement's agent still runs on the node: in a cluster where Cilium stays the CNI, these
devices are its datapath. `flush.flush` asks that first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from proxyshift.agent.flush.base import FlushStep, Runner
from proxyshift.agent.ownership import Mode
from proxyshift.commands import CommandError, run
from proxyshift.modes import MODE_FACTS

IP_TIMEOUT = 10.0
MAX_IP_JSON_BYTES = 4 * 1024 * 1024


def parse_link_names(text: str, *, max_bytes: int = MAX_IP_JSON_BYTES) -> set[str]:
    """The interface names in `ip -j link show` output. ValueError when it is too large or not ip's list."""
    if len(text) > max_bytes:
        raise ValueError(f"ip -j link printed more than {max_bytes} bytes")
    if not text.strip():
        return set()
    doc = json.loads(text)
    if not isinstance(doc, list):
        raise ValueError("ip -j link printed no JSON list")
    return {str(entry["ifname"]) for entry in doc if isinstance(entry, dict) and isinstance(entry.get("ifname"), str)}


def count_routes(text: str, *, max_bytes: int = MAX_IP_JSON_BYTES) -> int:
    """How many routes `ip -j route show dev X` lists."""
    if len(text) > max_bytes:
        raise ValueError(f"ip -j route printed more than {max_bytes} bytes")
    doc = json.loads(text) if text.strip() else []
    return len(doc) if isinstance(doc, list) else 0


def stale_devices(remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[str]:
    """The device names of the removed modes that the target mode does not use, in the facts' order."""
    keep = set(MODE_FACTS[target_mode].owned.devices) if target_mode is not None else set()
    return [d for m in sorted(remove_modes) for d in MODE_FACTS[m].owned.devices if d not in keep]


@dataclass
class DeviceFlusher:
    run: Runner = run
    dry_run: bool = False

    def flush(self, remove_modes: frozenset[Mode], target_mode: Mode | None) -> list[FlushStep]:
        step = FlushStep("ip link")
        wanted = stale_devices(remove_modes, target_mode)
        if not wanted:
            return [step]
        try:
            present = parse_link_names(self.run(["ip", "-j", "link", "show"], timeout=IP_TIMEOUT).stdout)
            for device in wanted:
                if device not in present:
                    continue  # gone already, or with its veth peer
                routes = count_routes(self.run(["ip", "-j", "route", "show", "dev", device],
                                               timeout=IP_TIMEOUT).stdout)
                if self.dry_run:
                    step.add("devices", 1)
                    step.add("routes", routes)
                    continue
                try:
                    self.run(["ip", "link", "delete", "dev", device], timeout=IP_TIMEOUT)
                except CommandError as exc:
                    # Deleting one end of a veth pair deletes the other: a peer gone meanwhile is no error.
                    still = parse_link_names(self.run(["ip", "-j", "link", "show"], timeout=IP_TIMEOUT).stdout)
                    if device in still:
                        step.errors.append(f"{device}: {exc}")
                        continue
                step.add("devices", 1)
                step.add("routes", routes)
                # A veth peer goes with it: listed again below only if it is still there.
                present = parse_link_names(self.run(["ip", "-j", "link", "show"], timeout=IP_TIMEOUT).stdout)
            if self.dry_run:
                step.skipped.append("dry run: nothing changed")
        except (CommandError, ValueError) as exc:
            step.errors.append(str(exc))
        return [step]
