"""Helpers for the tests that run inside the QEMU guest."""

from __future__ import annotations

import time
from pathlib import Path

from proxyshift.commands import CommandError, run


def loaded_modules() -> set[str]:
    return {line.split()[0] for line in Path("/proc/modules").read_text().splitlines() if line.strip()}


def unload_ipvs(timeout: float = 30.0) -> None:
    """Back to a fresh boot's IPVS state: no ip_vs or scheduler module loaded.

    A deleted namespace releases its IPVS objects asynchronously, so the modules
    may stay busy for a moment after the test that used them.
    """
    deadline = time.monotonic() + timeout
    while True:
        ipvs = sorted(m for m in loaded_modules() if m.startswith("ip_vs"))
        if not ipvs:
            return
        try:
            run(["modprobe", "-r", *[m for m in ipvs if m != "ip_vs"], "ip_vs"], timeout=30)
        except CommandError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"could not unload {ipvs}: {exc}") from exc
            time.sleep(0.5)
