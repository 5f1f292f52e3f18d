"""What the node simulator's containers are as host processes: their pids and what /proc says of them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from localcluster import state


def container_pid(state_dir: Path, node: str, namespace: str, pod_prefix: str, container: str) -> int | None:
    """The pid of a running container on a simulated node, from the simulator's pid files."""
    for pid_file in sorted((state_dir / "nodes" / node / "pids").glob(f"{namespace}_{pod_prefix}*_{container}.pid")):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            if state.start_ticks(pid) is not None:
                return pid
    return None


def status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as field -> value (Uid, CapEff, NoNewPrivs, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def mount_options(pid: int) -> dict[str, set[str]]:
    """Mount point -> per-mount options, as the process sees its mounts."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        out[fields[4]] = set(fields[5].split(","))
    return out


def assert_confined_as_operator(pid: int) -> None:
    """The process runs as config/manager/deployment.yaml says: uid 65532, no capability, no privilege
    escalation, a read-only root (issue 15)."""
    s = status(pid)
    assert s["Uid"].split()[0] == "65532", s["Uid"]
    assert int(s["CapEff"], 16) == 0 and int(s["CapBnd"], 16) == 0, (s["CapEff"], s["CapBnd"])
    assert s["NoNewPrivs"] == "1"
    root = mount_options(pid)["/"]
    assert "ro" in root, root
