"""docs/migration-guide.md documents every behaviour change a policy can allow, and only those."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxyshift.api.behaviour import CHANGE_NAMES

pytestmark = pytest.mark.unit

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migration-guide.md"


def test_every_change_name_has_a_row_with_its_preserving_setting() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("#### The documented changes", 1)[1].split("\n\n", 2)[1]
    rows = {m.group(1): line for line in section.splitlines() if (m := re.match(r"^\| `(\w+)` \|", line))}
    assert set(rows) == set(CHANGE_NAMES)
    for name, line in rows.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4 and all(cells), (name, cells)
