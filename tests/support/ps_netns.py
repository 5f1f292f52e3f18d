"""Throwaway network namespaces for the agent's dataplane tests and the flush benchmark."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
from collections.abc import Callable, Iterator

import pytest

from proxyshift.commands import run


def need_root() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("dataplane tests need root and iproute2")


class Netns:
    """One throwaway namespace; `run` executes a command inside it."""

    def __init__(self) -> None:
        self.name = f"ps-test-{secrets.token_hex(4)}"
        run(["ip", "netns", "add", self.name])
        self.run = functools.partial(run, netns=self.name)

    def delete(self) -> None:
        run(["ip", "netns", "del", self.name], check=False)

    def restore(self, text: str, *, v6: bool = False) -> None:
        self.run(["ip6tables-restore" if v6 else "iptables-restore", "--noflush"], input=text, timeout=300)

    def save(self, *, v6: bool = False) -> str:
        return self.run(["ip6tables-save" if v6 else "iptables-save"], timeout=120).stdout


@pytest.fixture
def netns() -> Iterator[Netns]:
    """A fresh namespace, always deleted afterwards (a conftest imports this fixture)."""
    need_root()
    ns = Netns()
    try:
        yield ns
    finally:
        ns.delete()


@pytest.fixture
def netns_factory() -> Iterator[Callable[[], Netns]]:
    """Several namespaces (e.g. a reference one holding only the user's rules), all deleted afterwards."""
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
