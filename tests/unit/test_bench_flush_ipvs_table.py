"""The ipvs flush bench's table: a kube-proxy run that exited non-zero is never shown as a plain time."""

from __future__ import annotations

import pytest

from bench.bench_flush_ipvs import Cell, table

pytestmark = pytest.mark.unit


def rows(*cells: Cell) -> list[list[str]]:
    return [[field.strip() for field in row.strip("|").split("|")] for row in table(list(cells))[2:]]


def test_clean_runs_show_time_and_ratio() -> None:
    agent = Cell(1000, "agent", [10.0, 12.0, 11.0], [0, 0, 0])
    kube_proxy = Cell(1000, "kube-proxy", [22.0, 23.0, 21.0], [0, 0, 0], kept=False)
    assert rows(agent, kube_proxy) == [
        ["1000", "agent", "0,0,0", "11.00", "10.00-12.00", "1.0x", "none", "yes"],
        ["1000", "kube-proxy", "0,0,0", "22.00", "21.00-23.00", "2.0x", "none", "NO"],
    ]


def test_a_failed_run_marks_the_cell_and_brackets_its_ratio() -> None:
    # One failed run of three is enough: the median could hide it, the table must not.
    agent = Cell(5000, "agent", [30.0], [0])
    kube_proxy = Cell(5000, "kube-proxy", [15.0, 16.0, 17.0], [0, 1, 0], ["3 chains"])
    row = rows(agent, kube_proxy)[1]
    assert row[2:7] == ["0,1,0", "exit 1 after 16.00", "15.00-17.00", "(0.5x)", "3 chains"]


def test_a_failed_agent_brackets_every_ratio_of_its_size() -> None:
    agent = Cell(1000, "agent", [10.0], [1])
    kube_proxy = Cell(1000, "kube-proxy", [20.0], [0])
    assert [row[5] for row in rows(agent, kube_proxy)] == ["(1.0x)", "(2.0x)"]
