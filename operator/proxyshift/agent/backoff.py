"""The agent's watch back-off: exponential, capped, with "full jitter" above a floor.

Why jitter: every agent of a cluster loses its watch at the same moment when the API
server restarts. Without jitter each waits 1, 2, 4, ... 30 s after that moment, so
thousands of agents knock again in the same instant, every time; the API server,
just up, answers a few hundred and throttles the rest (priority and fairness puts
every agent in one flow: they share one service account), which then wait the same
doubled time together. Drawing each wait uniformly below the ceiling spreads one
round of retries over the whole interval.

Why "full jitter" (uniform in [floor, ceiling]) and not "decorrelated jitter"
(uniform in [base, 3 x the last wait], clipped at the cap):
- it never waits longer than the back-off without jitter did, so no agent comes back
  later than before after an outage (on average it comes back after half the time);
- it spreads over the whole interval at the cap too: decorrelated jitter clipped at
  the cap puts about two thirds of the draws exactly on the cap, which lines the
  fleet up again;
- with the draw fixed at 1 it is the old schedule, which the reconnect-storm bench
  (bench/bench_reconnect_storm.py) runs beside it.

Why a floor: plain full jitter draws from [0, ceiling], and a draw near 0 retries at
once; against an API server that refuses connections that is a spin. With the floor
no agent tries more than 1 / floor times a second.
"""

from __future__ import annotations

import math

BASE_SECONDS = 1.0      # the first ceiling after a failure
CAP_SECONDS = 30.0      # the ceiling never grows past this
FLOOR_SECONDS = 0.5     # no wait is shorter (unless the ceiling itself is)


def next_ceiling(ceiling: float, cap: float = CAP_SECONDS) -> float:
    """The ceiling after one more failure: doubled, at most `cap`."""
    return min(ceiling * 2, cap)


def jittered_wait(ceiling: float, draw: float, floor: float = FLOOR_SECONDS) -> float:
    """The wait before the next try: uniform in [min(floor, ceiling), ceiling] when `draw` is uniform in [0, 1].

    `draw` 1.0 gives the ceiling itself: the back-off without jitter. Draws outside [0, 1] are clamped, so a
    faulty source of randomness can neither spin the agent nor put it to sleep for longer than the ceiling.
    """
    draw = 1.0 if math.isnan(draw) else min(max(draw, 0.0), 1.0)
    low = min(floor, ceiling)
    return low + (ceiling - low) * draw
