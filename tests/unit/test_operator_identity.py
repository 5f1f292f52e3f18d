"""The operator starts as a uid with no passwd entry, as the image's 65532 runs (found by the simulator)."""

from __future__ import annotations

import getpass
import os

import pytest

from proxyshift.controller import main

pytestmark = pytest.mark.unit


def test_a_uid_without_a_passwd_entry_gets_an_identity_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_entry() -> str:
        raise KeyError(f"getpwuid(): uid not found: {os.getuid()}")

    monkeypatch.delenv("POD_ID", raising=False)
    monkeypatch.setattr(getpass, "getuser", no_entry)
    identity = main.peering_identity()
    assert identity is not None and identity.startswith(f"uid{os.getuid()}@")
    assert identity != main.peering_identity()  # two replicas on one host still differ


def test_kopf_names_itself_when_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "someone")
    monkeypatch.delenv("POD_ID", raising=False)
    assert main.peering_identity() is None
    monkeypatch.setenv("POD_ID", "proxyshift-operator-abc")
    assert main.peering_identity() is None
