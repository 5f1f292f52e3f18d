"""Wakeups: the loops that work on a policy (its rollout daemon, its delete handler) sleep until
something they depend on changes, and pause between plans by what planning costs.

Only ever touched on the event loop: the mirrors' change callbacks and kopf's index handlers (both
coroutine-side) wake, the loops wait; asyncio events are not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Wakers:
    """policy name -> the events of the loops working on it, set whenever something they depend on changes."""

    events: dict[str, set[asyncio.Event]] = field(default_factory=dict)

    def wake(self, policy: str | None = None) -> None:
        """Wake the loops of `policy`; with no policy (or one nobody waits for), every loop."""
        targets = self.events.get(policy) if policy else None
        for events in [targets] if targets is not None else list(self.events.values()):
            for event in events:
                event.set()

    @contextlib.contextmanager
    def registered(self, policy: str) -> Iterator[asyncio.Event]:
        """An event that wake() sets for `policy` for as long as the block runs."""
        event = asyncio.Event()
        self.events.setdefault(policy, set()).add(event)
        try:
            yield event
        finally:
            events = self.events.get(policy)
            if events is not None:
                events.discard(event)
                if not events:
                    self.events.pop(policy, None)


@dataclass
class Pacing:
    """How long a loop batches watch events before its next plan: as long as its last plan took, at
    least `min_seconds` (PROXYSHIFT_MIN_REQUEUE_SECONDS).

    Bursts of watch events (our own writes echo back) are batched by that short pause. A small fleet
    re-plans within milliseconds of an agent's report; a fleet of thousands, whose every plan reads the
    whole world, spends at most about half its time planning.
    """

    min_seconds: float
    planning_seconds: dict[str, float] = field(default_factory=dict)  # policy -> its last plan's cost

    def planned(self, policy: str, seconds: float) -> None:
        self.planning_seconds[policy] = seconds

    def batch_seconds(self, policy: str) -> float:
        return max(self.min_seconds, self.planning_seconds.get(policy, 0.0))

    async def pause(self, policy: str, event: asyncio.Event, delay: float) -> None:
        """Sleep until `event` is set (after the batching pause), or `delay` passes."""
        batch = self.batch_seconds(policy)
        await asyncio.sleep(min(batch, delay))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, delay - batch))
