"""proxyshift.commands: `run` takes an argument list, never a command line; `stop_child` stops a child."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from proxyshift.commands import run, stop_child

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("line", ["iptables-save -t nat", b"nft list ruleset"])
def test_run_refuses_a_command_line(line: str | bytes) -> None:
    # A string used to be spread into single characters ("i", "p", ...) and fail as a missing tool "i".
    with pytest.raises(TypeError, match="argument list"):
        run(line)  # type: ignore[arg-type]


def test_run_takes_an_argument_list() -> None:
    assert run(["python3", "-c", "print('a b')"]).stdout == "a b\n"


def test_stop_child_kills_a_child_that_ignores_the_polite_signal_and_reaps_it() -> None:
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    stop_child(proc, grace=0.3)
    assert proc.returncode == -signal.SIGKILL
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_child(polite)
    assert polite.returncode == -signal.SIGTERM
    stop_child(polite)  # already gone: nothing to do, no error
    proc.stdout.close()
