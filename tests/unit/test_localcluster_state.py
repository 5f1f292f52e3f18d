"""state.json bookkeeping: `down` stops what was recorded and removes what was recorded, nothing else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster import build, state

pytestmark = pytest.mark.unit


def test_spawned_process_is_stopped_and_files_removed(tmp_path: Path) -> None:
    state_dir = tmp_path / "cluster"
    keep = tmp_path / "not-ours"
    keep.write_text("x")
    data = state_dir / "data"
    state.record_path(state_dir, data)
    data.mkdir()
    sleeper = shutil.which("sleep")
    assert sleeper
    proc = state.spawn(state_dir, "sleep", [sleeper, "300"])
    record = state.read_state(state_dir)["processes"][0]
    assert state.is_alive(record)
    assert (state_dir / "pids" / "sleep.pid").read_text().strip() == str(proc.pid)

    assert state.stop_all(state_dir) == ["sleep"]
    proc.wait(timeout=5)
    state.remove_paths(state_dir)
    assert not state_dir.exists()
    assert keep.exists()
    # Idempotent: a second down on nothing is fine.
    assert state.stop_all(state_dir) == []
    state.remove_paths(state_dir)


def test_reused_pid_is_not_killed(tmp_path: Path) -> None:
    sleeper = shutil.which("sleep")
    assert sleeper
    proc = state.spawn(tmp_path, "sleep", [sleeper, "300"])
    try:
        with state.locked_state(tmp_path) as current:
            current["processes"][0]["start_ticks"] += 1  # as if the pid now belonged to another process
        record = state.read_state(tmp_path)["processes"][0]
        assert not state.is_alive(record)
        state.stop_process(record, grace=0.1)
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_torn_state_file_is_survivable(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text("{not json")
    assert state.read_state(tmp_path)["processes"] == []
    json.dumps(state.read_state(tmp_path))


def test_pin_hash_follows_ldflags(tmp_path: Path) -> None:
    (tmp_path / "cmd" / "etcd").mkdir(parents=True)
    (tmp_path / "go.mod").write_text("module x\n")
    (tmp_path / "go.sum").write_text("")
    (tmp_path / "cmd" / "etcd" / "main.go").write_text("package main\n")
    first = build.pin_hash(tmp_path, "-X a=1")
    assert build.pin_hash(tmp_path, "-X a=1") == first
    assert build.pin_hash(tmp_path, "-X a=2") != first
    (tmp_path / "cmd" / "etcd" / "main.go").write_text("package main // changed\n")
    assert build.pin_hash(tmp_path, "-X a=1") != first


def test_machine_lock_is_reentrant_and_exclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with state.machine_lock(), state.machine_lock():  # nested in one process: fine
        other = subprocess.run(
            [sys.executable, "-c", "from localcluster import state\n"
             "with state.machine_lock(timeout=0.5): pass"],
            capture_output=True, text=True, timeout=30)
        assert other.returncode != 0 and "TimeoutError" in other.stderr
    free = subprocess.run([sys.executable, "-c", "from localcluster import state\n"
                           "with state.machine_lock(timeout=0.5): pass"], timeout=30)
    assert free.returncode == 0
