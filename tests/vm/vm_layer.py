"""Names the vm layer's host side and conftest share."""

from __future__ import annotations

import os

import pytest

IN_GUEST_ENV = "PROXYSHIFT_IN_VM"
VM_SUMMARY_KEY = pytest.StashKey[str]()
VM_E2E_SUMMARY_KEY = pytest.StashKey[str]()  # the staged rollout with a node in the guest
VM_USER_IPVS_SUMMARY_KEY = pytest.StashKey[str]()  # a user's virtual server through iptables -> ipvs -> iptables


def in_guest() -> bool:
    return os.environ.get(IN_GUEST_ENV) == "1"
