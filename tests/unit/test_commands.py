"""proxyshift.commands.run: an argument list, never a command line."""

from __future__ import annotations

import pytest

from proxyshift.commands import run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("line", ["iptables-save -t nat", b"nft list ruleset"])
def test_run_refuses_a_command_line(line: str | bytes) -> None:
    # A string used to be spread into single characters ("i", "p", ...) and fail as a missing tool "i".
    with pytest.raises(TypeError, match="argument list"):
        run(line)  # type: ignore[arg-type]


def test_run_takes_an_argument_list() -> None:
    assert run(["python3", "-c", "print('a b')"]).stdout == "a b\n"
