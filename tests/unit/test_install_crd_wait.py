"""install waits for the CRDs' Established condition, whatever status the API server has given yet."""

from __future__ import annotations

import json

import pytest

from localcluster.install import _established

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("crd", "expected"), [
    ({"metadata": {"name": "x"}}, False),  # just created: no status at all
    ({"status": {}}, False),
    ({"status": {"conditions": None}}, False),
    ({"status": {"conditions": [{"type": "NamesAccepted", "status": "True"}]}}, False),
    ({"status": {"conditions": [{"type": "Established", "status": "False"}]}}, False),
    ({"status": {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                {"type": "Established", "status": "True"}]}}, True),
])
def test_established_reads_the_condition_and_tolerates_a_missing_status(crd: dict, expected: bool) -> None:
    assert _established(json.dumps(crd)) is expected
