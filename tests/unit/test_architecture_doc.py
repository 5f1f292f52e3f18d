"""docs/architecture.md's layout tables name every room of the tree (issue 17: the layout matches)."""

from __future__ import annotations

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
