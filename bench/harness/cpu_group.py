"""An idle CPU group for work that stands in for other machines (a simulated fleet of agents).

Why not `nice 19`: the kernel weighs every runnable thread on its own, so 5,000 agent threads at nice 19
(weight 15 each) still outweigh an API server's few busy threads at nice 0 (1,024 each) by far: the fleet's
TLS handshakes took most of the 2 cores while the restarted API server started. A cgroup is weighed as one
entity, and an idle one (`cpu.idle`, Linux 5.15+) only gets CPU nobody else in the machine wants: as if the
fleet ran on machines of its own, except that its own work waits while the control plane is busy (which
makes the fleet look slower, never the control plane faster than it is).

cgroup v1 (`/sys/fs/cgroup/cpu`) and v2 (`/sys/fs/cgroup` with the cpu controller) are both handled; without
`cpu.idle` the group gets the smallest weight. Where no group can be made (no root, read-only cgroupfs)
`make_idle_group` says why and the caller falls back to nice 19.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cpu_root(root: Path) -> tuple[Path, str] | None:
    """The cpu controller's hierarchy and its version ("v1"/"v2"), or None."""
    if (root / "cpu" / "cpu.shares").exists():
        return root / "cpu", "v1"
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return root, "v2"
    return None


def make_idle_group(name: str, root: Path = CGROUP_ROOT) -> tuple[Path | None, str]:
    """Create (or reuse) the idle group `name`: (its folder, how it was made) or (None, why not)."""
    found = _cpu_root(root)
    if found is None:
        return None, f"no cpu controller under {root}"
    base, version = found
    group = base / name
    try:
        group.mkdir(exist_ok=True)
        if (group / "cpu.idle").exists():
            (group / "cpu.idle").write_text("1")
            return group, f"cgroup {version} cpu.idle=1"
        if version == "v1":
            (group / "cpu.shares").write_text("2")
            return group, "cgroup v1 cpu.shares=2"
        (group / "cpu.weight").write_text("1")
        return group, "cgroup v2 cpu.weight=1"
    except OSError as exc:
        return None, f"cannot make {group}: {exc}"


def join(group: Path, pid: int | None = None) -> None:
    """Move a process (this one by default) and its future children into `group`."""
    (group / "cgroup.procs").write_text(str(pid if pid is not None else os.getpid()))


def remove(group: Path) -> None:
    """Remove the group once its processes have ended (rmdir of a cgroup folder; a busy one stays)."""
    with contextlib.suppress(OSError):
        group.rmdir()
