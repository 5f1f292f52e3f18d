"""Fresh network namespaces for the agent's dataplane tests, always deleted afterwards; the built Cilium agent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from localcluster import cilium, gotools
from tests.support.ps_netns import need_root, netns, netns_factory

__all__ = ["agent_binary", "netns", "netns_factory"]


@pytest.fixture
def agent_binary() -> Path:
    """The pinned Cilium agent (the Go tool cilium-agent) and bpftool, which the Cilium tests need."""
    need_root()
    binary = gotools.built(cilium.AGENT_TOOL)
    if binary is None:
        pytest.fail(gotools.build_hint(cilium.AGENT_TOOL))
    if shutil.which("bpftool") is None:
        pytest.fail("bpftool is missing: run hack/install-deps.sh (make setup)")
    return binary
