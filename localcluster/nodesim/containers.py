"""A container's life in a pod (process, restarts, probes) and how its processes are stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from localcluster.nodesim.probes import ProbeState


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restart_count: int = 0
    crashes: int = 0
    next_start: float = 0.0
    waiting: tuple[str, str] = ("ContainerCreating", "")
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    done: bool = False  # exited and will not be restarted
    probes: list[ProbeState] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def reset_probes(self) -> None:
        self.probes = [ProbeState(self.spec[key], kind) for key, kind in
                       (("startupProbe", "startup"), ("readinessProbe", "readiness"),
                        ("livenessProbe", "liveness")) if self.spec.get(key)]
        for probe in self.probes:
            probe.next_at = time.monotonic() + float(probe.spec.get("initialDelaySeconds", 0))

    def probe_ok(self, kind: str) -> bool:
        return all(p.ok for p in self.probes if p.kind == kind)

    @property
    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.probe_ok("startup") and \
            self.probe_ok("readiness")


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each container's process group, SIGKILL whatever is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return
