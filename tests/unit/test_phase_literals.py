"""A node's migration phase is the `Phase` literal of api/proxynode.py, for planner, executor and CLI alike
(issue 17, "a typed contract").

`NodeMigration.phase` stays a string on the wire (an older agent must read a phase a newer operator added),
so a comparison such as `m.phase == "Gate"` is not checked by mypy. This test is that check: every string
compared with a phase outside api/ (==, !=, in, a dict keyed by phase) is a `Phase`, except the few phases
of other objects listed below with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from proxyshift.api.proxynode import PHASES

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "proxyshift"

# (file, string) -> why it is compared with a phase that is not a node's migration phase.
ALLOWED: dict[tuple[str, str], str] = {
    ("controller/kube.py", "Succeeded"): "a Pod's status.phase (an evicted pod that ended)",
    ("controller/snapshot.py", "Running"): "a kube-proxy Pod's status.phase",
    ("controller/status_view.py", "Ready"): "the ProxyPolicy's status.phase",
    ("planner/reports.py", "Ready"): "the ProxyPolicy's status.phase",
}


def is_phase_expression(node: ast.AST) -> bool:
    """`x.phase`, `phase`, `x.get("phase")`, `_phase(...)`: an expression that reads a phase."""
    if isinstance(node, ast.Attribute):
        return node.attr == "phase"
    if isinstance(node, ast.Name):
        return node.id == "phase"
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "phase"
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name.endswith("phase")
    return False


def strings(node: ast.AST | None) -> list[str]:
    """The string constants of a constant or of a tuple, set or list of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return [s for element in node.elts for s in strings(element)]
    return []


def compared_with_a_phase(source: str) -> list[tuple[int, str]]:
    """(line, string) for each string constant compared with a phase expression, or a key of a dict that a
    phase expression indexes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_phase_expression(o) for o in operands):
                found += [(node.lineno, s) for o in operands for s in strings(o)]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and is_phase_expression(node.slice):
            found += [(node.lineno, s) for key in node.value.keys for s in strings(key)]
    return sorted(found)


def test_the_scan_sees_each_way_of_comparing_a_phase() -> None:
    source = (
        'a = m.phase == "Gate"\n'
        'b = spec.get("phase") in ("Done", "Failed")\n'
        'c = _phase(e) != "Gaet"\n'
        'd = {"Done": 1, "Oops": 2}[new.phase]\n'
        'e = m.reason == "Gate"\n'
        'f = phase not in {"Verify"}\n'
    )
    assert compared_with_a_phase(source) == [(1, "Gate"), (2, "Done"), (2, "Failed"), (3, "Gaet"), (4, "Done"),
                                             (4, "Oops"), (6, "Verify")]


def test_every_string_compared_with_a_phase_is_a_phase() -> None:
    seen: set[tuple[str, str]] = set()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("api/"):
            continue  # where Phase is defined (and the CRD's descriptions spell it)
        for line, text in compared_with_a_phase(path.read_text()):
            if (rel, text) in ALLOWED:
                seen.add((rel, text))
            elif text not in PHASES:
                wrong.append(f"{rel}:{line} {text!r}")
    assert wrong == [], f"not a Phase (api/proxynode.py): {wrong}; a phase of another object goes into ALLOWED"
    assert sorted(set(ALLOWED) - seen) == [], "ALLOWED lists comparisons that are gone"
    assert len(seen) == len(ALLOWED)
