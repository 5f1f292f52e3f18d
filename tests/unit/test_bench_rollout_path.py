"""The rollout bench's critical path: a one-node-at-a-time rollout cut into segments that add up."""

from __future__ import annotations

import math

import pytest

from bench.bench_rollout_overhead import PATH_SEGMENTS, NodeSplit, Result, critical_path

pytestmark = pytest.mark.unit


def node(name: str, switch: float | None, restart: float, sync: float, report: float) -> NodeSplit:
    return NodeSplit(name, 0.0, 0.0, 0.0, 0.0, {}, switch, restart, sync, report)


def test_segments_follow_each_other_and_add_up_to_the_rollout() -> None:
    # Listed out of order: the path orders nodes by their switch.
    second = node("b", 2.06, 2.08, 3.40, 3.66)
    first = node("a", 0.39, 0.45, 1.77, 2.00)
    result = Result("migrate", 1, 3.75, [second, first], started=0.0)
    path = critical_path(result)
    assert path is not None
    assert path["start"] == pytest.approx([0.39])
    assert path["label"] == pytest.approx([0.06, 0.02])
    assert path["kube-proxy"] == pytest.approx([1.32, 1.32])
    assert path["agent"] == pytest.approx([0.23, 0.26])
    assert path["handoff"] == pytest.approx([0.06])
    assert path["end"] == pytest.approx([0.09])
    assert sum(sum(path[k]) for k in PATH_SEGMENTS) == pytest.approx(result.seconds)


def test_overlapping_nodes_have_no_single_path() -> None:
    result = Result("migrate", 1, 4.0, [node("a", 0.4, 0.5, 1.8, 2.0), node("b", 1.0, 1.1, 2.4, 2.6)], started=0.0)
    assert critical_path(result) is None


def test_a_missing_moment_is_not_measured() -> None:
    assert critical_path(Result("migrate", 1, 4.0, [node("a", None, 0.5, 1.8, 2.0)], started=0.0)) is None
    assert critical_path(Result("migrate", 1, 4.0, [node("a", 0.4, 0.5, 1.8, 2.0)], started=math.nan)) is None
