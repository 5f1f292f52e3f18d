"""`ip -j addr show` output, read once for the whole agent: bounded, and tolerant of entries it does not know.

The flush and the inventory need kube-ipvs0's addresses and the node's own (to tell kube-proxy's virtual
servers from a user's); the behaviour probe needs the node's IPv4 addresses by interface. One parse
serves them all, so a change in ip's output is handled in one place.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

# `ip -j addr` prints about 140 bytes per address: 4 MiB is some 30,000 Services' addresses on kube-ipvs0,
# and json.loads of it stays far below the agent's memory limit. More is an error, not a crash.
MAX_IP_JSON_BYTES = 4 * 1024 * 1024
MAX_INTERFACE_NAME = 32


@dataclass(frozen=True)
class LinkAddress:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    interface: str


def parse_ip_addr_json(text: str, *, max_bytes: int = MAX_IP_JSON_BYTES) -> list[LinkAddress]:
    """Every address in the output, in ip's order, with its interface.

    ValueError when the output is over max_bytes or is not ip's JSON list; an entry that is not an
    address is left out (a newer ip may print more kinds of entry)."""
    if len(text) > max_bytes:
        raise ValueError(f"ip -j addr printed more than {max_bytes} bytes")
    data = json.loads(text) if text.strip() else []
    if not isinstance(data, list):
        raise ValueError("ip -j addr did not print a list")
    found: list[LinkAddress] = []
    for link in data:
        if not isinstance(link, dict):
            continue
        interface = str(link.get("ifname") or "")[:MAX_INTERFACE_NAME]
        for info in link.get("addr_info") or []:
            if not isinstance(info, dict) or not isinstance(info.get("local"), str):
                continue
            try:
                found.append(LinkAddress(ipaddress.ip_address(info["local"]), interface))
            except ValueError:
                continue
    return found


def addresses(text: str, *, max_bytes: int = MAX_IP_JSON_BYTES) -> list[str]:
    """The distinct addresses in the output, both families, IPv4 first, each family in order."""
    found = {a.address for a in parse_ip_addr_json(text, max_bytes=max_bytes)}
    return [str(a) for a in sorted(found, key=lambda a: (a.version, a))]
