"""Polling until something holds, for tests and their helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll until predicate() is truthy and return it; fail with `what` and the last value (or the last
    exception it raised) otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except Exception as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)
