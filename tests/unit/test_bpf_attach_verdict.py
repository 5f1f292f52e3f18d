"""tests/support/bpf_attach.reached_the_host: the verdict the Cilium e2e tests share, on made-up snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bpf_attach import reached_the_host, socket_lb_at

pytestmark = pytest.mark.unit

ROOT = Path("/sys/fs/cgroup/unified")
NODE_1, NODE_2, NODE_3 = (ROOT / f"proxyshift-cilium-ps-node-{i}" for i in (1, 2, 3))
SOCK = {"id": 7, "attach_type": "cgroup_inet4_connect", "name": "cil_sock4_connect"}


def snapshot(cgroups: dict[str, list[dict[str, object]]] | None = None, **rest: object) -> dict[str, object]:
    return {"cgroups": cgroups or {}, "root_cgroup": {}, "net": [{"xdp": [], "tc": [], "flow_dissector": []}],
            "tcx": {}, **rest}


def test_socket_lb_at_the_allowed_nodes_is_not_the_host() -> None:
    during = snapshot({str(NODE_1): [SOCK], f"{NODE_2}/pod": [SOCK]})
    assert reached_the_host(snapshot(), during, ROOT, [NODE_1, NODE_2]) == []
    assert socket_lb_at(during, NODE_1) and not socket_lb_at(during, NODE_3)


def test_another_node_the_root_cgroup_and_the_host_netns_are() -> None:
    during = snapshot({str(NODE_3): [SOCK], str(ROOT): [SOCK]}, root_cgroup={4: [7]}, tcx={"eth0/ingress": [9]},
                      net=[{"xdp": [], "tc": [{"devname": "eth0", "id": 9}], "flow_dissector": []}])
    reached = reached_the_host(snapshot(), during, ROOT, [NODE_1])
    assert len(reached) == 5, reached
    assert any(str(NODE_3) in line for line in reached) and any("root cgroup" in line for line in reached)


def test_a_foreign_confined_agent_is_not_the_host_but_a_host_cgroup_is() -> None:
    foreign = str(ROOT / "proxyshift-cilium-ps-dp-node")  # a dataplane test's agent, not the cluster's
    assert reached_the_host(snapshot(), snapshot({foreign: [SOCK]}), ROOT, [NODE_1]) == []
    assert reached_the_host(snapshot(), snapshot({str(ROOT / "system.slice"): [SOCK]}), ROOT, [NODE_1]) != []


def test_what_was_there_before_and_stays_is_not_a_finding() -> None:
    host = snapshot({str(ROOT / "system.slice"): [{"id": 3, "attach_type": "cgroup_device", "name": "sd_devices"}]})
    assert reached_the_host(host, host, ROOT, [NODE_1]) == []
