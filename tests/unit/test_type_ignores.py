"""Every `# type: ignore` in the code mypy checks names its error code and says why (issue 17, item 4;
docs/architecture.md, "Tests"). mypy itself (`warn_unused_ignores`, in `make lint`) reports one that no
longer silences an error; this test keeps the reason next to the ones that do."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<after>.*)$")
# How far above an ignore its reason may stand: a comment line over the statement, which may span lines.
REASON_REACH = 3


def checked_files() -> list[Path]:
    """The files `make lint` type-checks: [tool.mypy] files in pyproject.toml (folders and single files) and
    the test layers hack/mypy-tests.sh checks, all of tests/. Not this file: its examples are bare on purpose."""
    roots = [REPO / r for r in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]]
    files = {p for root in [*roots, REPO / "tests"] for p in ([root] if root.is_file() else root.rglob("*.py"))}
    return sorted(files - {Path(__file__).resolve()})


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, why) for each `# type: ignore` without an error code, or without a reason: a comment after it
    on its line, or a comment line above the statement it is in (no blank line between)."""
    lines = source.splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        match = IGNORE.search(line)
        if match is None:
            continue
        if not match["codes"]:
            found.append((number, "no error code"))
            continue
        if match["after"].strip().startswith("#"):
            continue
        above = [lines[i].strip() for i in range(number - 2, max(number - 2 - REASON_REACH, -1), -1)]
        reason = False
        for text in above:
            if not text:
                break
            if text.startswith("#"):
                reason = True
                break
        if not reason:
            found.append((number, "no reason"))
    return found


def test_the_check_tells_an_explained_ignore_from_a_bare_one() -> None:
    source = "\n".join([
        "a = f(x)  # type: ignore[arg-type]  # x is checked above",       # 1: reason after it
        "# the client types it Optional; a listed object has one",      # 2
        "b = g(y)  # type: ignore[union-attr]",                          # 3: reason above
        "c = h(z)  # type: ignore",                                      # 4: no code
        "",                                                              # 5
        "d = k(w)  # type: ignore[misc]",                                # 6: nothing says why
        "# one comment for a call over two lines",                       # 7
        "e = m(",                                                        # 8
        "    v)  # type: ignore[arg-type]",                              # 9: reason above the statement
    ])
    assert unexplained(source) == [(4, "no error code"), (6, "no reason")]


def test_every_type_ignore_in_the_checked_code_names_its_code_and_why() -> None:
    files = checked_files()
    assert any(p.name == "handlers.py" for p in files) and any(p.parent.name == "localcluster" for p in files)
    assert any(p.parent.name == "guest" for p in files) and any(p.parent.name == "bench" for p in files)
    bare = [f"{p.relative_to(REPO)}:{line} {why}" for p in files for line, why in unexplained(p.read_text())]
    assert bare == [], f"# type: ignore without its code or a reason: {bare}"
