"""The storm bench's idle CPU group on this machine's real cgroupfs (root: CI runs this layer as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import cpu_group

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]


def test_a_joined_process_runs_in_the_idle_group() -> None:
    group, how = cpu_group.make_idle_group(f"proxyshift-test-{os.getpid()}")
    assert group is not None, how
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; from bench.harness import cpu_group; "
             "cpu_group.join(Path(sys.argv[1])); print(Path('/proc/self/cgroup').read_text())", str(group)],
            capture_output=True, text=True, timeout=30, check=True, cwd=ROOT)
        assert f"/{group.name}\n" in out.stdout
    finally:
        cpu_group.remove(group)
    assert not group.exists()
