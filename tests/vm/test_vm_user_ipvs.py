"""A user's own IPVS virtual server on a node in the QEMU guest survives iptables -> ipvs and ipvs -> iptables,
then stops the move to nftables until the policy accepts its deletion.

An ipvs kube-proxy deletes, at every sync, each IPVS virtual server of its address family that it
did not create, unless the address is in its `ipvs.excludeCIDRs` (v1.37 pkg/proxy/ipvs/proxier.go
cleanLegacyService; the first run of this test without it saw the user's server gone once the node
ran ipvs). So the policy excludes the user's address, as a user must. An iptables kube-proxy cleans
nothing of IPVS at its start (only an nftables one does: docs/migration-guide.md, ForeignIPVSFlush),
so after the move back to iptables the agent's own ipvs flush is what removes kube-proxy's virtual
servers, kube-ipvs0 and KUBE-* ipsets, and it must leave the user's virtual server and its real server
exactly as `ipvsadm -Sn` showed them.

Every start of an nftables kube-proxy deletes every IPVS virtual server (v1.37 platformCleanup), so the
move to nftables is refused at preflight with the node untouched while the user's server is there; with
`gate.behaviour.allowChanges: [ForeignIPVSFlush]` and a retry it goes through, and the user is told in a
Warning Event and the node's migration record what was deleted. Same layout as test_vm_staged_rollout.py
(localcluster.vmnodes), in one guest boot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vm_layer import VM_USER_IPVS_SUMMARY_KEY
from vm_node_checks import Stages, agent_leftovers, guest_cluster, ipvs_services, left, links, observed_mode, proxy_mode

from localcluster import network
from localcluster.vmnodes import VmNodes
from proxyshift.planner.world import RETRY_ANNOTATION
from tests.support.operator_harness import REVISION_LABEL, Harness, migration, policy

pytestmark = pytest.mark.vm

VM_POOL = "vm"
POLICY = "vm-user-ipvs"
STAGE_TIMEOUT = 600.0
NODE_UP_TIMEOUT = 300.0
# A hand-made LVS: an address no one in the local cluster has, one real server (an endpoint's listener).
USER_VS = ("198.18.5.1:80", "198.18.1.1:8080")
USER_LINES = [f"-A -t {USER_VS[0]} -s rr", f"-a -t {USER_VS[0]} -r {USER_VS[1]} -m -w 1"]


def _user_lines(guest: VmNodes, node: str) -> list[str]:
    out = guest.exec(node, ["ipvsadm", "-Sn"]).stdout
    return [line.strip() for line in out.splitlines() if f" {USER_VS[0]} " in f"{line.strip()} "]


@pytest.mark.timeout(1800)
def test_users_ipvs_virtual_server_through_iptables_ipvs_iptables_and_to_nftables_in_the_guest(
        cluster: Any, harness: Harness, test_service: Any, wait_for: Callable[..., Any],
        request: pytest.FixtureRequest) -> None:
    h = harness
    info, index = guest_cluster(cluster)
    node = network.node_name(index)
    ip, port = test_service.cluster_ip, test_service.port
    run = Stages(h, POLICY, STAGE_TIMEOUT, "vm user ipvs", request)

    with VmNodes(info, [(index, VM_POOL)]) as guest:
        run.timings["guest up"] = guest.boot_seconds
        wait_for(lambda: observed_mode(h, node) == "iptables", NODE_UP_TIMEOUT, f"{node}'s agent to report iptables")
        wait_for(lambda: guest.tcp_probe(node, ip, port, 1).failed == 0, NODE_UP_TIMEOUT,
                 f"{ip}:{port} to answer from {node}")
        guest.exec(node, ["ipvsadm", "-A", "-t", USER_VS[0], "-s", "rr"])
        guest.exec(node, ["ipvsadm", "-a", "-t", USER_VS[0], "-r", USER_VS[1], "-m", "-w", "1"])
        assert _user_lines(guest, node) == USER_LINES
        run.say(f"{node} ready on iptables with a user's IPVS virtual server {USER_VS[0]} -> {USER_VS[1]}")

        run.stage("iptables -> ipvs", lambda: h.apply(policy(
            POLICY, "ipvs", pool=VM_POOL, ipvs={"scheduler": "rr", "excludeCIDRs": [f"{USER_VS[0].split(':')[0]}/32"]},
            rollout={"maxUnavailable": 1},
            gate={"timeout": "5m", "minSyncs": 1, "behaviour": {"budgetSeconds": 10}}, deletionPolicy="Orphan")))
        assert proxy_mode(guest, node) == "ipvs"
        assert _user_lines(guest, node) == USER_LINES, "the user's virtual server changed"
        services = ipvs_services(guest, node)
        assert any(f" {ip}:{port} " in f"{s} " for s in services), f"kube-proxy's virtual servers: {services}"
        foreign = ((h.proxynodes()[node].get("status") or {}).get("foreignIPVS") or {})
        assert foreign.get("count") == 1 and any(USER_VS[0] in v for v in foreign.get("virtualServers") or []), \
            foreign
        assert left(guest, node, "ipvs") == {}, "iptables mode's objects left"

        run.stage("ipvs -> iptables", lambda: h.patch(POLICY, {"spec": {"mode": "iptables", "ipvs": None}}))
        assert proxy_mode(guest, node) == "iptables"
        assert _user_lines(guest, node) == USER_LINES, "the user's virtual server changed"
        # kube-proxy's ipvs objects are gone (the agent's flush: an iptables kube-proxy cleans none of them),
        # the user's virtual server is the only one left.
        assert left(guest, node, "iptables", users=[USER_LINES[0]]) == {}, "ipvs mode's objects left"
        assert ipvs_services(guest, node) == [USER_LINES[0]]
        assert "kube-ipvs0" not in links(guest, node)
        assert agent_leftovers(h, node) == []
        iptables_revision = h.node_labels(node).get(REVISION_LABEL)

        # To nftables: refused at preflight, naming the user's server; nothing on the node changes.
        run.stage("iptables -> nftables refused", lambda: h.patch(POLICY, {"spec": {"mode": "nftables"}}),
                  until="Degraded", wait=lambda: h.wait_condition(POLICY, "Degraded", STAGE_TIMEOUT))
        refused = migration(h.proxynodes()[node])
        assert (refused.get("phase"), refused.get("reason")) == ("Failed", "PreflightFailed"), refused
        assert USER_VS[0] in (refused.get("message") or ""), refused
        assert proxy_mode(guest, node) == "iptables" and _user_lines(guest, node) == USER_LINES
        assert h.node_labels(node).get(REVISION_LABEL) == iptables_revision, "the node was switched"
        run.say(f"to nftables refused at preflight: {refused.get('message')}")

        # Accepted by name, retried: switched, the user's server deleted by kube-proxy, the user told. The
        # retry's first status may still say Degraded, so the stage waits for Ready itself, not wait_ready.
        run.stage("iptables -> nftables accepted",
                  lambda: h.patch(POLICY, {"metadata": {"annotations": {RETRY_ANNOTATION: "foreign-ipvs"}},
                                           "spec": {"gate": {"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}}}}),
                  wait=lambda: h.wait_condition(POLICY, "Ready", STAGE_TIMEOUT))
        assert proxy_mode(guest, node) == "nftables"
        assert _user_lines(guest, node) == [] and ipvs_services(guest, node) == []
        done = migration(h.proxynodes()[node])
        assert any(USER_VS[0] in v for v in done.get("foreignIPVSFlushed") or []), done
        told = [e for e in h.core.list_event_for_all_namespaces(
                    field_selector="reason=ForeignIPVSFlush").items
                if e.involved_object.name == node and e.type == "Warning"]
        assert any(USER_VS[0] in (e.message or "") for e in told), [e.message for e in told]
        assert left(guest, node, "nftables") == {}, "iptables or ipvs mode's objects left"
        assert agent_leftovers(h, node) == []
    total = run.elapsed()
    summary = (f"a user's IPVS virtual server through iptables -> ipvs -> iptables -> nftables (refused, then "
               f"accepted) on {node} in the guest: "
               f"{total:.0f} s (" + run.summary() + ")")
    request.config.stash[VM_USER_IPVS_SUMMARY_KEY] = summary
    run.say(summary)
