"""controller/ as docs/architecture.md describes it: every module named there, none keeping mutable
state at module level (what the operator remembers lives in its runtime, controller/runtime.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent.parent
CONTROLLER = ROOT / "operator" / "proxyshift" / "controller"
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray"}


def modules() -> list[Path]:
    return sorted(p for p in CONTROLLER.glob("*.py") if p.name != "__init__.py")


def mutable_module_state(path: Path) -> list[str]:
    """Module-level names bound to a mutable container (a literal or a constructor call)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        mutable = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in MUTABLE_CALLS)
        if mutable:
            found += [f"{path.name}:{node.lineno} {ast.unparse(t)}" for t in targets]
    return found


def rebound_globals(path: Path) -> list[str]:
    """Module names a function rebinds (`global x`): module state even when the first value is None."""
    return [f"{path.name}:{node.lineno} {name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Global) for name in node.names]


def test_every_controller_module_is_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [p.name for p in modules() if f"controller/{p.name}" not in doc and f"`{p.name}`" not in doc]
    assert missing == []


def test_no_controller_module_keeps_mutable_state_at_module_level() -> None:
    assert [found for p in modules() for found in mutable_module_state(p)] == []


def test_no_controller_function_rebinds_a_module_name() -> None:
    assert [found for p in modules() for found in rebound_globals(p)] == []


def test_the_check_sees_a_rebound_module_name(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("_runtime = None\n\ndef start():\n    global _runtime\n    _runtime = object()\n")
    assert rebound_globals(sample) == ["sample.py:4 _runtime"]


def test_the_check_sees_module_level_containers(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("A = {}\nB: list[int] = []\nC = frozenset({1})\nD = dict(x=1)\nE = (1, 2)\n")
    assert mutable_module_state(sample) == ["sample.py:1 A", "sample.py:2 B", "sample.py:4 D"]
