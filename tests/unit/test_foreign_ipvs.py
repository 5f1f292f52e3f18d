"""IPVS virtual servers that are not kube-proxy's: the inventory's decision, preflight for nftables, the operator's
record of what the switch deletes, and `proxyshift plan`'s list (no host tools, no IPVS)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import pytest
from test_agent_flush_plan import EVIDENCE_DUMMY, EXPECTED_OWNED, IPVSADM, FakeNode
from test_agent_loop import FakeAPI, make_agent, node_obj
from test_machine import REV, done, inp, mig, migration_of, operation_of
from test_plan_compat import policy, world

from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.flush.ipvs import VirtualServer, parse_ipvsadm_save
from proxyshift.agent.inventory import Inventory, foreign_ipvs, leftovers, take_inventory
from proxyshift.agent.preflight import PreflightReport, ToolVersions, check
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ForeignIPVS, Operation, PreflightParams, ProxyNode
from proxyshift.controller import plan_view
from proxyshift.planner import machine
from proxyshift.planner.machine import Target
from proxyshift.planner.preview import foreign_ipvs_nodes, predict_preflight
from proxyshift.planner.world import Event, SetRevisionLabel, World

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GOOD_TOOLS = ToolVersions(nft="1.0.9", iptables="1.8.10", iptables_backend="nf_tables", ipset="7.19",
                          nft_usable=True, iptables_nat=True)
# The fixture's virtual servers kube-proxy did not create: keepalived's VIP and fwmark, a user's on the node
# address, and one on an address no evidence names.
FOREIGN = ["TCP 192.168.10.50:443 wlc", "TCP 172.18.0.2:8443 rr", "FWM 77 rr", "TCP [2001:db8:beef::50]:443 rr"]
USER_VS = VirtualServer("tcp", "198.18.5.1", 80, None, "-t 198.18.5.1:80", "rr")


def ipvs_node(tmp_path: Path) -> Inventory:
    (tmp_path / "net").mkdir(exist_ok=True)
    (tmp_path / "net" / "ip_vs").write_text("")
    return take_inventory(runner=FakeNode(), iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path)


def holding(*vs: VirtualServer) -> Callable[[], Inventory]:
    return lambda: Inventory(ipvs_available=True, virtual_servers=list(vs), foreign_virtual_servers=list(vs))


def on_ipvs_kernel(mode: str, **kw: Any) -> PreflightReport:
    """Preflight on the fixture kernel 6.8 with IPVS built in (/proc/net/ip_vs exists)."""
    return check(mode, proc_root=FIX / "proc" / "ipvs-builtin", sys_root=FIX / "sys" / "ipvs-builtin",
                 modules_root=FIX / "sys" / "ipvs-builtin" / "lib-modules", tools=GOOD_TOOLS, **kw)


def nftables_check(**kw: Any) -> PreflightReport:
    return on_ipvs_kernel("nftables", **kw)


# ---- the decision: the flush's select_owned, and everything it does not claim ----


def test_the_inventory_splits_virtual_servers_by_the_flushs_own_evidence(tmp_path: Path) -> None:
    inv = ipvs_node(tmp_path)
    assert not inv.errors
    assert {vs.key() for vs in inv.kube_virtual_servers} == EXPECTED_OWNED
    assert [vs.describe() for vs in inv.foreign_virtual_servers] == FOREIGN
    # Together they are the whole table, each virtual server exactly once.
    assert len(inv.kube_virtual_servers) + len(inv.foreign_virtual_servers) == len(parse_ipvsadm_save(IPVSADM))
    status = foreign_ipvs(inv)
    assert status.count == 4 and status.virtual_servers == FOREIGN
    # A user's virtual servers are never kube-proxy's leftovers.
    # + kube-ipvs0, the addresses on it and the three KUBE-* sets
    assert inv.count("ipvs") == len(EXPECTED_OWNED) + 1 + len(EVIDENCE_DUMMY) + 3
    assert inv.dummy_address_count == len(EVIDENCE_DUMMY)
    assert "ipvs" in leftovers(inv, "nftables")


def test_the_status_list_is_bounded_and_counts_everything() -> None:
    many = [VirtualServer("tcp", f"198.18.5.{i}", 80, None, f"-t 198.18.5.{i}:80", "rr") for i in range(40)]
    status = foreign_ipvs(Inventory(foreign_virtual_servers=many))
    assert status.count == 40 and len(status.virtual_servers) == 16
    assert status.describe().startswith("40 IPVS virtual servers that are not kube-proxy's (TCP 198.18.5.0:80 rr")
    assert status.describe().endswith("and 35 more)")
    assert ForeignIPVS(count=1, virtual_servers=["FWM 7 sh"]).describe() == \
        "1 IPVS virtual server that is not kube-proxy's (FWM 7 sh)"


def test_describe_reads_like_ipvsadm() -> None:
    parsed = parse_ipvsadm_save("-A -u 198.18.200.1:53 -s rr -p 600\n-A -t [fd00::5]:443 -s mh -b flag-1\n"
                                "-A -f 7 -s sh\n")
    assert [vs.describe() for vs in parsed] == ["UDP 198.18.200.1:53 rr", "TCP [fd00::5]:443 mh", "FWM 7 sh"]


# ---- preflight ----


def test_preflight_for_nftables_refuses_a_users_virtual_server_naming_it(tmp_path: Path) -> None:
    report = nftables_check(ipvs_inventory=holding(USER_VS))
    assert not report.ok
    (refusal,) = report.missing
    assert refusal.what == "IPVS virtual servers that are not kube-proxy's"
    message = report.message()
    assert "1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr)" in message
    assert "every start of an nftables kube-proxy deletes them" in message and "platformCleanup" in message
    assert "gate.behaviour.allowChanges: [ForeignIPVSFlush]" in refusal.fix
    assert report.details()["foreignIPVS"] == {"count": 1, "virtualServers": ["TCP 198.18.5.1:80 rr"],
                                               "accepted": False}


def test_with_foreign_ipvs_flush_accepted_preflight_passes_and_names_what_goes(tmp_path: Path) -> None:
    report = nftables_check(ipvs_inventory=holding(USER_VS), allow_changes=["LocalhostNodePorts",
                                                                                      "ForeignIPVSFlush"])
    assert report.ok, report.message()
    assert report.message().endswith("ForeignIPVSFlush accepted: the switch deletes 1 IPVS virtual server that is "
                                     "not kube-proxy's (TCP 198.18.5.1:80 rr)")
    assert report.details()["foreignIPVS"]["accepted"] is True


def test_only_a_move_to_nftables_looks_at_ipvs_and_only_when_the_kernel_has_it(tmp_path: Path) -> None:
    def never() -> NoReturn:
        raise AssertionError("IPVS read where no kube-proxy would delete anything")

    for mode in ("iptables", "ipvs"):
        report = on_ipvs_kernel(mode, ipvs_inventory=never)
        assert report.ok and report.foreign_ipvs is None
    # No /proc/net/ip_vs: no virtual server can exist, and ipvsadm would load ip_vs just by looking.
    quiet = check("nftables", proc_root=FIX / "proc" / "no-ipvs", sys_root=FIX / "sys" / "no-ipvs",
                  modules_root=FIX / "sys" / "no-ipvs" / "lib-modules", tools=GOOD_TOOLS, ipvs_inventory=never)
    assert quiet.ok and "foreignIPVS" not in quiet.details()
    # Only kube-proxy's virtual servers: nothing to refuse.
    assert nftables_check(ipvs_inventory=lambda: Inventory(ipvs_available=True)).ok


def test_an_unreadable_ipvs_table_is_refused_not_taken_for_empty(tmp_path: Path) -> None:
    unreadable = nftables_check(ipvs_inventory=lambda: Inventory(
        ipvs_available=True, errors=["ipvsadm: ipvsadm is not installed"]))
    assert not unreadable.ok
    assert unreadable.missing[0].what == "a readable IPVS table"
    assert "cannot be told" in unreadable.missing[0].why
    accepted = nftables_check(ipvs_inventory=lambda: Inventory(
        ipvs_available=True, errors=["ipvsadm: ipvsadm is not installed"]), allow_changes=["ForeignIPVSFlush"])
    assert accepted.ok
    assert accepted.message().endswith("ForeignIPVSFlush accepted: the IPVS table could not be read (ipvsadm: "
                                       "ipvsadm is not installed), the switch deletes every virtual server in it")


# ---- operator -> agent: the typed Preflight params ----


def test_the_operator_passes_allow_changes_and_the_agent_hands_them_to_preflight() -> None:
    step = machine.start(inp(gate={"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}}), Target(REV, "nftables"),
                         from_mode="ipvs", generation=1, retry_token=None)
    params = operation_of(step).params
    assert PreflightParams.model_validate(params).allow_changes == ["ForeignIPVSFlush"]
    plain = machine.start(inp(), Target(REV, "nftables"), from_mode="ipvs", generation=1, retry_token=None)
    assert "allowChanges" not in operation_of(plain).params

    seen: dict[str, Any] = {}

    def preflight(mode: str, scheduler: str | None = None, *, allow_changes: list[str],
                  **kw: Any) -> PreflightReport:
        seen.update(kw, allow_changes=allow_changes)
        return on_ipvs_kernel(mode, allow_changes=allow_changes, ipvs_inventory=holding(USER_VS))

    api = FakeAPI(node_obj({"id": "m1.Preflight.0", "type": "Preflight", "params": params | {"newerSetting": 1}}))
    make_agent(api, preflight=preflight).handle(api.get("n1"))
    assert seen["allow_changes"] == ["ForeignIPVSFlush"]
    status = ProxyNode.model_validate(api.obj).status
    assert status.last_operation is not None
    assert status.last_operation.state == "Succeeded", status.last_operation.message
    assert status.foreign_ipvs == ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])


def test_the_heartbeat_reports_foreign_virtual_servers(tmp_path: Path) -> None:
    api = FakeAPI(node_obj())
    agent = make_agent(api, inventory=ipvs_node(tmp_path))
    agent.handle(api.get("n1"))
    agent.tick()
    assert api.obj["status"]["foreignIPVS"] == {"count": 4, "virtualServers": FOREIGN}


# ---- the operator tells what the switch deletes ----


def test_an_accepted_flush_is_recorded_in_the_migration_and_told_in_a_warning_event() -> None:
    m = mig("Preflight", from_mode="ipvs")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    last = done(op, message="preflight for nftables passed", foreignIPVS={
        "count": 3, "virtualServers": ["TCP 198.18.5.1:80 rr", "FWM 7 sh"], "accepted": True})
    step = machine.step(inp(m, op=op, last=last, rollout={"holdRules": False},
                            gate={"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}}))
    assert step.phase == "Switch" and any(isinstance(a, SetRevisionLabel) for a in step.actions)
    assert migration_of(step).foreign_ipvs_flushed == ["TCP 198.18.5.1:80 rr", "FWM 7 sh"]
    (event,) = [a for a in step.actions if isinstance(a, Event) and a.reason == "ForeignIPVSFlush"]
    assert event.type == "Warning"
    assert event.message == ("the switch to nftables deletes IPVS virtual servers that are not kube-proxy's "
                             "(accepted by gate.behaviour.allowChanges): TCP 198.18.5.1:80 rr, FWM 7 sh and 1 more")
    # Cordoned first: the record goes along with the cordon step.
    cordoned = machine.step(inp(m, op=op, last=last, rollout={"cordon": True}))
    assert migration_of(cordoned).foreign_ipvs_flushed == ["TCP 198.18.5.1:80 rr", "FWM 7 sh"]


def test_a_prepared_node_tells_the_accepted_flush_once_when_it_switches() -> None:
    # Waiting for a slot writes nothing, so it tells nothing either (it would repeat at every plan);
    # the switch's write records the flush and its Warning goes with it.
    m = mig("Preflight", from_mode="ipvs")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    last = done(op, message="ok", foreignIPVS={"count": 1, "virtualServers": ["FWM 7 sh"], "accepted": True})
    allow = {"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}}
    waiting = machine.step(dataclasses.replace(inp(m, op=op, last=last, gate=allow), may_switch=False))
    assert waiting.phase == "Prepared" and waiting.actions == []
    granted = machine.step(inp(m, op=op, last=last, gate=allow, rollout={"holdRules": False}))
    assert migration_of(granted).foreign_ipvs_flushed == ["FWM 7 sh"]
    assert [a.reason for a in granted.actions if isinstance(a, Event)].count("ForeignIPVSFlush") == 1


def test_a_refused_node_fails_preflight_untouched_and_nothing_is_recorded_as_flushed() -> None:
    m = mig("Preflight", from_mode="ipvs")
    op = Operation(id=f"{REV}.1.0.Preflight.0", type="Preflight")
    last = done(op, "Failed", "preflight for nftables failed: IPVS virtual servers that are not kube-proxy's",
                foreignIPVS={"count": 1, "virtualServers": ["TCP 198.18.5.1:80 rr"], "accepted": False})
    step = machine.step(inp(m, op=op, last=last))
    assert step.phase == "Failed" and not any(isinstance(a, SetRevisionLabel) for a in step.actions)
    assert migration_of(step).foreign_ipvs_flushed is None
    assert not any(isinstance(a, Event) and a.reason == "ForeignIPVSFlush" for a in step.actions)


# ---- proxyshift plan -f ----


def _with_inventory(p: ProxyPolicy, foreign: dict[str, ForeignIPVS]) -> World:
    wld = world(p)
    for name in wld.nodes:
        wld.proxynodes[name] = ProxyNode.model_validate({"metadata": {"name": name}, "status": {
            "kernelRelease": "6.1.0", "tools": {"nft": "1.0.6", "iptables": "1.8.9"},
            "heartbeat": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}})
        if name in foreign:
            wld.proxynodes[name].status.foreign_ipvs = foreign[name]
    return wld


def test_plan_names_the_nodes_holding_foreign_virtual_servers_and_says_refused() -> None:
    p = policy()
    wld = _with_inventory(p, {"n2": ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])})
    assert [n.node for n in foreign_ipvs_nodes(wld, "blue")] == ["n2"]
    assert predict_preflight(wld.proxynodes["n1"], p) == []
    text = plan_view.render_preview(p, wld)
    n2 = next(line for line in text.splitlines() if line.strip().startswith("n2 "))
    assert "WILL FAIL PREFLIGHT: 1 IPVS virtual server that is not kube-proxy's (TCP 198.18.5.1:80 rr)" in n2
    assert "gate.behaviour.allowChanges: [ForeignIPVSFlush]" in n2
    assert ("foreign IPVS: 1 node(s) hold IPVS virtual servers that are not kube-proxy's; every start of an "
            "nftables kube-proxy deletes them") in text
    assert "refused: preflight fails on these nodes unless gate.behaviour.allowChanges names ForeignIPVSFlush" in text
    assert "  n2                             REFUSED: 1 (TCP 198.18.5.1:80 rr)" in text.splitlines()


def test_plan_with_the_acceptance_says_accepted_and_what_the_switch_deletes() -> None:
    p = policy(gate={"behaviour": {"allowChanges": ["ForeignIPVSFlush"]}})
    wld = _with_inventory(p, {"n1": ForeignIPVS(count=2, virtual_servers=["TCP 198.18.5.1:80 rr", "FWM 7 sh"])})
    text = plan_view.render_preview(p, wld)
    assert "WILL FAIL" not in text
    n1 = next(line for line in text.splitlines() if line.strip().startswith("n1 "))
    assert n1.endswith("ok; ForeignIPVSFlush accepted: the switch deletes 2 IPVS virtual servers that are not "
                       "kube-proxy's (TCP 198.18.5.1:80 rr, FWM 7 sh)")
    assert "accepted by gate.behaviour.allowChanges [ForeignIPVSFlush]: the switch deletes them" in text
    assert "  n1                             ACCEPTED: 2 (TCP 198.18.5.1:80 rr, FWM 7 sh)" in text.splitlines()


def test_plan_for_iptables_or_ipvs_does_not_list_them() -> None:
    # Not in the nftables list; a move to ipvs names them per node (test_ipvs_prunes_foreign.py), iptables not.
    for mode in ("iptables", "ipvs"):
        p = policy(mode=mode)
        wld = _with_inventory(p, {"n1": ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])})
        assert foreign_ipvs_nodes(wld, "blue") == []
        text = plan_view.render_preview(p, wld)
        assert "foreign IPVS" not in text
        assert ("1 IPVS virtual server that is not kube-proxy's" in text) is (mode == "ipvs")


def test_plan_json_lists_them_and_counts_a_refused_node_as_a_preflight_failure() -> None:
    from proxyshift.planner.preview import preview
    from proxyshift.planner.reports import plan_report

    for allow, accepted, failures in (([], False, 1), (["ForeignIPVSFlush"], True, 0)):
        p = policy(gate={"behaviour": {"allowChanges": allow}})
        wld = _with_inventory(p, {"n3": ForeignIPVS(count=1, virtual_servers=["TCP 198.18.5.1:80 rr"])})
        data = plan_report(p, wld, preview(wld, "blue"), [], None).model_dump(mode="json", by_alias=True)
        assert data["foreignIPVS"] == [{"node": "n3", "count": 1, "virtualServers": ["TCP 198.18.5.1:80 rr"],
                                        "accepted": accepted}]
        assert data["preflightFailures"] == failures
        n3 = next(n for stage in data["stages"] for n in stage["nodes"] if n["name"] == "n3")
        assert bool(n3["notes"]) is accepted and bool(n3["problems"]) is not accepted
