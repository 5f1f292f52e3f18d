"""A move to ipvs and a user's IPVS virtual servers: an ipvs kube-proxy deletes, at every sync, each virtual server
of its family it did not create unless the address is in ipvs.excludeCIDRs (v1.37 cleanLegacyService, found by the
guest's staged rollout). Preflight refuses such a node unless the policy excludes the address or accepts the loss;
`plan` says so beforehand (no host tools, no IPVS)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_foreign_ipvs import USER_VS, _with_inventory, holding, on_ipvs_kernel
from test_machine import REV, inp, operation_of
from test_plan_compat import CM, DS, policy

from proxyshift.agent.flush.ipvs import VirtualServer
from proxyshift.agent.preflight import PreflightReport
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ForeignIPVS, PreflightParams, ProxyNode
from proxyshift.controller import plan_view, snapshot
from proxyshift.modes import described_address, outside_exclude_cidrs
from proxyshift.planner import machine
from proxyshift.planner.compat import compatibility
from proxyshift.planner.machine import Target
from proxyshift.planner.preview import predict_preflight, preflight_notes

pytestmark = pytest.mark.unit

FWM_VS = VirtualServer("fwmark", None, None, 7, "-f 7", "sh")
V6_VS = VirtualServer("tcp", "fd00::5", 443, None, "-t [fd00::5]:443", "rr")


def foreign_problems(pn: ProxyNode | None, p: ProxyPolicy) -> list[str]:
    return [t for t in predict_preflight(pn, p) if "IPVS virtual server" in t]


def ipvs_check(**kw: Any) -> PreflightReport:
    return on_ipvs_kernel("ipvs", **kw)


def test_an_address_is_deleted_unless_an_exclude_cidr_holds_it() -> None:
    assert outside_exclude_cidrs("198.18.5.1", [])
    assert not outside_exclude_cidrs("198.18.5.1", ["198.18.5.0/24"])
    assert not outside_exclude_cidrs("198.18.5.1", ["10.0.0.0/8", "198.18.5.1/32"])
    assert outside_exclude_cidrs("198.18.6.1", ["198.18.5.0/24"])
    assert outside_exclude_cidrs("fd00::5", ["198.18.0.0/15"])
    assert not outside_exclude_cidrs("fd00::5", ["fd00::/64"])
    # A firewall-mark service has no address: kube-proxy skips it. A CIDR that does not parse protects nothing.
    assert not outside_exclude_cidrs(None, [])
    assert outside_exclude_cidrs("198.18.5.1", ["not-a-cidr"])


def test_the_status_text_of_a_virtual_server_gives_its_address_back() -> None:
    for vs in (USER_VS, V6_VS, FWM_VS):
        assert described_address(vs.describe()) == vs.address
    assert described_address("nonsense") is None


def test_preflight_for_ipvs_refuses_a_users_virtual_server_outside_exclude_cidrs_naming_the_fix() -> None:
    report = ipvs_check(ipvs_inventory=holding(USER_VS, FWM_VS), ipvs_exclude_cidrs=[])
    assert not report.ok
    assert report.foreign_ipvs == ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])
    message = report.message()
    assert "this node holds 1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr)" in message
    assert "cleanLegacyService" in message and "ipvs.excludeCIDRs" in message
    assert "add their addresses to the policy's spec.ipvs.excludeCIDRs" in message
    assert "allowChanges: [ForeignIPVSFlush]" in message


def test_preflight_for_ipvs_passes_when_the_address_is_excluded_or_the_loss_accepted() -> None:
    excluded = ipvs_check(ipvs_inventory=holding(USER_VS), ipvs_exclude_cidrs=["198.18.5.0/24"])
    assert excluded.ok, excluded.message()
    assert excluded.foreign_ipvs == ForeignIPVS(count=0, virtual_servers=[])
    accepted = ipvs_check(ipvs_inventory=holding(USER_VS), ipvs_exclude_cidrs=[],
                          allow_changes=["ForeignIPVSFlush"])
    assert accepted.ok and accepted.foreign_ipvs_accepted
    assert "ForeignIPVSFlush accepted: the switch deletes 1 IPVS virtual server" in accepted.message()


def test_an_operator_that_sends_no_exclude_cidrs_gets_the_old_behaviour() -> None:
    # None: an operator older than the field. The agent cannot know the revision's excludeCIDRs, so it does not
    # refuse on a guess; the ipvs inventory is not even read.
    def unread() -> None:
        raise AssertionError("the IPVS table was read")

    report = ipvs_check(ipvs_inventory=unread)
    assert report.ok and report.foreign_ipvs is None


def test_the_operator_sends_the_revisions_exclude_cidrs_only_with_a_preflight_for_ipvs() -> None:
    node = dataclasses.replace(inp(), ipvs_exclude_cidrs=("198.18.5.0/24",))
    step = machine.start(node, Target(REV, "ipvs"), from_mode="iptables", generation=1, retry_token=None)
    params = operation_of(step).params
    assert params["ipvsExcludeCIDRs"] == ["198.18.5.0/24"]
    assert PreflightParams.model_validate(params).ipvs_exclude_cidrs == ["198.18.5.0/24"]
    empty = dataclasses.replace(inp(), ipvs_exclude_cidrs=())
    step = machine.start(empty, Target(REV, "ipvs"), from_mode="iptables", generation=1, retry_token=None)
    assert operation_of(step).params["ipvsExcludeCIDRs"] == []
    to_nftables = dataclasses.replace(inp(), ipvs_exclude_cidrs=("198.18.5.0/24",))
    step = machine.start(to_nftables, Target(REV, "nftables"), from_mode="ipvs", generation=1, retry_token=None)
    assert "ipvsExcludeCIDRs" not in operation_of(step).params


def test_the_rendered_revision_carries_the_policys_exclude_cidrs() -> None:
    p = policy(mode="ipvs", ipvs={"excludeCIDRs": ["198.18.5.0/24"]})
    targets, errors = snapshot.current_revisions({"blue": p}, CM, DS)
    assert not errors
    assert targets["blue"].ipvs_exclude_cidrs == ("198.18.5.0/24",)
    plain, _ = snapshot.current_revisions({"blue": policy(mode="ipvs")}, CM, DS)
    assert plain["blue"].ipvs_exclude_cidrs == ()


def test_plan_for_ipvs_names_a_node_whose_virtual_server_the_ipvs_kube_proxy_would_delete() -> None:
    held = {"n1": ForeignIPVS(count=2, virtual_servers=["TCP 198.18.5.1:80 rr", "FWM 7 sh"])}
    p = policy(mode="ipvs")
    wld = _with_inventory(p, held)
    # The fixture's inventory has no ipset and no IPVS modules: preflight names those too; only ours is looked at.
    problems = [t for t in predict_preflight(wld.proxynodes["n1"], p) if "IPVS virtual server" in t]
    assert problems == ["1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr): an ipvs kube-proxy "
                        "deletes, at every sync, each IPVS virtual server of its IP family that it did not create "
                        "and whose address is not in ipvs.excludeCIDRs (kube-proxy 1.37 cleanLegacyService); add "
                        "their addresses to spec.ipvs.excludeCIDRs or accept it with gate.behaviour.allowChanges: "
                        "[ForeignIPVSFlush]"]
    assert not foreign_problems(wld.proxynodes["n2"], p)
    n1 = next(line for line in plan_view.render_preview(p, wld).splitlines() if line.strip().startswith("n1 "))
    assert "WILL FAIL PREFLIGHT: " in n1 and "1 IPVS virtual server that is not kube-proxy's" in n1

    excluded = policy(mode="ipvs", ipvs={"excludeCIDRs": ["198.18.5.1/32"]})
    assert not foreign_problems(_with_inventory(excluded, held).proxynodes["n1"], excluded)
    accepted = policy(mode="ipvs", gate={"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}})
    wld = _with_inventory(accepted, held)
    assert not foreign_problems(wld.proxynodes["n1"], accepted)
    assert preflight_notes(wld.proxynodes["n1"], accepted) == [
        "ForeignIPVSFlush accepted: the ipvs kube-proxy deletes 1 IPVS virtual server that is not kube-proxy's "
        "(TCP 198.18.5.1:80 rr) at its first sync"]


def test_the_compatibility_report_of_a_move_into_ipvs_names_exclude_cidrs() -> None:
    into = [f for f in compatibility("iptables", None, "ipvs", None, [], []) if f.change == "ForeignIPVSFlush"]
    assert len(into) == 1 and into[0].preserving == "ipvs.excludeCIDRs"
    assert "unless its address is in ipvs.excludeCIDRs" in into[0].summary
    within = [f for f in compatibility("ipvs", None, "ipvs", None, [], []) if f.change == "ForeignIPVSFlush"]
    assert within == []
