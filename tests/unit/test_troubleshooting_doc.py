"""docs/troubleshooting.md names every reason the planner can emit, so the doc cannot drift.

Reasons are found in the planner's code by where they are used, not by a list kept here:
`reason=` keywords (actions, Events), the reason argument of the state machine's `_fail`,
`_start_rollback`, `abandon` and `_event`, of `ctx.event`, of `GateVerdict` and of
`set_condition`, and whatever is assigned to a variable named `reason`. A gate failure during
Verify is reported as "Verify" + the gate's reason (machine._gate), so those are derived too.
As a net, every other CamelCase string in these files must be a known non-reason, so a reason
passed in a new way fails here instead of going undocumented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PLANNER = ROOT / "operator" / "proxyshift" / "planner"
FILES = [PLANNER / f"{name}.py" for name in ("machine", "gate", "status", "planner")]
DOC = ROOT / "docs" / "troubleshooting.md"

REASON_WORD = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)*$")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
# function name -> index of its reason argument
REASON_ARG = {"_fail": 2, "_start_rollback": 2, "abandon": 1, "_event": 1, "event": 0, "GateVerdict": 1,
              "set_condition": 3}
# CamelCase strings in these files that are not reasons: the steps inside operation ids, and the one
# condition type of two words (the doc's condition column names it).
NOT_REASONS = {"RollbackCleanup", "RollbackGate", "ControlPlaneSkipped", "BehaviourChanges"}


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def reasons_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "reason":
                    found |= _strings(kw.value)
            index = REASON_ARG.get(_name(node))
            if index is not None and len(node.args) > index:
                found |= _strings(node.args[index])
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
            found |= _strings(node.value)
    return {s for s in found if REASON_WORD.match(s)}


def gate_fail_reasons(tree: ast.AST) -> set[str]:
    # The reason is the second argument of every GateVerdict("fail", ...): a string constant.
    return {node.args[1].value for node in ast.walk(tree)  # type: ignore[misc]
            if isinstance(node, ast.Call) and _name(node) == "GateVerdict" and len(node.args) > 1
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "fail"
            and isinstance(node.args[1], ast.Constant)}


def planner_reasons() -> set[str]:
    trees = {path.name: ast.parse(path.read_text(), str(path)) for path in FILES}
    reasons = set().union(*(reasons_in(tree) for tree in trees.values()))
    return reasons | {"Verify" + r for r in gate_fail_reasons(trees["gate.py"])}


def documented(doc: str) -> set[str]:
    return set(re.findall(r"`([A-Z][A-Za-z0-9]+)`", doc))


def test_extraction_finds_the_reasons_we_know() -> None:
    reasons = planner_reasons()
    assert {"PreflightFailed", "GateTimeout", "KubeProxyCrashLooping", "RollbackGateFailed", "WrongMode",
            "VerifyWrongMode", "NotEnoughSyncs", "RolloutHalted", "NodesOwnedByOlderPolicy", "Superseded",
            "Cordoned", "StageCompleted", "Reverted"} <= reasons


def test_every_camelcase_string_is_a_reason_or_known_not_to_be() -> None:
    reasons = planner_reasons()
    strays = {s for path in FILES for s in _strings(ast.parse(path.read_text()))
              if CAMEL.match(s) and s not in reasons and s not in NOT_REASONS}
    assert not strays, f"CamelCase strings the extraction does not classify (a reason passed a new way?): {strays}"


def test_troubleshooting_names_every_reason() -> None:
    missing = sorted(planner_reasons() - documented(DOC.read_text()))
    assert not missing, f"docs/troubleshooting.md does not explain: {missing}"
