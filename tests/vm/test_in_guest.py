"""Host side of the vm layer: one QEMU guest runs every `vm_guest` test; each is reported here.

The guest is booted once per session (about 10 s under TCG) and runs
`pytest -m vm_guest tests/vm/guest` with a junit XML in its per-run share. A
guest test that fails, errors, is skipped or never ran fails its host twin
with the guest's own text; a guest that cannot boot fails them all.
"""

from __future__ import annotations

import ast
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from vm_layer import IN_GUEST_ENV, VM_SUMMARY_KEY

from localcluster import vm
from tests.support.kube_proxy_runner import find_kube_proxy

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
GUEST_DIR = Path(__file__).resolve().parent / "guest"
GUEST_TIMEOUT_SECONDS = 1500.0


def guest_tests() -> list[str]:
    """`file_stem::function` of every test function in tests/vm/guest (read, not imported: cheap)."""
    found = []
    for path in sorted(GUEST_DIR.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.stem}::{node.name}" for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return found


@dataclass
class GuestRun:
    seconds: float
    output: str
    returncode: int | None
    cases: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)  # key -> [(case, outcome, text)]


def parse_junit(text: str) -> dict[str, list[tuple[str, str, str]]]:
    cases: dict[str, list[tuple[str, str, str]]] = {}
    for case in ET.fromstring(text).iter("testcase"):
        stem = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "")
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = tag
                detail = f"{node.get('message', '')}\n{node.text or ''}"
                break
        cases.setdefault(f"{stem}::{name.split('[', 1)[0]}", []).append((name, outcome, detail))
    return cases


@pytest.fixture(scope="session")
def guest_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GuestRun:
    share = tmp_path_factory.mktemp("vm-share")
    kube_proxy = find_kube_proxy()
    # Unbuffered: the guest's stdout is a serial port, not a tty, and progress should stream.
    env = {"PYTHONPATH": str(REPO / "operator"), IN_GUEST_ENV: "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONUNBUFFERED": "1"}
    if kube_proxy is not None:
        env["PROXYSHIFT_KUBE_PROXY"] = str(kube_proxy)
    argv = [sys.executable, "-m", "pytest", "-m", "vm_guest", str(GUEST_DIR.relative_to(REPO)), "-q", "-rA",
            "-p", "no:cacheprovider", "--durations=10", f"--junitxml={vm.GUEST_RUN_DIR}/junit.xml",
            "-o", "junit_family=xunit1"]
    started = time.monotonic()
    # Streamed past pytest's capture: the guest's progress is visible while the layer runs (minutes).
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        result = vm.run_in_vm(argv, cwd=REPO, env=env, timeout=GUEST_TIMEOUT_SECONDS, run_dir=share,
                              stream=sys.stderr)
    seconds = time.monotonic() - started
    junit = share / "junit.xml"
    run = GuestRun(seconds=seconds, output=result.output, returncode=result.returncode,
                   cases=parse_junit(junit.read_text()) if junit.exists() else {})
    count = sum(len(v) for v in run.cases.values())
    request.config.stash[VM_SUMMARY_KEY] = (
        f"guest: {count} tests, exit {result.returncode if not result.timed_out else 'timeout'}, "
        f"{seconds:.0f} s including boot; qemu peak RSS {result.qemu_rss_mib or 0:.0f} MiB "
        f"({vm.default_cpus()} vCPU, {vm.default_memory_mib()} MiB, {result.accel})")
    return run


# The first test sets up the session's one guest run: its time counts against that test's timeout, so
# the bound is the guest's own (the run is ~500 s quiet; pytest's default 900 s cut one run on a loaded
# machine).
@pytest.mark.timeout(GUEST_TIMEOUT_SECONDS + 120)
@pytest.mark.parametrize("guest_test", guest_tests())
def test_in_guest(guest_run: GuestRun, guest_test: str) -> None:
    cases = guest_run.cases.get(guest_test)
    if not cases:
        pytest.fail(f"{guest_test} did not run in the guest (exit {guest_run.returncode}); guest output:\n"
                    f"{guest_run.output[-6000:]}")
    bad = [(name, outcome, text) for name, outcome, text in cases if outcome != "passed"]
    if bad:
        pytest.fail("\n\n".join(f"{name}: {outcome} in the guest\n{text[-6000:]}" for name, outcome, text in bad))


def test_every_guest_test_is_reported() -> None:
    """The host's list of guest tests and the files agree (a guest test file with no test is a mistake)."""
    assert guest_tests(), "tests/vm/guest has no tests"
