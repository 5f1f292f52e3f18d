"""state.json: the record of every process and path the local cluster made, so `down` can undo all of it.

Each daemon is recorded (pid + kernel start time) the moment it is spawned and
each path before it is created, so even a cluster whose `up` crashed half-way is
fully removable. The start time guards against killing an unrelated process
that reused a recorded pid after a reboot or a long time.

The node half records its own processes and paths through the same functions
(`spawn`, `record_process`, `record_path`), and `stop_all`/`remove_paths` treat
them like the control plane's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from localcluster import paths
from localcluster.paths import StateLayout

STATE_VERSION = 1
STOP_GRACE_SECONDS = 10.0
MACHINE_LOCK_TIMEOUT_SECONDS = 600.0

_machine_lock = threading.RLock()
_machine_lock_depth = 0
_machine_lock_file: list[IO[str]] = []


@contextlib.contextmanager
def machine_lock(timeout: float = MACHINE_LOCK_TIMEOUT_SECONDS) -> Iterator[None]:
    """One `up` or `down` at a time on this machine, whatever the state dir.

    The ports, the bridge and the namespace names are machine-wide, so two
    concurrent `up`s (two test sessions) would race past each other's port
    check. Reentrant within a process (cli.up holds it around up_controlplane,
    which takes it too). The lock file lives in the cache folder, not the state
    dir, because `down` removes the state dir.
    """
    global _machine_lock_depth
    with _machine_lock:
        if _machine_lock_depth == 0:
            _machine_lock_file[:] = [_acquire_file_lock(timeout)]
        _machine_lock_depth += 1
        try:
            yield
        finally:
            _machine_lock_depth -= 1
            if _machine_lock_depth == 0:
                _machine_lock_file.pop().close()  # closing releases the flock


def _acquire_file_lock(timeout: float) -> IO[str]:
    path = paths.cache_root().parent / "localcluster.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.close()
                raise TimeoutError(f"another localcluster up/down held {path} for {timeout:g}s") from None
            time.sleep(0.2)


def _empty_state() -> dict[str, Any]:
    return {"version": STATE_VERSION, "processes": [], "paths": [], "info": {}}


@contextlib.contextmanager
def locked_state(state_dir: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write state.json under an exclusive lock (the node simulator writes it too)."""
    layout = StateLayout(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    lock_path = state_dir / ".state.lock"
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_state(state_dir)
        yield state
        tmp = layout.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(layout.state_file)


def read_state(state_dir: Path) -> dict[str, Any]:
    path = StateLayout(state_dir).state_file
    if not path.is_file():
        return _empty_state()
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError:
        # A torn file must not make a cluster unremovable; pid files are the fallback.
        return _empty_state()
    for key, value in _empty_state().items():
        state.setdefault(key, value)
    return state


def record_path(state_dir: Path, path: Path) -> None:
    """Note a path `down` must remove (file or folder). Call before creating it."""
    with locked_state(state_dir) as state:
        if str(path) not in state["paths"]:
            state["paths"].append(str(path))


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def record_process(state_dir: Path, name: str, pid: int, argv: Sequence[str], log: Path | None = None,
                   stop_grace: float = STOP_GRACE_SECONDS) -> None:
    ticks = start_ticks(pid)
    with locked_state(state_dir) as state:
        state["processes"] = [p for p in state["processes"] if p["name"] != name]
        state["processes"].append({"name": name, "pid": pid, "start_ticks": ticks, "argv": list(argv),
                                   "log": str(log) if log else None, "stop_grace": stop_grace})
    pid_file = StateLayout(state_dir).pid(name)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{pid}\n")


def spawn(state_dir: Path, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
          cwd: Path | None = None, stop_grace: float = STOP_GRACE_SECONDS) -> subprocess.Popen[bytes]:
    """Start a long-running daemon, logging to logs/<name>.log, and record it at once.

    It gets its own session so it outlives the `localcluster up` command that
    started it and so `down` can signal its whole process group. `stop_grace` is
    how long `down` waits after SIGTERM before SIGKILL.
    """
    layout = StateLayout(state_dir)
    record_path(state_dir, layout.logs)
    record_path(state_dir, layout.pids)
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.log(name)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,  # noqa: S603
                                stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    record_process(state_dir, name, proc.pid, argv, log_path, stop_grace)
    return proc


def is_alive(record: dict[str, Any]) -> bool:
    ticks = start_ticks(record["pid"])
    return ticks is not None and (record.get("start_ticks") is None or ticks == record["start_ticks"])


def _reap(pid: int, wait: float = 0.0) -> None:
    """Collect our own dead child so it leaves /proc; others' are init's job.

    `wait`: a killed multi-threaded process shows as a zombie while its other
    threads are still exiting, and cannot be collected until they have.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() >= deadline or not _is_zombie(pid):
            return
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _signal(record: dict[str, Any], sig: signal.Signals) -> None:
    pid = record["pid"]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        # spawn() made the daemon a session (and group) leader: signal the group so
        # helpers it started go too. Anything else gets only its own pid.
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_process(record: dict[str, Any], grace: float | None = None) -> None:
    if grace is None:
        grace = float(record.get("stop_grace", STOP_GRACE_SECONDS))
    if _stopped(record):
        return
    _signal(record, signal.SIGTERM)
    if _wait_stopped(record, grace):
        return
    _signal(record, signal.SIGKILL)
    _wait_stopped(record, 5.0)


def _stopped(record: dict[str, Any]) -> bool:
    # Reap after the check too: a child of ours that died is a zombie until
    # waited for, and a zombie still shows in /proc.
    _reap(record["pid"])
    if is_alive(record):
        return False
    _reap(record["pid"], wait=5.0)
    return True


def _wait_stopped(record: dict[str, Any], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _stopped(record):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _pid_file_records(state_dir: Path, known: set[int]) -> list[dict[str, Any]]:
    """Processes that have a pid file but no state.json entry (a torn state.json)."""
    records = []
    for pid_file in sorted(StateLayout(state_dir).pids.glob("*.pid")):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            if pid not in known:
                # No recorded start time: accept only a process whose argv still
                # names the binary the pid file is named after.
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                if Path(cmdline.decode(errors="replace")).name == pid_file.stem:
                    records.append({"name": pid_file.stem, "pid": pid, "start_ticks": None})
    return records


def stop_all(state_dir: Path) -> list[str]:
    """Stop every recorded process, newest first; returns the names stopped."""
    state = read_state(state_dir)
    records = list(state["processes"])
    records += _pid_file_records(state_dir, {r["pid"] for r in records})
    stopped = []
    for record in reversed(records):
        if is_alive(record):
            stopped.append(record["name"])
        stop_process(record)
    return stopped


def remove_paths(state_dir: Path) -> None:
    """Remove every recorded path, then state.json, the lock and the folder if it is empty."""
    state = read_state(state_dir)
    for raw in reversed(state["paths"]):
        path = Path(raw)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    layout = StateLayout(state_dir)
    for leftover in (layout.state_file, layout.state_file.with_suffix(".tmp"), state_dir / ".state.lock"):
        leftover.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        state_dir.rmdir()


def running(state_dir: Path) -> list[dict[str, Any]]:
    """Recorded processes, each with an `alive` flag."""
    return [{**record, "alive": is_alive(record)} for record in read_state(state_dir)["processes"]]


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (for `status` and the docs' memory figure)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None
