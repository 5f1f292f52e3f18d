"""localcluster's modules depend on each other one way, and say so with plain imports.

Imports inside functions count: a lazy import hides a dependency (and a circle) from a reader, not
from the interpreter. network.py starts the node simulators, so nodesim.py must not import it; the
node naming both need lives in paths.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

LOCALCLUSTER = Path(__file__).resolve().parents[2] / "localcluster"
PACKAGE = "localcluster"


def sibling_imports(path: Path) -> set[str]:
    """Names of the localcluster modules `path` imports anywhere in its body (itself excluded)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith(PACKAGE + ".")}
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: sibling_imports(p) for p in sorted(LOCALCLUSTER.glob("*.py")) if p.name != "__init__.py"}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle in `edges` as the path around it, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for dependency in sorted(edges.get(module, ())):
            found = visit(dependency, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(edges):
        found = visit(module, [])
        if found:
            return found
    return None


def test_cycle_finds_a_circle_through_a_lazy_import() -> None:
    assert cycle({"network": {"nodesim", "paths"}, "nodesim": {"network"}, "paths": set()}) == [
        "network", "nodesim", "network"]
    assert cycle({"network": {"nodesim", "paths"}, "nodesim": {"paths"}, "paths": set()}) is None


def test_localcluster_has_no_import_circle() -> None:
    edges = graph()
    assert {"network", "nodesim", "controlplane", "paths"} <= edges.keys()
    assert cycle(edges) is None


def test_the_node_simulator_does_not_import_what_starts_it() -> None:
    edges = graph()
    assert "nodesim" in edges["network"]
    assert "network" not in edges["nodesim"]


def test_the_control_plane_imports_the_node_half_plainly() -> None:
    """No importlib: controlplane needs network (the bridge, the nodes' removal and status)."""
    assert "importlib" not in (LOCALCLUSTER / "controlplane.py").read_text()
    assert "network" in graph()["controlplane"]
