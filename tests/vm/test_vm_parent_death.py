"""A guest never outlives the process that booted it, even when that process is SIGKILLed.

run_in_vm stops QEMU in a `finally`, which a SIGKILL (an interrupted CI job, the OOM killer, a
person's `kill -9` of a hung test run) never reaches; QEMU then kept running with its 1.5 GB and
the tap device. The kernel's parent-death signal (set through setpriv before QEMU starts) is the
one thing that still acts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from proxyshift.commands import stop_child

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
BOOTER = """
from localcluster import vm
vm.run_in_vm(["sleep", "600"], timeout=900, memory_mib=512, cpus=1)
"""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = task / "children"
        if children.exists():
            found += [int(p) for p in children.read_text().split()]
    return found


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent's reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_sigkilled_booter_takes_its_guest_with_it() -> None:
    before = set(Path(tempfile.gettempdir()).glob("proxyshift-vm-*"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "operator")]))
    booter = subprocess.Popen([sys.executable, "-c", BOOTER], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    qemu: int | None = None
    try:
        deadline = time.monotonic() + 60
        while qemu is None and time.monotonic() < deadline and booter.poll() is None:
            qemu = next((p for p in _children(booter.pid) if (_name(p) or "").startswith("qemu-system")), None)
            time.sleep(0.2)
        if qemu is None:
            stop_child(booter, grace=1)
            err = booter.stderr.read().decode(errors="replace") if booter.stderr else ""
            pytest.fail(f"no QEMU started under the booter within 60 s: {err[-2000:]}")
        time.sleep(2)  # the guest is booting: QEMU is well past its own start-up
        booter.send_signal(signal.SIGKILL)
        booter.wait(timeout=10)
        gone_by = time.monotonic() + 10
        while _alive(qemu) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(qemu), f"QEMU (pid {qemu}) still runs after its booter was SIGKILLed"
        print(f"QEMU pid {qemu} gone after its booter's SIGKILL")
    finally:
        if qemu is not None and _alive(qemu):
            os.kill(qemu, signal.SIGKILL)
        stop_child(booter, grace=1)
        # run_in_vm's own work folder, which its finally would have removed
        for left in set(Path(tempfile.gettempdir()).glob("proxyshift-vm-*")) - before:
            shutil.rmtree(left, ignore_errors=True)
