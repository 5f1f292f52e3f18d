"""The one way proxyshift runs an external program: an argument list, a timeout, no shell.

Every tool the agent and the local cluster call (iptables-save, nft, ip, ...) goes
through `run`, so a missing binary, a hung tool and a failing tool each give one
clear error instead of a traceback from subprocess.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 30.0


class CommandError(RuntimeError):
    """An external command could not run, timed out, or exited non-zero."""

    def __init__(self, argv: Sequence[str], message: str, *, returncode: int | None = None,
                 stderr: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"{argv[0]}: {message}")


class ToolMissingError(CommandError):
    """The program is not installed (or not on PATH)."""


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def netns_prefix(netns: str | None) -> list[str]:
    """Argument prefix that runs a command inside a named network namespace."""
    return ["ip", "netns", "exec", netns] if netns else []


def run(argv: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_SECONDS, input: str | None = None,
        check: bool = True, netns: str | None = None, env: dict[str, str] | None = None) -> Result:
    """Run `argv` (never through a shell) and return its output.

    Raises ToolMissingError when the program does not exist, CommandError on a
    timeout or (with check=True) a non-zero exit, carrying the tool's stderr.
    """
    if isinstance(argv, str | bytes):
        # A command line would be spread into single characters; say what is wrong instead.
        raise TypeError(f"run() takes an argument list, not a command line: {argv!r}")
    full = [*netns_prefix(netns), *argv]
    if shutil.which(full[0]) is None:
        raise ToolMissingError(full, f"not found on PATH (install the package that provides {full[0]!r})")
    try:
        proc = subprocess.run(  # noqa: S603 - argument list, never a shell
            full, input=input, capture_output=True, text=True, timeout=timeout, check=False, env=env,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(full, f"timed out after {timeout:g}s") from exc
    except OSError as exc:
        raise CommandError(full, f"could not start: {exc}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        tail = "; ".join(detail[-5:]) if detail else "no output"
        raise CommandError(full, f"exited {proc.returncode}: {tail}", returncode=proc.returncode,
                           stderr=proc.stderr)
    return Result(full, proc.returncode, proc.stdout, proc.stderr)


def side_by_side(calls: Sequence[Callable[[], T]], *, name: str) -> list[T]:
    """Run independent calls at once, each in its own thread; their results in the calls' order.

    For reads and writes that share nothing (an IPv4 and an IPv6 iptables round, an nft listing): their time
    is the tools' fork, exec and work, outside the GIL, so N of them take about the longest one on a node
    with the cores for it. An exception comes out of the call that raised it, as if they ran one by one.
    """
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls), thread_name_prefix=name) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def stop_child(proc: subprocess.Popen[bytes] | subprocess.Popen[str], *, grace: float = 15.0,
               sig: int = signal.SIGTERM) -> None:
    """Stop a child process: send `sig`, give it `grace` seconds to exit, then SIGKILL it.

    Nothing happens when it has already exited; either way it is reaped, so no zombie is left.
    """
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=15)
