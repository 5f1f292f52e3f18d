"""Property tests of rendering: hash stability and sensitivity, names valid for any policy name."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyshift.api.policy import ProxyPolicy
from proxyshift.render import (
    affinity_patch_pair,
    baseline_affinity_patch,
    policy_label_value,
    render_revision,
    revision_name,
    revision_object_names,
    undo_baseline_affinity_patch,
)
from proxyshift.render.names import MAX_REVISION, is_dns_subdomain, is_label_value

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CM = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-configmap.yaml").read_text())
DS = yaml.safe_load((FIXTURES / "kubeadm" / "kube-proxy-daemonset.yaml").read_text())
BASE_CONFIG = yaml.safe_load(CM["data"]["config.conf"])

DNS_LABEL = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z", fullmatch=True)
POLICY_NAMES = st.lists(DNS_LABEL, min_size=1, max_size=8).map(".".join).filter(lambda n: len(n) <= 253)
HASHES = st.text(alphabet="0123456789abcdef", min_size=10, max_size=10)
DURATIONS = st.builds(lambda n, u: f"{n}{u}", st.integers(0, 10_000), st.sampled_from(["ms", "s", "m", "h"]))
SCHEDULERS = st.sampled_from(["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh"])


def with_config(config: dict[str, Any], text_style: dict[str, Any] | None = None) -> dict[str, Any]:
    cm = copy.deepcopy(CM)
    cm["data"]["config.conf"] = yaml.safe_dump(config, sort_keys=False, **(text_style or {}))
    return cm


def shuffled(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


def policy(spec: dict[str, Any], name: str = "p") -> ProxyPolicy:
    return ProxyPolicy.model_validate({"metadata": {"name": name}, "spec": {"nodeSelector": {}, **spec}})


# Policy specs kube-proxy would run differently: mode plus the mode's settings.
IPVS_SPECS = st.fixed_dictionaries(
    {"mode": st.just("ipvs")},
    optional={"ipvs": st.fixed_dictionaries({}, optional={
        "scheduler": SCHEDULERS, "strictARP": st.booleans(), "syncPeriod": DURATIONS, "minSyncPeriod": DURATIONS,
        "tcpTimeout": DURATIONS, "tcpFinTimeout": DURATIONS, "udpTimeout": DURATIONS,
        "excludeCIDRs": st.lists(st.sampled_from(["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"]), max_size=3,
                                 unique=True)})},
)
IPTABLES_SPECS = st.fixed_dictionaries(
    {"mode": st.just("iptables")},
    optional={"iptables": st.fixed_dictionaries({}, optional={
        "syncPeriod": DURATIONS, "minSyncPeriod": DURATIONS, "masqueradeAll": st.booleans(),
        "masqueradeBit": st.integers(0, 31), "localhostNodePorts": st.booleans()})},
)
NFTABLES_SPECS = st.fixed_dictionaries(
    {"mode": st.just("nftables")},
    optional={"nftables": st.fixed_dictionaries({}, optional={
        "syncPeriod": DURATIONS, "minSyncPeriod": DURATIONS, "masqueradeAll": st.booleans(),
        "masqueradeBit": st.integers(0, 31)})},
)
SPECS = st.one_of(IPVS_SPECS, IPTABLES_SPECS, NFTABLES_SPECS)


@settings(max_examples=60, deadline=None)
@given(spec=SPECS, seed=st.integers(0, 2**32 - 1), flow=st.booleans())
def test_hash_ignores_key_order_and_yaml_style(spec: dict[str, Any], seed: int, flow: bool) -> None:
    rnd = random.Random(seed)
    reference = render_revision(policy(spec), with_config(BASE_CONFIG), DS)
    reordered = render_revision(
        policy(shuffled(spec, rnd)),
        with_config(shuffled(BASE_CONFIG, rnd), {"default_flow_style": flow}),
        shuffled(DS, rnd),
    )
    assert reordered.hash == reference.hash and reordered.name == reference.name
    assert reordered.configmap == reference.configmap


@settings(max_examples=80, deadline=None)
@given(a=SPECS, b=SPECS)
def test_equal_hash_exactly_when_kube_proxy_reads_the_same_config(a: dict[str, Any], b: dict[str, Any]) -> None:
    ra, rb = render_revision(policy(a), CM, DS), render_revision(policy(b), CM, DS)
    assert (ra.hash == rb.hash) == (ra.config == rb.config)


@settings(max_examples=80, deadline=None)
@given(spec=SPECS)
def test_every_policy_setting_reaches_the_config(spec: dict[str, Any]) -> None:
    config = render_revision(policy(spec), CM, DS).config
    mode = spec["mode"]
    assert config["mode"] == mode
    for key, value in spec.get(mode, {}).items():
        assert config[mode][key] == value, key


# One modelled field per case, with two different values kube-proxy would read differently.
FIELD_CHANGES = st.one_of(
    st.tuples(st.just("ipvs"), st.just("scheduler"), st.lists(SCHEDULERS, min_size=2, max_size=2, unique=True)),
    st.tuples(st.just("ipvs"), st.just("strictARP"), st.just([True, False])),
    st.tuples(st.sampled_from(["ipvs", "iptables", "nftables"]), st.sampled_from(["syncPeriod", "minSyncPeriod"]),
              st.lists(DURATIONS, min_size=2, max_size=2, unique=True)),
    st.tuples(st.just("ipvs"), st.sampled_from(["tcpTimeout", "tcpFinTimeout", "udpTimeout"]),
              st.lists(DURATIONS, min_size=2, max_size=2, unique=True)),
    st.tuples(st.just("ipvs"), st.just("excludeCIDRs"), st.just([["10.0.0.0/8"], ["10.0.0.0/16"]])),
    st.tuples(st.sampled_from(["iptables", "nftables"]), st.just("masqueradeAll"), st.just([True, False])),
    st.tuples(st.sampled_from(["iptables", "nftables"]), st.just("masqueradeBit"),
              st.lists(st.integers(0, 31), min_size=2, max_size=2, unique=True)),
    st.tuples(st.just("iptables"), st.just("localhostNodePorts"), st.just([True, False])),
)


@settings(max_examples=120, deadline=None)
@given(change=FIELD_CHANGES, spec=SPECS)
def test_any_change_to_a_modelled_field_changes_the_hash(change: tuple[str, str, list[Any]],
                                                          spec: dict[str, Any]) -> None:
    mode, field, (one, other) = change
    base: dict[str, Any] = dict(spec) if spec["mode"] == mode else {"mode": mode}
    settings_ = dict(base.get(mode, {}))
    first = {**base, mode: {**settings_, field: one}}
    second = {**base, mode: {**settings_, field: other}}
    assert render_revision(policy(first), CM, DS).hash != render_revision(policy(second), CM, DS).hash


LEAF_PATHS = [
    ("clusterCIDR",), ("conntrack", "udpTimeout"), ("metricsBindAddress",), ("logging", "verbosity"),
    ("winkernel", "networkName"), ("clientConnection", "qps"), ("bindAddress",), ("portRange",),
]


@settings(max_examples=40, deadline=None)
@given(spec=SPECS, path=st.sampled_from(LEAF_PATHS), data=st.data())
def test_any_change_to_the_baseline_config_changes_the_hash(spec: dict[str, Any], path: tuple[str, ...],
                                                            data: st.DataObject) -> None:
    changed = copy.deepcopy(BASE_CONFIG)
    node = changed
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    values = st.integers(0, 99) if isinstance(old, int) else st.text(min_size=1, max_size=8)
    node[path[-1]] = data.draw(values.filter(lambda v: v != old))
    assert render_revision(policy(spec), with_config(changed), DS).hash != render_revision(policy(spec), CM, DS).hash


@settings(max_examples=300, deadline=None)
@given(name=POLICY_NAMES, hash_=HASHES)
def test_names_are_always_valid(name: str, hash_: str) -> None:
    rev = revision_name(name, hash_)
    assert rev == revision_name(name, hash_)
    assert len(rev) <= MAX_REVISION and is_label_value(rev) and is_dns_subdomain(rev)
    assert rev.endswith(hash_)
    for obj_name in revision_object_names(rev):
        assert len(obj_name) <= 63 and is_dns_subdomain(obj_name)
    label = policy_label_value(name)
    assert is_label_value(label) and (label == name) == (len(name) <= 63)


@settings(max_examples=300, deadline=None)
@given(a=POLICY_NAMES, b=POLICY_NAMES, hash_=HASHES)
def test_distinct_policies_get_distinct_revisions(a: str, b: str, hash_: str) -> None:
    if a != b:
        assert revision_name(a, hash_) != revision_name(b, hash_)
        assert policy_label_value(a) != policy_label_value(b)


@settings(max_examples=25, deadline=None)
@given(name=POLICY_NAMES, spec=SPECS)
def test_rendered_objects_carry_valid_labels(name: str, spec: dict[str, Any]) -> None:
    rev = render_revision(policy(spec, name), CM, DS)
    for obj in (rev.configmap, rev.daemonset):
        assert all(is_label_value(v) for v in obj["metadata"]["labels"].values())
        assert len(obj["metadata"]["name"]) <= 63
    assert all(is_label_value(v) for v in rev.daemonset["spec"]["template"]["metadata"]["labels"].values())


EXPRESSIONS = st.fixed_dictionaries({
    "key": st.sampled_from(["zone", "node-role", "kubernetes.io/arch"]),
    "operator": st.sampled_from(["In", "NotIn"]),
    "values": st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2, unique=True),
})
TERMS = st.fixed_dictionaries({}, optional={
    "matchExpressions": st.lists(EXPRESSIONS, max_size=3),
    "matchFields": st.lists(st.just({"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}), max_size=1),
})
AFFINITIES = st.one_of(
    st.just(...),
    st.builds(lambda terms: {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}}, st.lists(TERMS, min_size=1, max_size=4)),
)


@settings(max_examples=100, deadline=None)
@given(affinity=AFFINITIES)
def test_affinity_patch_round_trips(affinity: Any) -> None:
    ds = copy.deepcopy(DS)
    if affinity is not ...:
        ds["spec"]["template"]["spec"]["affinity"] = affinity
    pair = affinity_patch_pair(ds)
    if pair is None:
        # Only when every real term already has the expression (never, for these shapes) or none is real.
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all(not t.get("matchExpressions") and not t.get("matchFields") for t in terms)
        return
    forward, inverse = pair
    patched = forward.apply(ds)
    assert baseline_affinity_patch(patched) is None
    assert inverse.apply(patched) == ds
    undo = undo_baseline_affinity_patch(patched)
    assert undo is not None and _normal(undo.apply(patched)) == _normal(ds)


def _normal(ds: dict[str, Any]) -> Any:
    """Drop empty lists/objects the API server would omit anyway (omitempty)."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: clean(v) for k, v in value.items()}
            return {k: v for k, v in out.items() if v not in ({}, [], None) or k == "matchFields"}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value
    return clean(ds)
