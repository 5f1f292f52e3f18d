"""The agent's parsers of tool output fail only with their own clear errors, whatever the text."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.agent.flush.ipvs import IpvsadmOutputError, parse_ipset_save, parse_ipvsadm_save
from proxyshift.agent.flush.nftables import NftOutputError, parse_tables
from proxyshift.agent.ip_addr import addresses
from proxyshift.agent.iptables_save import IptablesSaveError, parse
from proxyshift.agent.probe import HttpAnswer, health_from_answer

pytestmark = pytest.mark.unit

LINES = st.lists(st.one_of(
    st.sampled_from(["*nat", "*filter", "COMMIT", ":KUBE-SERVICES - [0:0]", "-A INPUT -j KUBE-SERVICES",
                     '-A X -m comment --comment "a \\"b\\" -j" -j ACCEPT', "-A", "-A ", "# c", "",
                     "-A -t 10.96.0.1:443 -s rr", "-A -t [fd00::1]:443 -s rr", "-A -f 7 -s rr", "-A -u x:y",
                     "add KUBE-CLUSTER-IP 10.96.0.1,tcp:443", "create KUBE-NODE-PORT-TCP bitmap:port",
                     "add KUBE-NODE-PORT-TCP 30080", "add KUBE-CLUSTER-IP garbage"]),
    st.text(max_size=40)), max_size=30).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(LINES)
def test_iptables_save_parser(text: str) -> None:
    with contextlib.suppress(IptablesSaveError):
        dump = parse(text)
        for table in dump.tables.values():
            for rule in table.rules:
                assert rule.line.startswith("-A ")


@settings(max_examples=300, deadline=None)
@given(LINES)
def test_ipvsadm_and_ipset_parsers(text: str) -> None:
    with contextlib.suppress(IpvsadmOutputError):
        for vs in parse_ipvsadm_save(text):
            assert vs.protocol in ("tcp", "udp", "sctp", "fwmark")
    state = parse_ipset_save(text)
    assert all(name.startswith("KUBE-") for name in state.names)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=20))
def test_nft_json_parser(doc: Any) -> None:  # any JSON value
    import json

    with contextlib.suppress(NftOutputError):
        for family, name in parse_tables(json.dumps(doc)):
            assert isinstance(family, str) and isinstance(name, str)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=20))
def test_healthz_json_parser(doc: Any) -> None:  # any JSON value as kube-proxy's /healthz body
    import json

    health = health_from_answer(HttpAnswer("http://127.0.0.1:10256/healthz", 200, json.dumps(doc)))
    assert health.status == 200 and health.error is None
    assert health.proxiers is None or (health.proxiers and all(isinstance(s.last_updated, str)
                                                               for s in health.proxiers))


def test_ip_addr_json_without_addresses() -> None:
    assert addresses('[{"ifname":"kube-ipvs0","addr_info":[]}]') == []
