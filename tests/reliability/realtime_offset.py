"""Build the LD_PRELOAD shim that runs a process's wall clock ahead (tests/tools/realtime-offset).

Built per test session with the system C compiler into a world-readable temporary folder, so a
process of any user the node simulator starts can load it; nothing is cached or committed.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "tools" / "realtime-offset" / "realtime_offset.c"
OFFSET_ENV = "PROXYSHIFT_REALTIME_OFFSET"


def build(into: Path | None = None) -> Path:
    """Compile the shim; returns the .so path. Fails loudly without a C compiler (`make deps` installs gcc)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: `make deps` installs gcc and libc6-dev for the clock-skew shim"
    folder = into or Path(tempfile.mkdtemp(prefix="proxyshift-realtime-offset-"))
    folder.chmod(0o755)
    library = folder / "realtime_offset.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library), str(SOURCE), "-ldl"],
                   check=True, timeout=60, capture_output=True, text=True)
    library.chmod(0o755)
    return library


def environment(library: Path, seconds: int) -> list[dict[str, str]]:
    """The container env entries that put a process `seconds` ahead of the real wall clock."""
    return [{"name": "LD_PRELOAD", "value": str(library)}, {"name": OFFSET_ENV, "value": str(seconds)}]
