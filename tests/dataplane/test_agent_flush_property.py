"""Property, on real iptables: whatever a user's rule set is, the flush leaves it exactly as it was.

Each example builds two fresh namespaces: "node" gets kubelet's chains, the
user's rules (half before, half after kube-proxy's) and kube-proxy's rules;
"ref" gets the same minus kube-proxy's. After the flush their iptables-save
texts must be identical.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from tests.support.kp_rules import iptables_mode_rules, kubelet_rules
from tests.support.ps_netns import Netns, need_root

pytestmark = pytest.mark.dataplane

KUBE = iptables_mode_rules(10)
KUBELET = kubelet_rules()
# User chains, including names that look like kube-proxy's but are not its own.
CHAIN = st.from_regex(r"(USER|LOCAL|KUBE-MY|KUBE-SVC-x|KUBE-SEP-ab)[A-Z0-9]{0,6}", fullmatch=True)
OCTET = st.integers(0, 255)
PORT = st.integers(1, 65535)
COMMENT = st.text(alphabet="abcXYZ019 -_:/.=", min_size=1, max_size=20)


@st.composite
def rule_body(draw: st.DrawFn, table: str) -> str:
    kind = draw(st.sampled_from(["src", "dst-port", "udp-comment", "mark"] if table != "nat" else
                                ["src", "dst-port", "udp-comment"]))
    if kind == "src":
        return f"-s 198.18.{draw(OCTET)}.{draw(OCTET)}/32"
    if kind == "dst-port":
        return f"-d 198.19.{draw(OCTET)}.0/24 -p tcp -m tcp --dport {draw(PORT)}"
    if kind == "udp-comment":
        return f'-p udp -m udp --dport {draw(PORT)} -m comment --comment "{draw(COMMENT)}"'
    return f"-m mark --mark 0x{draw(st.integers(1, 255)):x}/0xff"


@st.composite
def user_ruleset(draw: st.DrawFn) -> tuple[str, str]:
    before: list[str] = []
    after: list[str] = []
    for table, builtins in (("filter", ["INPUT", "FORWARD", "OUTPUT"]),
                            ("nat", ["PREROUTING", "OUTPUT", "POSTROUTING"])):
        chains = draw(st.lists(CHAIN, max_size=4, unique=True))
        decl = [f":{c} - [0:0]" for c in chains]
        rules = []
        for _ in range(draw(st.integers(0, 10))):
            i = draw(st.integers(0, len(chains) + len(builtins) - 1))
            source = (builtins + chains)[i]
            # Jumps only "forward" in the chain list: a user rule set never loops.
            later = chains[max(0, i - len(builtins) + 1):] if source in chains else chains
            target = draw(st.sampled_from(["ACCEPT", "RETURN", *later]))
            rules.append(f"-A {source} {draw(rule_body(table))} -j {target}")
        split = draw(st.integers(0, len(rules)))
        before += [f"*{table}", *decl, *rules[:split], "COMMIT"]
        after += [f"*{table}", *rules[split:], "COMMIT"]
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(user_ruleset())
def test_random_user_rules_survive_the_flush_byte_for_byte(rules: tuple[str, str]) -> None:
    need_root()
    before, after = rules
    node, ref = Netns(), Netns()
    try:
        for ns, with_kube in ((node, True), (ref, False)):
            ns.restore(KUBELET)
            ns.restore(before)
            if with_kube:
                ns.restore(KUBE)
            ns.restore(after)
        report = flush(["iptables", "ipvs"], "nftables", runner=node.run, iptables_tools=[IptablesTool("ipv4", "nft")])
        assert report.ok, report.message()
        assert body(node.save()) == body(ref.save())
    finally:
        node.delete()
        ref.delete()
