"""The agent's watch back-off (agent/backoff.py): bounded, spread, never a spin."""

from __future__ import annotations

import collections
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.agent.backoff import BASE_SECONDS, CAP_SECONDS, FLOOR_SECONDS, jittered_wait, next_ceiling

pytestmark = pytest.mark.unit

ceilings = st.floats(min_value=0.001, max_value=1e6, allow_nan=False)
draws = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def ceilings_after(failures: int) -> list[float]:
    out, c = [], BASE_SECONDS
    for _ in range(failures):
        out.append(c)
        c = next_ceiling(c)
    return out


def test_the_ceiling_doubles_from_one_second_up_to_thirty() -> None:
    assert ceilings_after(8) == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_draw_of_one_is_the_back_off_without_jitter_and_zero_the_floor() -> None:
    assert [jittered_wait(c, 1.0) for c in ceilings_after(6)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert [jittered_wait(c, 0.0) for c in ceilings_after(3)] == [FLOOR_SECONDS] * 3
    assert jittered_wait(30.0, 0.5) == pytest.approx(FLOOR_SECONDS + (30.0 - FLOOR_SECONDS) / 2)


@given(ceilings, st.floats(allow_nan=True, allow_infinity=True))
def test_every_wait_lies_between_the_floor_and_the_ceiling_whatever_the_draw(ceiling: float, draw: float) -> None:
    wait = jittered_wait(ceiling, draw)
    assert min(FLOOR_SECONDS, ceiling) <= wait <= ceiling
    assert wait > 0  # never a retry at once: no spin against an API server that refuses


@given(ceilings.filter(lambda c: c > FLOOR_SECONDS * 1.001), draws, draws)
def test_different_draws_give_different_waits_in_order(ceiling: float, a: float, b: float) -> None:
    """The wait is an increasing (affine) function of the draw: uniform draws give waits spread uniformly
    over [floor, ceiling], never piled up on one value."""
    if a <= b:
        assert jittered_wait(ceiling, a) <= jittered_wait(ceiling, b)
    if b - a > 1e-9:  # apart by more than float rounding can swallow
        assert jittered_wait(ceiling, a) < jittered_wait(ceiling, b)


@settings(max_examples=200)
@given(st.lists(draws, min_size=1, max_size=40))
def test_an_agent_never_waits_longer_than_without_jitter_and_never_tries_faster_than_the_floor(ds: list[float]) -> None:
    ceilings = ceilings_after(len(ds))
    waits = [jittered_wait(c, d) for c, d in zip(ceilings, ds, strict=True)]
    assert all(w <= c <= CAP_SECONDS for w, c in zip(waits, ceilings, strict=True))
    # tries in the first T seconds of an outage: at most T / floor + 1, the floor bounds the rate
    t, tries = 0.0, 1
    for w in waits:
        t += w
        tries += 1
        assert tries <= t / FLOOR_SECONDS + 1
    assert sum(waits) <= sum(ceilings)


@pytest.mark.parametrize("ceiling", [1.0, 4.0, 30.0])
def test_a_fleet_that_failed_together_comes_back_spread_over_the_interval(ceiling: float) -> None:
    """5,000 agents lose their watch in the same instant: with jitter no tenth of the interval gets more than
    about a tenth of them; without (draw 1) all of them land in one instant."""
    agents = 5000
    rng = random.Random(18)  # fixed: the test is deterministic, and the property holds for any fair source
    waits = [jittered_wait(ceiling, rng.random()) for _ in range(agents)]
    low = min(FLOOR_SECONDS, ceiling)
    buckets = collections.Counter(min(9, math.floor((w - low) / (ceiling - low) * 10)) for w in waits)
    assert len(buckets) == 10 and max(buckets.values()) < agents / 10 * 1.2, buckets
    assert len({jittered_wait(ceiling, 1.0) for _ in range(agents)}) == 1
