"""The bad-manifest table as the cluster layers replay it: tests/fixtures/bad-policies/*.yaml.

Each file is one bad ProxyPolicy; its header lines (`# field: ...`, `# refused-by: ...`,
`# apiserver: ...`, `# model: ...`) say who refuses it and with which message. The e2e test
(tests/e2e/test_bad_policies_apiserver.py) dry-runs each against the API server, the reliability
test (tests/reliability/test_bad_input.py) applies each with kubectl; both read this one table.
The unit table (tests/unit/test_bad_policies.py) reads the same files into its own model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

CASES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "bad-policies"
_HEADER = re.compile(r"^# (field|refused-by|apiserver|model): (.*)$")


def _cases() -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    cases = []
    for path in sorted(CASES_DIR.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        meta = {m.group(1): m.group(2) for line in text.splitlines() if (m := _HEADER.match(line))}
        cases.append((path.stem, meta, yaml.safe_load(text)))
    return cases


# (file stem, header fields, manifest) per bad policy, in file order.
CASES = _cases()
