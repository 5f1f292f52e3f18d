"""Fixtures for the tests that run inside the QEMU guest (marker vm_guest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ps_netns import Netns


@pytest.fixture
def netns() -> Iterator[Netns]:
    ns = Netns()
    try:
        yield ns
    finally:
        ns.delete()


@pytest.fixture
def netns_factory() -> Iterator:
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
