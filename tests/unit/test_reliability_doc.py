"""docs/reliability.md states the fault suite's loss budget exactly as tests/reliability/loss_budget.py holds it
(issue 15, item 4): the table and the reason for every non-zero entry, rendered from the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.loss_budget import render

pytestmark = pytest.mark.unit

DOC = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()


def test_the_doc_states_the_loss_budget_of_the_code() -> None:
    budget = render()
    # The doc's table starts with the same header; compare from there so a mismatch shows both versions.
    header = budget.splitlines()[0]
    assert header in DOC, f"docs/reliability.md has no loss budget table; it should contain:\n{budget}"
    start = DOC.index(header)
    assert DOC[start:start + len(budget)] == budget, \
        f"docs/reliability.md's loss budget differs from tests/reliability/loss_budget.py; render():\n{budget}"
