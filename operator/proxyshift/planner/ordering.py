"""The order nodes are migrated in: by name, with digit runs compared as numbers.

Natural order makes "node-2" come before "node-10", which is what a person reading
`proxyshift plan` expects; it is still a pure function of the name, so it is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_DIGITS = re.compile(r"(\d+)")


def node_key(name: str) -> tuple[tuple[int, int | str], ...]:
    # (kind, value) pairs keep ints and strs from ever being compared with each other.
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(name) if part != "")


def in_order(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda name: (node_key(name), name))
