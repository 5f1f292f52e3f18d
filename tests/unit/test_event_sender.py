"""controller/event_sender.py: Events posted off the plan's path, in order, bounded, surviving failures."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client import REGISTRY

from proxyshift.controller.event_sender import EventSender
from proxyshift.controller.executor import Executor

pytestmark = pytest.mark.unit


def _dropped() -> float:
    return REGISTRY.get_sample_value("proxyshift_events_dropped_total") or 0.0


def test_events_are_posted_in_the_order_they_were_sent() -> None:
    posted: list[str] = []
    sender = EventSender(lambda **e: posted.append(e["reason"]))
    for i in range(50):
        sender.send(reason=f"r{i}", name="n1")
    assert sender.wait_sent(5.0)
    assert posted == [f"r{i}" for i in range(50)]
    sender.close()


def test_a_send_returns_while_the_api_server_is_slow_and_the_overflow_is_dropped_and_counted() -> None:
    release, posted = threading.Event(), []

    def slow(**event: Any) -> None:
        release.wait(5.0)
        posted.append(event["reason"])

    sender = EventSender(slow, limit=3)
    before = _dropped()
    sender.send(reason="first", name="n1")  # taken by the thread, which waits in the POST
    assert not sender.wait_sent(0.2)
    for reason in ("a", "b", "c", "d", "e"):  # three wait, two are beyond the bound
        sender.send(reason=reason, name="n1")
    assert _dropped() - before == 2
    release.set()
    assert sender.wait_sent(5.0)
    assert posted == ["first", "a", "b", "c"]
    sender.close()


def test_a_failing_post_does_not_stop_the_ones_after_it() -> None:
    posted: list[str] = []

    def flaky(**event: Any) -> None:
        if event["reason"] == "bad":
            raise RuntimeError("connection reset")
        posted.append(event["reason"])

    sender = EventSender(flaky)
    for reason in ("one", "bad", "two"):
        sender.send(reason=reason, name="n1")
    assert sender.wait_sent(5.0)
    assert posted == ["one", "two"]
    sender.close()


class RecordingAPI:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def emit_event(self, **event: Any) -> None:
        self.events.append((event["kind"], event["reason"]))


def test_the_executor_hands_its_events_to_the_sender_and_posts_inline_without_one() -> None:
    api = RecordingAPI()
    queued: list[dict[str, Any]] = []
    sender = EventSender(lambda **e: queued.append(e))
    with_sender = Executor(api, events=sender)  # type: ignore[arg-type]  # the API's emit_event is all it uses here
    with_sender._emit("n1", None, "Switching", "label moved", "Normal", {})
    assert sender.wait_sent(5.0)
    assert api.events == [] and [e["reason"] for e in queued] == ["Switching"]
    inline = Executor(api)  # type: ignore[arg-type]  # as above
    inline._emit("n1", None, "Switching", "label moved", "Normal", {})
    assert api.events == [("Node", "Switching")]
    sender.close()
