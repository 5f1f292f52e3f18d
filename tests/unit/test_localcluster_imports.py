"""The test bed (localcluster) depends on the product one way, and its modules on each other one way.

Imports inside functions count: a lazy import hides a dependency (and a circle) from a reader, not
from the interpreter. network.py starts the node simulators, so no nodesim module may import it; the
node naming both need lives in paths.py. The product (proxyshift) never imports the test bed, and runs
without it and without the test bed's own dependency, cryptography.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LOCALCLUSTER = REPO / "localcluster"
PRODUCT = REPO / "operator" / "proxyshift"
PACKAGE = "localcluster"
NODESIM_JOBS = {"config", "node", "podspec", "probes", "containers", "volumes", "pod", "logserver", "simulator"}
MAX_MODULE_LINES = 700


def module_name(path: Path, root: Path, package: str) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def imported_modules(path: Path, prefix: str) -> set[str]:
    """Dotted names under `prefix` that `path` imports anywhere in its body (`from p import m` counts
    as p.m when m is a module of p, else as p)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and \
                (node.module == prefix or node.module.startswith(prefix + ".")):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                base = REPO / Path(*candidate.split("."))
                found.add(candidate if base.with_suffix(".py").exists() or base.is_dir() else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == prefix or a.name.startswith(prefix + ".")}
    return found


def graph() -> dict[str, set[str]]:
    edges = {}
    for path in sorted(LOCALCLUSTER.rglob("*.py")):
        name = module_name(path, LOCALCLUSTER, PACKAGE)
        edges[name] = imported_modules(path, PACKAGE) - {name}
    return edges


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


def test_imported_modules_tells_a_module_from_a_name(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from localcluster.nodesim import pod\nfrom localcluster.kubeapi import Kube\n"
                      "def f():\n    import localcluster.network\n")
    assert imported_modules(source, PACKAGE) == {"localcluster.nodesim.pod", "localcluster.kubeapi",
                                                 "localcluster.network"}


def test_localcluster_has_no_import_circle() -> None:
    edges = graph()
    assert {"localcluster.network", "localcluster.nodesim.simulator", "localcluster.controlplane",
            "localcluster.paths"} <= edges.keys()
    assert cycle(edges) is None


def test_the_node_simulator_does_not_import_what_starts_it() -> None:
    edges = graph()
    assert "localcluster.nodesim.node" in edges["localcluster.network"]
    importers = [m for m, deps in edges.items() if m.startswith("localcluster.nodesim") and
                 "localcluster.network" in deps]
    assert importers == []


def test_the_node_simulator_is_one_module_per_job() -> None:
    modules = {p.stem for p in (LOCALCLUSTER / "nodesim").glob("*.py")} - {"__init__", "__main__"}
    assert modules == NODESIM_JOBS
    long = {p.name: n for p in LOCALCLUSTER.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_command_lines_import_plainly() -> None:
    """No importlib: controlplane and cli need network (the bridge, the nodes); say so."""
    for name in ("controlplane.py", "cli.py"):
        assert "importlib" not in (LOCALCLUSTER / name).read_text(), name
    assert "localcluster.network" in graph()["localcluster.controlplane"]
    assert "localcluster.network" in graph()["localcluster.cli"]


def test_the_product_never_imports_the_test_bed() -> None:
    assert not (PRODUCT / "localcluster").exists()
    importers = {str(p.relative_to(REPO)) for p in PRODUCT.rglob("*.py") if imported_modules(p, PACKAGE)}
    assert importers == set()


def test_the_product_does_not_depend_on_the_test_beds_packages() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {d.split(">")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    assert "cryptography" not in runtime
    assert "localcluster" not in project.get("scripts", {})
    lock = (REPO / "requirements.lock").read_text()
    assert "\ncryptography==" not in lock


BLOCKER = """
import importlib.abc, pkgutil, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("localcluster", "cryptography"):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Blocker())
import proxyshift
count = 0
for info in pkgutil.walk_packages(proxyshift.__path__, "proxyshift."):
    __import__(info.name)
    count += 1
from proxyshift import cli
assert cli.main(["--help"]) == 0
print(count)
"""


def test_every_product_module_imports_without_the_test_bed_or_cryptography() -> None:
    """As in the image: every proxyshift module imports (and the CLI answers) with localcluster and
    cryptography unavailable."""
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120,
                          cwd=REPO / "operator", check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 50


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product's wheel, built as the image's `pip install /src` builds it (no deps, setuptools)."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--disable-pip-version-check", "-w", str(out), str(REPO)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("proxyshift-*.whl")
    return wheel


def test_the_product_wheel_holds_only_the_operator_and_agent(product_wheel: Path) -> None:
    """What the image installs (`pip install /src`): proxyshift and its metadata, no test bed."""
    names = zipfile.ZipFile(product_wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"proxyshift", f"{product_wheel.name.split('-py3')[0]}.dist-info"}
    assert "proxyshift/agent/loop.py" in names and "proxyshift/controller/main.py" in names
    assert [n for n in names if "localcluster" in n or n.endswith(".sh")] == []


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines without an extra: what `pip install proxyshift` (no extras) pulls in."""
    with zipfile.ZipFile(wheel) as whl:
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        lines = whl.read(metadata).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


def uv() -> str:
    """The venv's uv (requirements/venv.in pins it into .venv), else one on PATH."""
    beside = Path(sys.executable).with_name("uv")
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        pytest.fail("no uv beside the test interpreter or on PATH: `make venv` installs it")
    return found


def test_pip_install_without_extras_holds_no_test_bed_and_both_commands_answer(product_wheel: Path,
                                                                               tmp_path: Path) -> None:
    """The issue's check, offline: a fresh venv (no system site-packages), the product wheel installed with
    its dependencies resolved as `pip install .` resolves them (no extras), then the two commands the image
    runs. uv instead of pip because uv resolves from the cache `make venv` filled (`--offline`: no index is
    asked), where pip would need the network or a folder of wheels; the resolution is the same (the wheel's
    Requires-Dist)."""
    requirements = runtime_requirements(product_wheel)
    assert any(r.startswith("kopf") for r in requirements), requirements
    assert [r for r in requirements if "cryptography" in r or "localcluster" in r] == []

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"

    def call(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        # cwd outside the checkout: the repository's own localcluster/ folder must not be importable by accident
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env,
                              check=False)

    made = call([uv(), "venv", "--quiet", "--no-project", "--python", sys.executable, str(venv)], timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    installed = call([uv(), "pip", "install", "--offline", "--quiet", "--python", str(python), str(product_wheel)])
    assert installed.returncode == 0, (
        "uv could not install the wheel's dependencies from its cache offline (`make venv` fills it):\n"
        + installed.stderr[-3000:])
    checked = call([uv(), "pip", "check", "--python", str(python)], timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    listed = call([uv(), "pip", "list", "--format", "json", "--python", str(python)], timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert {"proxyshift", "kopf", "kubernetes", "pydantic"} <= names, names
    assert names & {"cryptography", "proxyshift-localcluster", "pytest", "hypothesis", "mypy"} == set(), names

    for absent in ("localcluster", "cryptography"):
        imported = call([str(python), "-c", f"import {absent}"], timeout=60)
        assert imported.returncode != 0 and "ModuleNotFoundError" in imported.stderr, (absent, imported.stderr)
    for command in ("operator", "agent"):
        helped = call([str(venv / "bin" / "proxyshift"), command, "--help"], timeout=120)
        assert helped.returncode == 0, helped.stderr[-3000:]
        assert helped.stdout.startswith(f"usage: proxyshift {command} "), helped.stdout[:300]


def test_the_test_beds_wheel_holds_every_module_of_it(tmp_path: Path) -> None:
    """`pip install ./localcluster` (not only the editable install of `make venv`) brings the whole test bed,
    its subpackages (nodesim/) and the guest's scripts too. Built from a copy: an in-tree build leaves a
    build/ folder inside the package's own folder."""
    source = tmp_path / "localcluster"
    shutil.copytree(LOCALCLUSTER, source,
                    ignore=shutil.ignore_patterns("build", "bin", "__pycache__", "*.egg-info", "cmd"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--disable-pip-version-check", "-w", str(tmp_path / "wheel"), str(source)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("proxyshift_localcluster-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"localcluster/{p.relative_to(LOCALCLUSTER).as_posix()}" for pattern in ("*.py", "*.sh", "pins.env")
              for p in LOCALCLUSTER.rglob(pattern) if "build" not in p.relative_to(LOCALCLUSTER).parts[:-1]}
    assert "localcluster/nodesim/simulator.py" in wanted
    assert sorted(wanted - names) == []
