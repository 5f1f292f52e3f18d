"""Pure planning of the flushes: iptables restore text, nft tables, ipvs address selection."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.agent.flush import flush, validate_modes
from proxyshift.agent.flush.iptables import IptablesTool, available_tools, plan_flush, render_restore
from proxyshift.agent.flush.ipvs import (
    IpsetState,
    IpvsFlusher,
    parse_ipset_save,
    parse_ipvsadm_save,
    select_owned,
)
from proxyshift.agent.flush.nftables import parse_tables, render_delete
from proxyshift.agent.iptables_save import IptablesSaveError, parse, rule_target
from proxyshift.agent.ownership import chain_is_stale, iptables_chain_modes
from proxyshift.api.proxynode import Mode
from proxyshift.commands import CommandError, Result

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SAVE = (FIX / "iptables" / "iptables-mode-20-services-with-user-rules.save.txt").read_text()
IPVSADM = (FIX / "ipvsadm" / "ipvs-node-with-keepalived.Sn.txt").read_text()
ALL: frozenset[Mode] = frozenset({"iptables", "ipvs"})


def test_ownership_is_exact_names_and_hash_shaped_service_chains() -> None:
    assert iptables_chain_modes("nat", "KUBE-SVC-TCOU7JCQXEZGVUNU") == {"iptables"}
    assert iptables_chain_modes("nat", "KUBE-SVC-mine") == frozenset()
    assert iptables_chain_modes("filter", "KUBE-SVC-TCOU7JCQXEZGVUNU") == frozenset()
    assert iptables_chain_modes("filter", "KUBE-FIREWALL") == frozenset()
    assert iptables_chain_modes("nat", "KUBE-KUBELET-CANARY") == frozenset()
    assert iptables_chain_modes("filter", "KUBE-MYAPP") == frozenset()
    assert iptables_chain_modes("nat", "KUBE-SERVICES") == {"iptables", "ipvs"}
    assert chain_is_stale("nat", "KUBE-SERVICES", {"iptables"}, "nftables")
    assert not chain_is_stale("nat", "KUBE-SERVICES", {"iptables"}, "ipvs")
    assert chain_is_stale("nat", "KUBE-NODE-PORT", {"ipvs"}, "iptables")


def test_plan_for_nftables_names_only_kube_proxy_chains_and_jumps_into_them() -> None:
    dump = parse(SAVE)
    plans = plan_flush(dump, ALL, "nftables")
    doomed = {(p.table, c) for p in plans for c in p.delete_chains}
    assert ("nat", "KUBE-SERVICES") in doomed and ("mangle", "KUBE-PROXY-CANARY") in doomed
    assert not {c for _, c in doomed} & {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MYAPP", "USER-IN"}
    for plan in plans:
        for rule in plan.delete_rules:
            assert rule.chain in {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
            assert rule.target in plan.delete_chains
    text = render_restore(plans)
    assert "USER" not in text and "KUBE-MYAPP" not in text and "KUBE-FIREWALL" not in text
    # Unlinking (-D) first, in one block per table; then every declaration (which empties
    # chains); then every -X; blocks never exceed the batch size.
    lines = text.splitlines()
    first_decl = min(i for i, line in enumerate(lines) if line.startswith(":"))
    assert max(i for i, line in enumerate(lines) if line.startswith("-D ")) < first_decl
    assert max(i for i, line in enumerate(lines) if line.startswith(":")) < \
        min(i for i, line in enumerate(lines) if line.startswith("-X "))
    small = render_restore(plans, batch=7)
    for block in small.split("COMMIT\n"):
        assert sum(1 for line in block.splitlines() if line.startswith((":", "-X "))) <= 7
    def commands(t: str) -> set[str]:
        return {line for line in t.splitlines() if line[:2] in (":K", "-X", "-D")}

    assert commands(small) == commands(text)


def test_plan_is_empty_once_nothing_is_stale() -> None:
    dump = parse(SAVE)
    assert plan_flush(dump, frozenset({"nftables"}), "iptables") == []
    assert render_restore([]) == ""


def test_plan_for_ipvs_keeps_shared_chains_but_drops_their_jumps_into_service_chains() -> None:
    plans = plan_flush(parse(SAVE), frozenset({"iptables"}), "ipvs")
    doomed = {(p.table, c) for p in plans for c in p.delete_chains}
    assert ("nat", "KUBE-SERVICES") not in doomed and ("nat", "KUBE-MARK-MASQ") not in doomed
    assert ("nat", "KUBE-NODEPORTS") in doomed and ("filter", "KUBE-EXTERNAL-SERVICES") in doomed
    nat = next(p for p in plans if p.table == "nat")
    assert nat.delete_rules and {r.chain for r in nat.delete_rules} == {"KUBE-SERVICES"}


def test_rule_target_ignores_quoted_text() -> None:
    assert rule_target('-A X -m comment --comment "do not -j KUBE-SVC-AAAAAAAAAAAAAAAA" -j ACCEPT') == "ACCEPT"
    assert rule_target("-A X -g KUBE-SVC-AAAAAAAAAAAAAAAA") == "KUBE-SVC-AAAAAAAAAAAAAAAA"
    assert rule_target('-A X -m comment --comment "a \\"quoted\\" -j word"') is None


def test_parse_refuses_non_iptables_save_text() -> None:
    with pytest.raises(IptablesSaveError):
        parse("-A INPUT -j ACCEPT\n")
    with pytest.raises(IptablesSaveError):
        parse("*filter\nhello\nCOMMIT\n")


def test_modes_are_validated_and_the_target_never_removed() -> None:
    assert validate_modes(["iptables", "nftables"], "nftables") == (frozenset({"iptables"}), "nftables")
    with pytest.raises(ValueError, match="unknown kube-proxy mode"):
        validate_modes(["userspace"], "iptables")


def test_available_tools_prefers_explicit_backends() -> None:
    have = {"iptables-nft-save", "iptables-nft-restore", "iptables-legacy-save", "iptables-legacy-restore",
            "ip6tables-save", "ip6tables-restore"}
    tools = available_tools(lambda name: name if name in have else None)
    assert tools == [IptablesTool("ipv4", "nft"), IptablesTool("ipv4", "legacy"), IptablesTool("ipv6", None)]


# --- nftables ---

def test_nft_tables_parse_and_delete_script() -> None:
    tables = parse_tables((FIX / "nft" / "list-tables.json").read_text())
    assert ("ip", "kube-proxy") in tables and ("inet", "user-fw") in tables
    script = render_delete([("ip", "kube-proxy")])
    assert script == "add table ip kube-proxy\ndelete table ip kube-proxy\n"
    assert parse_tables("") == []
    with pytest.raises(ValueError):
        parse_tables("{not json")


# --- ipvs ---

EVIDENCE_DUMMY = {"10.96.0.1", "10.96.0.10", "10.96.143.7", "fd00:10:96::1"}
IPSET_SAVE = """\
create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536
add KUBE-CLUSTER-IP 10.96.0.1,tcp:443
add KUBE-CLUSTER-IP 10.96.0.10,udp:53
add KUBE-CLUSTER-IP 10.96.0.10,tcp:53
add KUBE-CLUSTER-IP 10.96.0.10,tcp:9153
create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536
add KUBE-6-CLUSTER-IP fd00:10:96::1,tcp:443
create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
add KUBE-NODE-PORT-TCP 30080
create KUBE-ALLOWED hash:ip family inet hashsize 1024 maxelem 65536
add KUBE-ALLOWED 10.96.0.99
create keepalived-vips hash:ip family inet hashsize 1024 maxelem 65536
add keepalived-vips 192.168.10.50
"""
NODE_ADDRS = {"172.18.0.2", "10.244.0.1", "192.168.10.50", "127.0.0.1"}
EXPECTED_OWNED = {"-t 10.96.0.1:443", "-u 10.96.0.10:53", "-t 10.96.0.10:53", "-t 10.96.0.10:9153",
                  "-t 10.96.143.7:80", "-t 172.18.0.2:30080", "-t 10.244.0.1:30080", "-t [fd00:10:96::1]:443"}


def test_ipvsadm_save_is_parsed_including_ipv6_and_fwmark() -> None:
    services = parse_ipvsadm_save(IPVSADM)
    assert len(services) == 12
    assert {vs.protocol for vs in services} == {"tcp", "udp", "fwmark"}
    v6 = next(vs for vs in services if vs.address == "fd00:10:96::1")
    assert v6.port == 443 and v6.service_arg == "-t [fd00:10:96::1]:443"


def test_only_virtual_servers_kube_proxy_owned_are_selected() -> None:
    state = parse_ipset_save(IPSET_SAVE)
    assert "KUBE-ALLOWED" not in state.names and "keepalived-vips" not in state.names
    owned = select_owned(parse_ipvsadm_save(IPVSADM), EVIDENCE_DUMMY, state, NODE_ADDRS)
    assert {vs.service_arg for vs in owned} == EXPECTED_OWNED


def test_the_ipset_alone_is_enough_evidence_when_kube_ipvs0_is_already_gone() -> None:
    owned = select_owned(parse_ipvsadm_save(IPVSADM), set(), parse_ipset_save(IPSET_SAVE), NODE_ADDRS)
    assert {vs.service_arg for vs in owned} == EXPECTED_OWNED - {"-t 10.96.143.7:80"}


def test_no_evidence_selects_nothing() -> None:
    assert select_owned(parse_ipvsadm_save(IPVSADM), set(), IpsetState(), NODE_ADDRS) == []


class FakeNode:
    """Answers the ipvs flusher's commands from recorded texts and records what it changed."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(self, argv: Sequence[str], *, input: str | None = None, **_: Any) -> Result:
        argv = list(argv)
        self.calls.append((argv, input))
        out = ""
        if argv[:4] == ["ip", "-j", "addr", "show"] and argv[4:] == ["dev", "kube-ipvs0"]:
            out = '[{"ifname":"kube-ipvs0","addr_info":[' + ",".join(
                f'{{"local":"{a}"}}' for a in sorted(EVIDENCE_DUMMY)) + "]}]"
        elif argv[:4] == ["ip", "-j", "addr", "show"]:
            out = '[{"ifname":"eth0","addr_info":[' + ",".join(
                f'{{"local":"{a}"}}' for a in sorted(NODE_ADDRS | EVIDENCE_DUMMY)) + "]}]"
        elif argv == ["ipset", "save"]:
            out = IPSET_SAVE
        elif argv == ["ipvsadm", "-Sn"]:
            out = IPVSADM
        return Result(argv, 0, out, "")


def test_ipvs_flusher_deletes_only_owned_services_then_dummy_then_sets(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")
    node = FakeNode()
    steps = IpvsFlusher(run=node, proc_root=tmp_path).flush(frozenset({"ipvs"}), "nftables")
    assert steps[0].removed == {"virtual servers": 8, "interfaces": 1, "ipsets": 3}
    assert "4 virtual servers not created by kube-proxy left in place" in steps[0].skipped
    restore = next(inp for argv, inp in node.calls if argv == ["ipvsadm", "-R"])
    assert restore is not None
    assert {line.removeprefix("-D ") for line in restore.splitlines()} == EXPECTED_OWNED
    order = [argv[0] + " " + argv[1] for argv, _ in node.calls if argv[:2] in (["ipvsadm", "-R"],
             ["ip", "link"], ["ipset", "restore"])]
    assert order == ["ipvsadm -R", "ip link", "ipset restore"]
    destroy = next(inp for argv, inp in node.calls if argv == ["ipset", "restore"])
    assert destroy is not None
    assert "KUBE-ALLOWED" not in destroy and "keepalived" not in destroy


def test_ipvs_flusher_without_ipvs_never_calls_ipvsadm(tmp_path: Path) -> None:
    node = FakeNode()
    steps = IpvsFlusher(run=node, proc_root=tmp_path).flush(frozenset({"ipvs"}), "iptables")
    assert not [argv for argv, _ in node.calls if argv[0] == "ipvsadm"]
    assert any("no IPVS" in s for s in steps[0].skipped)


def test_a_failing_tool_is_reported_not_raised(tmp_path: Path) -> None:
    def broken(argv: Sequence[str], **_: Any) -> NoReturn:
        raise CommandError(list(argv), "exited 1: boom")

    report = flush(["iptables", "ipvs", "nftables"], "iptables", runner=broken,
                   iptables_tools=[IptablesTool("ipv4", "nft")], proc_root=tmp_path)
    assert not report.ok and "boom" in report.message()


# --- property: a user's rules never appear in the restore text ---

USER_CHAIN = st.from_regex(r"(USER|KUBE-MY|KUBE-SVC-x|LOCAL)-[A-Z0-9]{1,8}", fullmatch=True)
TARGETS = st.sampled_from(["ACCEPT", "DROP", "RETURN"])


@st.composite
def user_rule_lines(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    chains = draw(st.lists(USER_CHAIN, min_size=1, max_size=4, unique=True))
    rules = []
    for _ in range(draw(st.integers(1, 12))):
        chain = draw(st.sampled_from([*chains, "INPUT", "FORWARD", "OUTPUT"]))
        target = draw(st.one_of(TARGETS, st.sampled_from(chains)))
        comment = draw(st.text(alphabet="abc -j\"KUBE", max_size=12)).replace('"', '\\"')
        rules.append(f'-A {chain} -s 198.18.{draw(st.integers(0, 255))}.0/24 -m comment --comment "{comment}" '
                     f"-j {target}")
    return chains, rules


@settings(max_examples=150, deadline=None)
@given(user_rule_lines())
def test_user_chains_and_rules_never_appear_in_the_restore_text(data: tuple[list[str], list[str]]) -> None:
    chains, rules = data
    head, sep, tail = SAVE.partition("*filter\n")
    decls = "".join(f":{c} - [0:0]\n" for c in chains)
    text = head + sep + decls + tail.replace("COMMIT\n", "\n".join(rules) + "\nCOMMIT\n", 1)
    restore = render_restore(plan_flush(parse(text), ALL, "nftables"))
    for rule in rules:
        assert rule.split(" ", 2)[2] not in restore
    for chain in chains:
        assert f" {chain}\n" not in restore and f":{chain} " not in restore


REAL = (FIX / "iptables" / "kube-proxy-v1.37.2-iptables-30-services.save.txt").read_text()


def test_plan_on_real_kube_proxy_rules_removes_every_kube_proxy_chain_but_kubelets() -> None:
    dump = parse(REAL)
    before = {(t.name, c) for t in dump.tables.values() for c in t.user_defined()}
    doomed = {(p.table, c) for p in plan_flush(dump, ALL, "nftables") for c in p.delete_chains}
    assert before - doomed == {("filter", "KUBE-FIREWALL")}
    assert sum(1 for _, c in doomed if c.startswith("KUBE-SVC-")) == 30


def test_plan_on_real_kube_proxy_rules_for_ipvs_keeps_exactly_the_shared_chains() -> None:
    dump = parse(REAL)
    before = {(t.name, c) for t in dump.tables.values() for c in t.user_defined()}
    doomed = {(p.table, c) for p in plan_flush(dump, frozenset({"iptables"}), "ipvs") for c in p.delete_chains}
    assert before - doomed == {("filter", "KUBE-FIREWALL"), ("nat", "KUBE-SERVICES"), ("nat", "KUBE-POSTROUTING"),
                               ("nat", "KUBE-MARK-MASQ"), ("filter", "KUBE-FORWARD"),
                               ("filter", "KUBE-PROXY-FIREWALL")}


def test_a_refused_restore_is_planned_again_from_a_fresh_save_once() -> None:
    from proxyshift.agent.flush.iptables import IptablesFlusher

    small = "*nat\n:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n:MINE - [0:0]\n-A MINE -j ACCEPT\nCOMMIT\n"
    saves = [SAVE, small, "*nat\n:MINE - [0:0]\n-A MINE -j ACCEPT\nCOMMIT\n"]
    restores: list[str | None] = []

    def runner(argv: Sequence[str], *, input: str | None = None, **_: Any) -> Result:
        if argv[0].endswith("-save"):
            return Result(list(argv), 0, saves.pop(0), "")
        restores.append(input)
        if len(restores) == 1:
            raise CommandError(list(argv), "exited 1: line 9 failed", returncode=1)
        return Result(list(argv), 0, "", "")

    step = IptablesFlusher(run=runner, tools=[IptablesTool("ipv4", "nft")]).flush_one(
        IptablesTool("ipv4", "nft"), ALL, "nftables")
    assert not step.errors
    assert len(restores) == 2 and restores[1] is not None
    assert "KUBE-SVC-AAAAAAAAAAAAAAAA" in restores[1] and "MINE" not in restores[1]
    assert step.removed == {"chains": 1}
