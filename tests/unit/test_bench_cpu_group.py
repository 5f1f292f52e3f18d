"""The storm bench's idle CPU group: made on cgroup v1 and v2, with cpu.idle where the kernel has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness import cpu_group

pytestmark = pytest.mark.unit


def fake_group_files(folder: Path, names: list[str]) -> None:
    """cgroupfs makes a new group's files itself; here the test plays the kernel."""
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("0")


def test_v1_with_cpu_idle(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.shares").write_text("1024")
    fake_group_files(tmp_path / "cpu" / "fleet", ["cpu.idle", "cpu.shares", "cgroup.procs"])
    group, how = cpu_group.make_idle_group("fleet", tmp_path)
    assert group == tmp_path / "cpu" / "fleet"
    assert how == "cgroup v1 cpu.idle=1"
    assert (group / "cpu.idle").read_text() == "1"
    assert (group / "cpu.shares").read_text() == "0"  # untouched: idle says it all


def test_v1_without_cpu_idle_gets_the_smallest_share(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.shares").write_text("1024")
    fake_group_files(tmp_path / "cpu" / "fleet", ["cpu.shares", "cgroup.procs"])
    group, how = cpu_group.make_idle_group("fleet", tmp_path)
    assert group is not None and how == "cgroup v1 cpu.shares=2"
    assert (group / "cpu.shares").read_text() == "2"


def test_v2_without_cpu_idle_gets_the_smallest_weight(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    fake_group_files(tmp_path / "fleet", ["cpu.weight", "cgroup.procs"])
    group, how = cpu_group.make_idle_group("fleet", tmp_path)
    assert group is not None and how == "cgroup v2 cpu.weight=1"
    assert (group / "cpu.weight").read_text() == "1"


def test_no_cpu_controller_says_why(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    group, how = cpu_group.make_idle_group("fleet", tmp_path)
    assert group is None
    assert "no cpu controller" in how


def test_join_writes_the_pid(tmp_path: Path) -> None:
    fake_group_files(tmp_path / "g", ["cgroup.procs"])
    cpu_group.join(tmp_path / "g", 4242)
    assert (tmp_path / "g" / "cgroup.procs").read_text() == "4242"

