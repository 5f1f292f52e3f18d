"""A mirror tells when it reached the API server again after it could not (planner World.api_back_at)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest
import urllib3

from proxyshift.controller.fleet import Fleet
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.wakeups import Wakers

pytestmark = pytest.mark.unit


class _Answer:
    def __init__(self, body: dict[str, Any] | None = None) -> None:
        self.data = json.dumps(body).encode() if body is not None else b""

    def stream(self, **_: Any) -> list[bytes]:
        return []  # a watch the server ended cleanly (its timeout)

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def _fake_api(script: list[str]) -> Mirror:
    """A mirror over an API class as the mirror builds it (constructed with a client) that follows `script`:
    list-ok, list-refused, watch-ends (cleanly), watch-broken; when the script is done, the mirror stops."""

    class FakeApi:
        def __init__(self, _client: Any = None) -> None:
            pass

        def list_things(self, **kwargs: Any) -> _Answer:
            step = script.pop(0) if script else "done"
            if step == "done":
                mirror.stop()
            elif step == "list-refused":
                raise urllib3.exceptions.MaxRetryError(None, "/things", "Connection refused")  # type: ignore[arg-type]  # no pool: the code reads only the reason
            elif step == "watch-broken":
                raise urllib3.exceptions.ProtocolError("Response ended prematurely")
            assert step.startswith("watch") == bool(kwargs.get("watch")) or step == "done", (step, kwargs)
            if kwargs.get("watch"):
                return _Answer()
            return _Answer({"metadata": {"resourceVersion": "5"}, "items": [{"metadata": {"name": "a"}}]})

    mirror = Mirror("things", FakeApi().list_things, lambda obj: (obj["metadata"]["name"], 1), lambda *_: None)
    return mirror


def _run(mirror: Mirror, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("proxyshift.controller.mirror.RETRY_SECONDS", 0.0)

    async def main() -> None:
        mirror.start(asyncio.get_running_loop())
        assert mirror._thread is not None
        await asyncio.to_thread(mirror._thread.join, 10)
        await asyncio.sleep(0)  # what the thread posted runs now

    asyncio.run(main())


def test_a_list_after_the_api_server_was_unreachable_records_the_reconnection(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    before = datetime.now(UTC)
    mirror = _fake_api(["list-ok", "watch-broken", "list-refused", "list-refused", "list-ok"])
    _run(mirror, monkeypatch)
    assert mirror.reconnected_at is not None and mirror.reconnected_at >= before
    assert mirror.items == {"a": 1}


def test_a_mirror_that_never_lost_the_api_server_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = _fake_api(["list-ok", "watch-ends", "watch-ends"])  # a watch that ends is renewed: no outage
    _run(mirror, monkeypatch)
    assert mirror.reconnected_at is None


def test_the_fleet_view_carries_the_latest_reconnection() -> None:
    fleet = Fleet(Wakers())
    for name in ("nodes", "pods", "proxynodes"):
        fleet.mirrors[name] = Mirror(name, list, lambda _: None, lambda *_: None)
    assert fleet.view().api_back_at is None
    early, late = datetime(2026, 12, 1, 12, 0, tzinfo=UTC), datetime(2026, 12, 1, 12, 5, tzinfo=UTC)
    fleet.mirrors["nodes"].reconnected_at, fleet.mirrors["pods"].reconnected_at = early, late
    assert fleet.view().api_back_at == late
