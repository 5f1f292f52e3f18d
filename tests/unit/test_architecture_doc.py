"""docs/architecture.md's layout tables and the README's Layout name every room of the tree (issue 17: the layout
matches)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "architecture.md").read_text()


def rooms(package: Path) -> list[str]:
    """The package's modules (`x.py`) and subpackages (`x/`), as the tables write them."""
    found = []
    for child in sorted(package.iterdir()):
        if child.is_dir() and (child / "__init__.py").exists():
            found.append(f"`{child.name}/")
        elif child.suffix in (".py", ".sh") and child.name != "__init__.py":
            found.append(child.name)
    return found


@pytest.mark.parametrize("package", ["operator/proxyshift", "localcluster"])
def test_every_module_and_package_is_in_the_architecture_tables(package: str) -> None:
    missing = [room for room in rooms(REPO / package) if room not in DOC]
    assert missing == [], f"docs/architecture.md does not describe {missing} of {package}"


def packages(root: Path) -> list[str]:
    """Every Python package folder under `root` (any depth), relative to it: `agent`, `agent/flush`, ..."""
    return sorted(p.parent.relative_to(root).as_posix() for p in root.rglob("__init__.py") if p.parent != root)


@pytest.mark.parametrize("package", ["operator/proxyshift", "localcluster"])
def test_every_folder_of_the_package_is_in_the_architecture_doc(package: str) -> None:
    """Nested ones too (`agent/flush/`, `nodesim/`), which the check of the package's own rooms does not see."""
    found = packages(REPO / package)
    assert found, package
    missing = [f"{rel}/" for rel in found if f"`{rel}/" not in DOC]
    assert missing == [], f"docs/architecture.md does not name {missing} of {package}"


README = (REPO / "README.md").read_text()


def layout_block() -> list[str]:
    """The README's `## Layout` tree: the indented lines between that heading and the next paragraph."""
    text = README[README.index("## Layout\n"):]
    return [line for line in text.split("\n\n", 2)[1].splitlines() if line.strip()]


def expand(token: str) -> list[str]:
    """`tests/{unit,e2e}` -> tests/unit/, tests/e2e/ (a folder keeps its trailing slash)."""
    if "{" not in token:
        return [token]
    head, rest = token.split("{", 1)
    inner, tail = rest.split("}", 1)
    return [f"{head}{part}{tail or '/'}" for part in inner.split(",")]


def layout_paths(lines: list[str]) -> set[str]:
    """The paths the tree names: entries at 4 spaces, their children at 6 (joined to the parent); deeper
    lines continue a description."""
    named: set[str] = set()
    parent = ""
    for line in lines:
        indent, token = len(line) - len(line.lstrip()), line.split()[0]
        if indent == 4:
            parent = token
            named.update(expand(token))
        elif indent == 6:
            named.add(parent + token)
    return named


def repository_folders() -> list[str]:
    """Top-level folders of the checkout that git keeps: not hidden (but .ci), not ignored at the root."""
    ignored = {line.strip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.startswith("/") and line.endswith("/")}
    return sorted(p.name for p in REPO.iterdir() if p.is_dir() and p.name not in ignored and
                  (not p.name.startswith(".") or p.name == ".ci") and not p.name.endswith(".egg-info"))


def test_layout_paths_reads_the_tree() -> None:
    lines = ["    operator/proxyshift/   the package", "      api/                 models", "    tests/{unit,e2e}",
             "    localcluster/          the test bed: the control plane,",
             "                           netns nodes/ and more", "    .ci/run                CI"]
    assert layout_paths(lines) == {"operator/proxyshift/", "operator/proxyshift/api/", "tests/unit/", "tests/e2e/",
                                   "localcluster/", ".ci/run"}


def test_the_readme_layout_names_every_folder() -> None:
    """Every top-level folder, every folder of tests/, every package of operator/proxyshift (the nested
    ones and the test bed's at least by name)."""
    lines = layout_block()
    named = layout_paths(lines)
    text = "\n".join(lines)
    wanted = [f"{name}/" for name in repository_folders()]
    wanted += [f"tests/{p.name}/" for p in sorted((REPO / "tests").iterdir())
               if p.is_dir() and not p.name.startswith((".", "__"))]
    missing = [w for w in wanted if not any(n == w or n.startswith(w) for n in named)]
    product = packages(REPO / "operator" / "proxyshift")
    missing += [f"operator/proxyshift/{rel}/" for rel in product if "/" not in rel
                and f"operator/proxyshift/{rel}/" not in named]
    nested = [rel for rel in product if "/" in rel] + packages(REPO / "localcluster")
    missing += [f"{rel}/" for rel in nested if f"{rel.rsplit('/', 1)[-1]}/" not in text]
    assert {".ci/", "operator/", "tests/unit/", "tests/support/"} <= set(wanted)
    assert missing == [], f"README.md's Layout does not name {missing}"


TOP_FOLDERS = ("operator", "localcluster", "tests", "docs", "config", "charts", "bench", "hack", "crds",
               "requirements", ".ci")
FOLDERS = "|".join(re.escape(f) for f in TOP_FOLDERS)
DOC_PATH = re.compile(rf"`((?:{FOLDERS})/[^`\s]*)`")


def path_patterns(text: str) -> list[str]:
    """The repository paths the text names in backticks, as globs: `{a,b}` expanded, `<name>` any name."""
    found = []
    for raw in DOC_PATH.findall(text):
        pattern = re.sub(r"<[^>]*>", "*", raw.rstrip("/.,:;"))
        expanded = [pattern]
        while any("{" in p for p in expanded):
            nxt = []
            for p in expanded:
                if "{" not in p:
                    nxt.append(p)
                    continue
                head, rest = p.split("{", 1)
                inner, tail = rest.split("}", 1)
                nxt += [f"{head}{part}{tail}" for part in inner.split(",")]
            expanded = nxt
        found += expanded
    return found


def test_path_patterns_expand_braces_and_placeholders() -> None:
    text = "see `tests/{unit,e2e}/x_{a,b}.py`, `localcluster/nodes/<node>/` and `operator/proxyshift`."
    assert path_patterns(text) == ["tests/unit/x_a.py", "tests/unit/x_b.py", "tests/e2e/x_a.py", "tests/e2e/x_b.py",
                                   "localcluster/nodes/*", "operator/proxyshift"]


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_every_repository_path_a_doc_names_exists(doc: str) -> None:
    """Docs follow the moves (issue 17): a path into this repository that a page names is there."""
    path = REPO / doc if doc == "README.md" else REPO / "docs" / doc
    missing = [p for p in path_patterns(path.read_text()) if not any(REPO.glob(p)) and not (REPO / p).exists()]
    assert missing == [], f"{doc} names {missing}, which the repository does not hold"
