"""What the tests with local-cluster nodes in the QEMU guest read inside those nodes and from the operator
(test_vm_staged_rollout.py, test_vm_user_ipvs.py): kube-proxy's mode, chains, IPVS table, ipsets, links,
what kube-proxy left of the modes a node left, and the policy's progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pytest

from localcluster import controlplane, network
from localcluster.controlplane import ClusterInfo
from localcluster.vmnodes import VmNodes
from proxyshift.api.proxynode import Mode
from proxyshift.modes import MODE_FACTS
from tests.support.operator_harness import Harness


def proxy_mode(guest: VmNodes, node: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            status, body = guest.http_get(node, "http://127.0.0.1:10249/proxyMode")
            if status == 200:
                return body.strip()
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"kube-proxy on {node} does not answer /proxyMode")
        time.sleep(1)


def chains(guest: VmNodes, node: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    table = ""
    for line in guest.exec(node, ["iptables-save"]).stdout.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith(":"):
            found.add((table, line[1:].split()[0]))
    return found


def ipvs_services(guest: VmNodes, node: str) -> list[str]:
    """`ipvsadm -Sn`'s virtual server lines (-A), e.g. `-A -t 198.19.0.10:80 -s rr`."""
    out = guest.exec(node, ["ipvsadm", "-Sn"]).stdout
    return [line for line in out.splitlines() if line.startswith("-A ")]


def ipsets(guest: VmNodes, node: str) -> set[str]:
    return set(guest.exec(node, ["ipset", "list", "-n"]).stdout.split())


def links(guest: VmNodes, node: str) -> set[str]:
    out = guest.exec(node, ["ip", "-o", "link", "show"]).stdout
    return {line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line}


def left(guest: VmNodes, node: str, mode: Mode, *, users: Collection[str] = ()) -> dict[str, Any]:
    """What of kube-proxy's objects for modes other than `mode` is still on the node (empty: nothing).

    `users`: a user's own IPVS virtual servers (`-A` lines of `ipvsadm -Sn`), not kube-proxy's."""
    owned_now = MODE_FACTS[mode].owned
    others = [MODE_FACTS[m].owned for m in MODE_FACTS if m != mode]
    present = chains(guest, node)
    stale_chains = sorted(
        c for c in present if c not in owned_now.chains and (
            any(c in o.chains for o in others) or
            any(c[1].startswith(p) for o in others for p in o.service_chain_prefixes
                if p not in owned_now.service_chain_prefixes)))
    found: dict[str, Any] = {}
    if stale_chains:
        found["chains"] = stale_chains
    held = sorted(c for _, c in present if c.startswith("PSHOLD-"))
    if held:
        found["rule hold chains"] = held
    ipvs_owned = MODE_FACTS["ipvs"].owned
    if mode != "ipvs":
        if ipvs_owned.interface in links(guest, node):
            found["interface"] = ipvs_owned.interface
        sets = sorted(s for s in ipsets(guest, node) if s.startswith("KUBE-"))
        if sets:
            found["ipsets"] = sets
        services = [v for v in ipvs_services(guest, node) if v not in users]
        if services:
            found["ipvs virtual servers"] = services
    return found


def agent_leftovers(h: Harness, node: str) -> list[str]:
    return list(((h.proxynodes().get(node) or {}).get("status") or {}).get("leftovers") or [])


def observed_mode(h: Harness, node: str) -> str | None:
    return ((h.proxynodes().get(node) or {}).get("status") or {}).get("observedMode")


def wait_ready(h: Harness, name: str, timeout: float) -> None:
    """Ready for the policy's current generation; fails at once when it turns Degraded instead."""
    deadline = time.monotonic() + timeout
    while True:
        body = h.get(name) or {}
        status = body.get("status") or {}
        if status.get("observedGeneration") == body.get("metadata", {}).get("generation"):
            conditions = {c.get("type"): c for c in status.get("conditions") or []}
            if (conditions.get("Ready") or {}).get("status") == "True":
                return
            if (conditions.get("Degraded") or {}).get("status") == "True":
                pytest.fail(f"{name} is Degraded: {conditions['Degraded'].get('message')}\n{h.describe(name)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{name} not Ready within {timeout:g}s\n{h.describe(name)}")
        time.sleep(2)


@dataclass
class Stages:
    """A guest e2e's progress lines (past pytest's capture: the run takes minutes) and its stages, each timed
    from its change to the policy's Ready."""

    h: Harness
    policy: str
    timeout: float
    tag: str
    request: pytest.FixtureRequest
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        capture = self.request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"[{self.tag}] {self.elapsed():6.1f}s {message}", file=sys.stderr, flush=True)

    def stage(self, what: str, change: Callable[[], Any], *, until: str = "Ready",
              wait: Callable[[], Any] | None = None) -> None:
        """Make `change` and time it to the policy's `until`: by default wait_ready (Ready for the current
        generation, failing at once when it turns Degraded); `wait` waits for any other end."""
        stage_start = time.monotonic()
        change()
        if wait is None:
            wait_ready(self.h, self.policy, self.timeout)
        else:
            wait()
        self.timings[what] = time.monotonic() - stage_start
        self.say(f"{what}: {self.policy} {until} after {self.timings[what]:.0f}s")

    def summary(self) -> str:
        """Each timing, in the order taken."""
        return ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items())


def guest_cluster(cluster: Any) -> tuple[ClusterInfo, int]:
    """The local control plane a guest's nodes join, and the first node index free for them (after the
    host's nodes)."""
    info = controlplane.load_info(cluster.require_local("nodes in the QEMU guest"))
    assert info is not None
    return info, max(network.node_indices()) + 1
