"""Fixtures for the tests that run inside the QEMU guest (marker vm_guest): the dataplane's namespaces."""

from __future__ import annotations

from tests.support.ps_netns import netns, netns_factory

__all__ = ["netns", "netns_factory"]
