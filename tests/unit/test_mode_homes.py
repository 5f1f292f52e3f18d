"""Each kube-proxy mode's knowledge has one home, proxyshift.modes (issue 14, "One module per mode").

Callers ask a mode's facts (MODE_FACTS[mode].<fact>) or dispatch through a table keyed by Mode or by the
object kinds the facts name; they do not compare a mode's name. These tests keep it so: no mode name is spelled
outside proxyshift/modes and proxyshift/api except the few listed below with why, and every mode's facts find
an entry in every table the agent dispatches through.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from proxyshift.agent import diagnostics, hold, inventory, ownership, preflight
from proxyshift.agent.flush import FLUSHERS
from proxyshift.api.proxynode import MODES
from proxyshift.modes import MODE_FACTS, OBJECT_KINDS

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "proxyshift"
# modes/ is where the names live, api/ is the wire (the Mode literal, the CRD's CEL rules); localcluster/ is the
# test bed, moving out of the package, which starts real kube-proxies by mode name on purpose.
HOMES = ("modes", "api", "localcluster")

# (file, function) -> (how many mode-name literals it holds, why they are not mode knowledge).
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("agent/preflight.py", "ToolVersions.as_status"): (1, "the tool iptables, a key of ProxyNode.status.tools"),
    ("agent/preflight.py", "detect_tools"): (2, "argv of the iptables binary"),
    ("agent/preflight.py", "<module>"): (1, "_TOOL_CHECKS is keyed by Tool (iptables, ipset, nft), not by mode"),
    ("agent/flush/iptables.py", "IptablesTool._stem"): (1, "the iptables binary's name"),
    ("agent/flush/iptables.py", "IptablesFlusher.flush"): (1, "the tool label of a FlushStep (a wire field)"),
    ("agent/flush/ipvs.py", "IpvsFlusher.flush"): (1, "the tool label of a FlushStep (a wire field)"),
    ("agent/flush/nftables.py", "NftablesFlusher.round"): (1, "the tool label of a FlushStep (a wire field)"),
    ("agent/flush/nftables.py", "parse_tables"): (2, "the top-level key of `nft -j` output"),
    ("agent/diagnostics.py", "<module>"): (2, "RULE_COUNTERS is keyed by CounterSource (api/diagnostics.py)"),
    ("agent/inventory.py", "<module>"): (1, "_IPTABLES_FILLS names the Inventory field `iptables`, not the mode"),
    ("planner/diagnosis.py", "diagnose"): (2, "CounterSource values: the sources with per-endpoint flows"),
}


def _mode_literals(path: Path) -> Counter[str]:
    """function qualname (or <module>) -> how many string constants in it are exactly a mode's name."""
    found: Counter[str] = Counter()

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Constant) and child.value in MODES:
                found[".".join(scope) or "<module>"] += 1
            visit(child, scope)

    visit(ast.parse(path.read_text()), [])
    return found


def test_no_mode_name_is_spelled_outside_modes_and_api() -> None:
    seen: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/", 1)[0] in HOMES:
            continue
        for scope, n in _mode_literals(path).items():
            seen[(rel, scope)] = n
    unexpected = {k: n for k, n in seen.items() if ALLOWED.get(k, (0, ""))[0] != n}
    assert not unexpected, (
        f"mode names spelled outside proxyshift/modes: {unexpected}. Ask the mode's facts "
        "(proxyshift.modes.MODE_FACTS[mode]) or add a fact to modes/<mode>.py instead of comparing its name; "
        "a name that is a tool or a wire value, not a mode, goes into ALLOWED with why")
    stale = sorted(k for k in ALLOWED if k not in seen)
    assert not stale, f"ALLOWED lists places that no longer spell a mode name: {stale}"


def test_every_mode_has_an_entry_in_every_table() -> None:
    assert tuple(MODE_FACTS) == MODES
    assert set(FLUSHERS) == set(OBJECT_KINDS)
    for mode, facts in MODE_FACTS.items():
        assert facts.mode == mode
        assert facts.objects, f"{mode}: leaves no objects the agent can find or flush"
        for kind in facts.objects:
            assert kind in FLUSHERS, f"{mode}: no flusher for {kind}"
            # Chains are counted by ownership.iptables_chain_modes; every other kind by its own counter.
            assert kind == "iptables-chains" or kind in inventory.KIND_COUNTS, f"{mode}: no inventory count for {kind}"
        assert ("iptables-chains" in facts.objects) == bool(facts.owned.chains)
        assert ("nft-tables" in facts.objects) == bool(facts.owned.nft_tables)
        assert ("ipvs-objects" in facts.objects) == bool(facts.owned.interface or facts.owned.ipsets)
        assert ("replacement-devices" in facts.objects) == bool(facts.owned.devices)
        assert ("bpf-attachments" in facts.objects) == bool(facts.owned.bpffs_dir or facts.owned.tc_filter_programs)
        if facts.held_as is not None:
            assert facts.held_as in facts.objects and facts.held_as in hold.INSTALLERS
        assert facts.counters == "conntrack" or facts.counters in diagnostics.RULE_COUNTERS
        assert {need.tool for need in facts.tools} <= set(preflight._TOOL_CHECKS)


def test_ownership_answers_from_every_modes_names() -> None:
    for mode, facts in MODE_FACTS.items():
        for table, chain in facts.owned.chains:
            assert mode in ownership.iptables_chain_modes(table, chain), (mode, table, chain)
        assert set(facts.owned.nft_tables) <= set(ownership.NFT_TABLES)
        assert all(ownership.is_kube_proxy_ipset(name) for name in facts.owned.ipsets)
    # A chain both iptables and ipvs mode create is shared: a flush for either target keeps it.
    assert ownership.iptables_chain_modes("nat", "KUBE-SERVICES") == {"iptables", "ipvs"}
