"""Fresh network namespaces for the agent's dataplane tests, always deleted afterwards."""

from __future__ import annotations

from tests.support.ps_netns import netns, netns_factory

__all__ = ["netns", "netns_factory"]
