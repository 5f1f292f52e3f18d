"""RFC 3339 timestamps as the API stores them, and the clock arithmetic the planner needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def utc(moment: datetime) -> datetime:
    """Naive datetimes are taken as UTC: the operator and the tests both use UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def fmt(moment: datetime) -> str:
    # Second precision like metav1.Time; truncation only makes "after the switch" checks more lenient.
    return utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return utc(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError:
        return None


def seconds_since(text: str | None, now: datetime) -> float | None:
    moment = parse(text)
    return None if moment is None else (utc(now) - moment).total_seconds()


def remaining(since: str | None, duration: timedelta, now: datetime) -> float:
    """Seconds left until `since + duration` (<= 0 when elapsed; an unknown start counts as elapsed)."""
    start = parse(since)
    if start is None:
        return 0.0
    return (start + duration - utc(now)).total_seconds()
