"""Fresh network namespaces for the agent's dataplane tests, always deleted afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ps_netns import Netns, need_root


@pytest.fixture
def netns() -> Iterator[Netns]:
    need_root()
    ns = Netns()
    try:
        yield ns
    finally:
        ns.delete()


@pytest.fixture
def netns_factory() -> Iterator:
    """Several namespaces (e.g. a reference one holding only the user's rules)."""
    need_root()
    made: list[Netns] = []

    def make() -> Netns:
        ns = Netns()
        made.append(ns)
        return ns

    try:
        yield make
    finally:
        for ns in made:
            ns.delete()
