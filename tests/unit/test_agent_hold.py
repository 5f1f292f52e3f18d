"""The rule hold's pure planning: what it copies, under which names, and what its release removes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxyshift.agent.hold import (
    HOLD_CHAIN_PREFIX,
    NFT_HOLD_TABLE,
    held_name,
    hold_applies,
    nft_hold_text,
    plan_iptables_hold,
    plan_iptables_release,
    render_iptables_hold,
)
from proxyshift.agent.iptables_save import parse
from proxyshift.agent.ownership import iptables_chain_modes

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent.parent / "fixtures"
KUBE_PROXY_SAVE = (FIXTURES / "iptables" / "kube-proxy-v1.37.2-iptables-30-services.save.txt").read_text()
WITH_USER_RULES = (FIXTURES / "iptables" / "iptables-mode-20-services-with-user-rules.save.txt").read_text()


def test_hold_applies_only_between_iptables_and_nftables() -> None:
    assert hold_applies("iptables", "nftables") and hold_applies("nftables", "iptables")
    for pair in [("iptables", "ipvs"), ("ipvs", "iptables"), ("ipvs", "nftables"), ("nftables", "ipvs"),
                 ("iptables", "iptables"), ("nftables", "nftables"), (None, "nftables")]:
        assert not hold_applies(*pair), pair


def test_the_hold_copies_every_kube_proxy_nat_chain_with_the_same_rules_under_new_names() -> None:
    dump = parse(KUBE_PROXY_SAVE)
    declare, rules, hooks = plan_iptables_hold(dump)
    nat = dump.tables["nat"]
    kube = [c for c in nat.user_defined() if "iptables" in iptables_chain_modes("nat", c)
            and c not in ("KUBE-PROXY-CANARY", "KUBE-MARK-DROP")]
    assert sorted(line[1:].split()[0] for line in declare) == sorted(held_name(c) for c in kube)
    assert all(len(held_name(c)) <= 28 for c in kube)  # iptables' chain name limit
    # Same rules in the same order, only the chain names differ.
    originals = [r.line for r in nat.rules if r.chain in set(kube)]
    assert len(rules) == len(originals)
    for copy, original in zip(rules, originals, strict=True):
        assert "KUBE-" not in copy.split(" -m comment --comment ")[0].split(" ", 2)[1]
        assert copy.replace(HOLD_CHAIN_PREFIX, "KUBE-") == original
    # The copies are reached the way kube-proxy's chains are: from the same hooks.
    assert sorted(h.split()[1] for h in hooks) == ["OUTPUT", "POSTROUTING", "PREROUTING"]
    assert all(h.endswith(("-j PSHOLD-SERVICES", "-j PSHOLD-POSTROUTING")) for h in hooks)


def test_the_hold_keeps_the_users_rules_out() -> None:
    declare, rules, hooks = plan_iptables_hold(parse(WITH_USER_RULES))
    text = "\n".join(declare + rules + hooks)
    assert "USER-" not in text and "198.18.7.7" not in text
    assert "KUBE-FIREWALL" not in text  # kubelet's, in the filter table anyway


def test_nothing_to_hold_without_iptables_mode_chains() -> None:
    assert plan_iptables_hold(parse("*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j ACCEPT\nCOMMIT\n")) == \
        ([], [], [])
    assert render_iptables_hold([], [], []) == ""


def test_the_hook_jumps_go_in_the_last_block_after_every_copy_exists() -> None:
    declare, rules, hooks = plan_iptables_hold(parse(KUBE_PROXY_SAVE))
    text = render_iptables_hold(declare, rules, hooks, batch=7)
    blocks = [b for b in text.split("COMMIT\n") if b.strip()]
    assert all(b.startswith("*nat\n") for b in blocks)
    assert blocks[-1].strip().splitlines()[1:] == hooks
    assert not any(h in b for b in blocks[:-1] for h in hooks)
    assert max(len(b.strip().splitlines()) - 1 for b in blocks[:-1]) <= 7


def test_release_removes_the_hold_and_only_the_hold() -> None:
    dump = parse(KUBE_PROXY_SAVE)
    declare, rules, hooks = plan_iptables_hold(dump)
    held = parse(_applied(KUBE_PROXY_SAVE, declare, rules, hooks))
    plans = plan_iptables_release(held)
    assert [p.table for p in plans] == ["nat"]
    assert sorted(plans[0].delete_chains) == sorted(line[1:].split()[0] for line in declare)
    assert sorted(r.line for r in plans[0].delete_rules) == sorted(hooks)
    assert plan_iptables_release(dump) == []


def _applied(save: str, declare: list[str], rules: list[str], hooks: list[str]) -> str:
    """The save text as it would read after the hold is installed (chains and rules added to nat)."""
    out, in_nat = [], False
    for line in save.splitlines():
        if line == "*nat":
            in_nat = True
        if in_nat and line == "COMMIT":
            out += declare + rules + hooks
            in_nat = False
        out.append(line)
    return "\n".join(out) + "\n"


@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", min_size=16, max_size=16),
       st.sampled_from(["SVC", "SEP", "EXT", "FW", "SVL"]))
def test_held_names_stay_within_iptables_limits_and_out_of_kube_proxys_cleanup(suffix: str, kind: str) -> None:
    name = held_name(f"KUBE-{kind}-{suffix}")
    assert len(name) <= 28 and name.startswith(HOLD_CHAIN_PREFIX)
    # kube-proxy's cleanup and our own flush only touch chains that ownership calls kube-proxy's.
    assert iptables_chain_modes("nat", name) == frozenset()


def _table_block(ruleset: str, header: str) -> str:
    lines = ruleset.splitlines()
    start = lines.index(header)
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return "\n".join(lines[start:end + 1]) + "\n"


def test_the_nft_hold_is_kube_proxys_table_renamed_in_one_transaction() -> None:
    listed = _table_block((FIXTURES / "nft" / "kube-proxy-v1.37.2-ruleset.nft").read_text(), "table ip kube-proxy {")
    script = nft_hold_text("ip", listed)
    head, _, table = script.partition(f"table ip {NFT_HOLD_TABLE} {{")
    assert head == f"add table ip {NFT_HOLD_TABLE}\ndelete table ip {NFT_HOLD_TABLE}\n"
    assert "table ip kube-proxy {" + table == listed


def test_the_nft_hold_refuses_text_that_is_not_the_kube_proxy_table() -> None:
    with pytest.raises(ValueError, match="unexpected"):
        nft_hold_text("ip", "table ip user-fw {\n}\n")
    with pytest.raises(ValueError, match="unexpected"):
        nft_hold_text("ip", "")
