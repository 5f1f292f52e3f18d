"""Events posted from one background thread, in order, so that no step of a plan waits on them.

An Event is a courtesy (ClusterAPI.emit_event never fails a step): posted inline, the two POSTs of a node's
step Event (on the node and on its policy) held up the plan that wrote the step, and with it the next
node's switch, which a late slot grant runs after every other node's actions (Plan.after_others), and the
next plan, which waits for this one: 40-60 ms per node on the rollout bench. The queue is bounded: while the
API server does not answer, Events beyond `limit` are dropped and counted, never held in memory.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxyshift.controller import metrics

log = logging.getLogger("proxyshift.operator")

QUEUE_LIMIT = 1000  # Events waiting at most; a rollout step makes at most four
CLOSE_WAIT_SECONDS = 2.0  # how long a stopping operator lets queued Events go out


@dataclass
class EventSender:
    """`send(**event)` queues a call of `post(**event)`; one daemon thread posts them in order."""

    post: Callable[..., None]
    limit: int = QUEUE_LIMIT
    _queue: queue.Queue[dict[str, Any] | None] = field(init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue(maxsize=self.limit)

    def send(self, **event: Any) -> None:
        self._start()
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            metrics.EVENTS_DROPPED.inc()
            log.warning("event %s on %s dropped: %d events wait for the API server", event.get("reason"),
                        event.get("name"), self.limit)

    def wait_sent(self, timeout: float) -> bool:
        """Whether every Event queued so far was posted (or given up) within `timeout` seconds."""
        done = threading.Event()

        def join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=join, name="events-wait", daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """Let what is queued go out for at most `timeout` seconds, then stop the thread."""
        if self._thread is None:
            return
        self.wait_sent(timeout)
        # Full: the thread is stuck on an API server that does not answer; it is a daemon and goes with us.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread = None

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                self.post(**event)
            except Exception:  # posting is best effort; the thread must outlive any one failure
                log.exception("posting event %s failed", event and event.get("reason"))
            finally:
                self._queue.task_done()
