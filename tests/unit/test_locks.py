"""The project venv runs what the image ships, and nothing installs into the system python3.

requirements.lock is the image's (the Dockerfile installs it with --require-hashes);
requirements/dev.lock is .venv's (hack/venv.sh), compiled by `make lock` with requirements.lock as
constraints. These tests read the files as they are committed: a lock edited by hand, a pin that
drifted between the two, a dependency added to pyproject.toml without `make lock`, or a Makefile
recipe that calls the system python3 fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements" / "dev.lock"
VENV_IN = ROOT / "requirements" / "venv.in"

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """{normalized name: (version, hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, frozenset[str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if match := PIN.match(line):
            current = normalized(match[1])
            assert current not in pins, f"{current} pinned twice"
            pins[current] = (match[2], frozenset())
        elif current is not None and (found := HASH.findall(line)):
            version, hashes = pins[current]
            pins[current] = (version, hashes | set(found))
        elif not line.startswith(" "):
            current = None
    return pins


def requirement_names(requirements: list[str]) -> set[str]:
    return {normalized(m[1]) for r in requirements if (m := NAME.match(r))}


def test_parse_lock_reads_names_versions_and_hashes() -> None:
    text = ("# header\nPyYAML==6.0.2 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
            + "\n    # via proxyshift\nkopf==1.45.2 \\\n    --hash=sha256:" + "c" * 64 + "\n")
    assert parse_lock(text) == {"pyyaml": ("6.0.2", frozenset({"sha256:" + "a" * 64, "sha256:" + "b" * 64})),
                                "kopf": ("1.45.2", frozenset({"sha256:" + "c" * 64}))}


@pytest.mark.parametrize("lock", [RUNTIME_LOCK, DEV_LOCK], ids=lambda p: p.name)
def test_every_pin_carries_hashes(lock: Path) -> None:
    pins = parse_lock(lock.read_text())
    assert pins, f"{lock} pins nothing"
    assert [name for name, (_, hashes) in pins.items() if not hashes] == []


def test_dev_lock_pins_the_images_runtime_packages_exactly() -> None:
    runtime, dev = parse_lock(RUNTIME_LOCK.read_text()), parse_lock(DEV_LOCK.read_text())
    missing = sorted(set(runtime) - set(dev))
    assert missing == [], f"{missing} are in the image's lock but not in .venv's: run `make lock`"
    differ = {name: (runtime[name][0], dev[name][0]) for name in runtime if runtime[name] != dev[name]}
    assert differ == {}, f"(image, venv) versions or hashes differ: {differ}; run `make lock`"


def test_locks_cover_what_pyproject_and_venv_in_ask_for() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime, dev = parse_lock(RUNTIME_LOCK.read_text()), parse_lock(DEV_LOCK.read_text())
    venv_in = [line for line in VENV_IN.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert sorted(requirement_names(project["dependencies"]) - set(runtime)) == []
    wanted = requirement_names(project["dependencies"] + project["optional-dependencies"]["dev"] + venv_in)
    assert sorted(wanted - set(dev)) == [], "pyproject.toml or requirements/venv.in changed: run `make lock`"
    assert "uv" in dev, "hack/venv.sh bootstraps with the lock's uv pin"


def test_venv_in_builds_with_the_backend_pyproject_names() -> None:
    # .venv's editable install runs without build isolation: the lock's setuptools must satisfy
    # [build-system] as the isolated build would.
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build == ["setuptools>=68"]
    assert "setuptools>=68" in VENV_IN.read_text().splitlines()


def test_dockerfile_installs_the_runtime_lock_with_hashes() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY requirements.lock " in dockerfile
    assert "--require-hashes -r /tmp/requirements.lock" in dockerfile


def makefile_recipes() -> list[str]:
    """The Makefile's recipe lines (those a tab starts)."""
    return [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("\t")]


def test_makefile_runs_the_project_venv() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^VENV \?= \.venv$", makefile, re.M)
    assert re.search(r"^PYTHON \?= \$\(VENV\)/bin/python$", makefile, re.M)
    assert re.search(r"^export PATH := \$\(abspath \$\(VENV\)\)/bin:\$\(PATH\)$", makefile, re.M)
    # A program's name as a command word: `uv pip` and `-m pytest` are subcommands of the venv's own.
    command = re.compile(r"(?<!uv )(?<!-m )(?:^|(?<=[\s;&|(]))(python3?|pip3?|pytest)(\s|$)")
    bare = [r for r in makefile_recipes() if command.search(r)]
    assert bare == [], f"recipes that run an interpreter other than $(PYTHON): {bare}"


def test_nothing_pip_installs_into_the_system_python() -> None:
    for script in ("hack/install-deps.sh", "hack/venv.sh", ".ci/run"):
        text = (ROOT / script).read_text()
        assert not re.search(r"python3 -m pip install|^\s*pip3? install", text, re.M), script
    venv = (ROOT / "hack" / "venv.sh").read_text()
    assert '"${PIP[@]}" install' in venv and 'PIP=("$VENV/bin/python" -m pip' in venv
