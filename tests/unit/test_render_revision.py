"""Rendering a revision from the baseline kube-proxy objects and a policy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.render import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_MODE,
    ANNOTATION_POLICY,
    LABEL_MANAGED_BY,
    LABEL_POLICY,
    LABEL_REVISION,
    affinity_patch_pair,
    policy_label_value,
    render_revision,
    revision_name,
    revision_object_names,
)
from proxyshift.render.names import MAX_REVISION, is_dns_subdomain, is_label_value

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The local cluster's baseline and a kubeadm cluster's `kubectl get -o yaml` (server fields, mode "").
BASELINES = ["baseline", "kubeadm"]


def load(kind: str, which: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / which / f"kube-proxy-{kind}.yaml").read_text())


def policy(name: str = "blue", **spec: Any) -> ProxyPolicy:
    body = {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": "nftables", **spec}
    return ProxyPolicy.model_validate({"metadata": {"name": name}, "spec": body})


def config_of(rendered_cm: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rendered_cm["data"]["config.conf"])


@pytest.fixture(params=BASELINES)
def baseline(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    return load("configmap", request.param), load("daemonset", request.param)


def test_names_labels_and_namespace(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    rev = render_revision(policy(), cm, ds)
    assert rev.name == f"blue-{rev.hash}" and len(rev.hash) == 10
    assert rev.mode == "nftables"
    cm_name, ds_name = revision_object_names(rev.name)
    for obj, name in ((rev.configmap, cm_name), (rev.daemonset, ds_name)):
        meta = obj["metadata"]
        assert meta["name"] == name == f"kube-proxy-{rev.name}"
        assert meta["namespace"] == "kube-system"
        assert meta["labels"][LABEL_POLICY] == "blue"
        assert meta["labels"][LABEL_REVISION] == rev.name
        assert meta["labels"][LABEL_MANAGED_BY] == "proxyshift"
        # The operator reads revisions back by these (the policy label value may be shortened).
        assert meta["annotations"] == {ANNOTATION_CONFIG_HASH: rev.hash, ANNOTATION_POLICY: "blue",
                                       ANNOTATION_MODE: "nftables"}
        # Nothing server-owned is carried over from the baseline object.
        assert not {"uid", "resourceVersion", "creationTimestamp", "generation", "ownerReferences"} & set(meta)
        assert "status" not in obj
    assert rev.labels == {LABEL_POLICY: "blue", LABEL_REVISION: rev.name, LABEL_MANAGED_BY: "proxyshift"}


def test_daemonset_selects_the_revision_and_keeps_the_baseline(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    rev = render_revision(policy(), cm, ds)
    spec = rev.daemonset["spec"]
    pod = spec["template"]["spec"]
    base_pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {**base_pod["nodeSelector"], LABEL_REVISION: rev.name}
    assert spec["selector"]["matchLabels"] == {**ds["spec"]["selector"]["matchLabels"], LABEL_REVISION: rev.name}
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spec["selector"]["matchLabels"].items())
    for key in ("containers", "tolerations", "priorityClassName", "hostNetwork", "serviceAccountName"):
        assert pod[key] == base_pod[key], key
    assert spec["updateStrategy"] == ds["spec"]["updateStrategy"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kube-proxy"]["configMap"]["name"] == rev.configmap["metadata"]["name"]
    base_volumes = {v["name"]: v for v in base_pod["volumes"]}
    assert volumes["xtables-lock"] == base_volumes["xtables-lock"]
    assert volumes["lib-modules"] == base_volumes["lib-modules"]


def test_configmap_keeps_other_keys_and_unknown_config_fields(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    rev = render_revision(policy(nftables={"syncPeriod": "45s", "masqueradeBit": 14}), cm, ds)
    assert rev.configmap["data"]["kubeconfig.conf"] == cm["data"]["kubeconfig.conf"]
    config = config_of(rev.configmap)
    base = yaml.safe_load(cm["data"]["config.conf"])
    assert config == rev.config
    assert config["mode"] == "nftables"
    assert config["nftables"]["syncPeriod"] == "45s" and config["nftables"]["masqueradeBit"] == 14
    assert config["nftables"]["minSyncPeriod"] == base["nftables"]["minSyncPeriod"]  # not in the policy: kept
    for unmodelled in ("clusterCIDR", "winkernel", "detectLocal", "clientConnection", "logging", "conntrack"):
        assert config[unmodelled] == base[unmodelled], unmodelled
    assert set(config) == set(base)  # nothing dropped, nothing invented


def test_ipvs_pins_the_scheduler(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    default = config_of(render_revision(policy(mode="ipvs"), cm, ds).configmap)
    assert default["mode"] == "ipvs" and default["ipvs"]["scheduler"] == "rr"
    wrr = render_revision(
        policy(mode="ipvs", ipvs={"scheduler": "wrr", "strictARP": True, "excludeCIDRs": ["10.0.0.0/8"],
                                  "tcpTimeout": "900s"}), cm, ds)
    ipvs = config_of(wrr.configmap)["ipvs"]
    assert ipvs["scheduler"] == "wrr" and ipvs["strictARP"] is True
    assert ipvs["excludeCIDRs"] == ["10.0.0.0/8"] and ipvs["tcpTimeout"] == "900s"


def test_iptables_settings_are_mapped(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    rev = render_revision(
        policy(mode="iptables", iptables={"masqueradeAll": True, "localhostNodePorts": False, "minSyncPeriod": "2s"}),
        cm, ds)
    iptables = config_of(rev.configmap)["iptables"]
    assert iptables["masqueradeAll"] is True and iptables["localhostNodePorts"] is False
    assert iptables["minSyncPeriod"] == "2s"


def test_inputs_are_not_modified(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    cm_before, ds_before = copy.deepcopy(cm), copy.deepcopy(ds)
    render_revision(policy(mode="ipvs"), cm, ds)
    assert cm == cm_before and ds == ds_before


def test_same_inputs_same_hash_and_name_does_not_enter_the_hash(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    a = render_revision(policy("blue"), cm, ds)
    assert render_revision(policy("blue"), cm, ds) == a
    b = render_revision(policy("green"), cm, ds)
    assert b.hash == a.hash and b.name != a.name


def test_settings_kube_proxy_does_not_see_keep_the_revision(baseline: tuple[dict, dict]) -> None:
    # Changing the pace of a rollout must not create a new revision (and restart every kube-proxy).
    cm, ds = baseline
    plain = render_revision(policy(), cm, ds)
    paced = render_revision(policy(rollout={"maxUnavailable": "50%", "cordon": True, "paused": True},
                                   gate={"minSyncs": 3, "timeout": "10m"}, preflight={"loadModules": True},
                                   nodeSelector={"matchLabels": {"pool": "green"}}), cm, ds)
    assert paced.hash == plain.hash


def test_what_kube_proxy_sees_changes_the_hash(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    hashes = {
        render_revision(p, cm, ds).hash
        for p in (
            policy(), policy(mode="iptables"), policy(mode="ipvs"), policy(mode="ipvs", ipvs={"scheduler": "lc"}),
            policy(nftables={"syncPeriod": "31s"}), policy(nftables={"masqueradeAll": True}),
        )
    }
    assert len(hashes) == 6
    changed = copy.deepcopy(cm)
    config = yaml.safe_load(changed["data"]["config.conf"])
    config["clusterCIDR"] = "10.99.0.0/16"
    changed["data"]["config.conf"] = yaml.safe_dump(config)
    assert render_revision(policy(), changed, ds).hash != render_revision(policy(), cm, ds).hash


def test_baseline_yaml_formatting_does_not_change_the_hash(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    reformatted = copy.deepcopy(cm)
    config = yaml.safe_load(cm["data"]["config.conf"])
    reordered = dict(reversed(list(config.items())))
    reformatted["data"]["config.conf"] = yaml.safe_dump(reordered, sort_keys=False, default_flow_style=True)
    assert render_revision(policy(), reformatted, ds).hash == render_revision(policy(), cm, ds).hash


def test_live_baseline_with_our_affinity_renders_without_it(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    user_term = {"matchExpressions": [{"key": "node-role", "operator": "NotIn", "values": ["edge"]}]}
    ds = copy.deepcopy(ds)
    ds["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [user_term]}}}
    pair = affinity_patch_pair(ds)
    assert pair is not None
    live = pair[0].apply(ds)
    rendered = render_revision(policy(), cm, live).daemonset["spec"]["template"]["spec"]
    # The user's own affinity survives; ours (which would contradict the nodeSelector) does not.
    assert rendered["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [user_term]}
    plain = copy.deepcopy(ds)
    del plain["spec"]["template"]["spec"]["affinity"]
    live_plain = affinity_patch_pair(plain)[0].apply(plain)  # type: ignore[index]  # plain has a pair
    assert "affinity" not in render_revision(policy(), cm, live_plain).daemonset["spec"]["template"]["spec"]


def test_baseline_without_the_config_volume_is_refused(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    ds = copy.deepcopy(ds)
    ds["spec"]["template"]["spec"]["volumes"] = [
        v for v in ds["spec"]["template"]["spec"]["volumes"] if "configMap" not in v]
    with pytest.raises(ValueError, match="mounts no ConfigMap named kube-proxy"):
        render_revision(policy(), cm, ds)


def test_configmap_without_a_kube_proxy_config_is_refused() -> None:
    cm = {"metadata": {"name": "kube-proxy"}, "data": {"other": "x: 1"}}
    with pytest.raises(ValueError, match="no KubeProxyConfiguration"):
        render_revision(policy(), cm, load("daemonset", "baseline"))


def test_config_under_another_key_is_found() -> None:
    cm = load("configmap", "baseline")
    cm["data"] = {"kube-proxy.yaml": cm["data"]["config.conf"]}
    rev = render_revision(policy(), cm, load("daemonset", "baseline"))
    assert yaml.safe_load(rev.configmap["data"]["kube-proxy.yaml"])["mode"] == "nftables"


def test_kubeadm_empty_mode_baseline_parses() -> None:
    config = KubeProxyConfiguration.from_yaml(load("configmap", "kubeadm")["data"]["config.conf"])
    assert config.mode == ""  # kubeadm's "" means iptables on Linux


@pytest.mark.parametrize("length", [1, 30, 41, 42, 52, 63, 64, 200, 253])
def test_long_policy_names_fit(length: int) -> None:
    name = ("p" * length)[:length]
    rev = revision_name(name, "0123456789")
    assert len(rev) <= MAX_REVISION and is_label_value(rev) and is_dns_subdomain(rev)
    cm_name, ds_name = revision_object_names(rev)
    assert len(ds_name) <= 63 and is_dns_subdomain(cm_name)
    assert is_label_value(policy_label_value(name))


def test_long_names_with_a_common_prefix_stay_distinct() -> None:
    a, b = "team-" + "x" * 60 + "-a", "team-" + "x" * 60 + "-b"
    assert revision_name(a, "0123456789") != revision_name(b, "0123456789")
    assert policy_label_value(a) != policy_label_value(b)


def test_short_names_are_kept_verbatim() -> None:
    assert revision_name("blue", "0123456789") == "blue-0123456789"
    assert policy_label_value("blue.pool") == "blue.pool"


def test_long_policy_renders_valid_objects(baseline: tuple[dict, dict]) -> None:
    cm, ds = baseline
    name = "a" * 120 + "." + "b" * 120
    rev = render_revision(policy(name), cm, ds)
    for obj in (rev.configmap, rev.daemonset):
        assert obj["metadata"]["annotations"][ANNOTATION_POLICY] == name
        assert all(is_label_value(v) for v in obj["metadata"]["labels"].values())
        assert len(obj["metadata"]["name"]) <= 63


def test_projected_config_volume_is_repointed() -> None:
    cm, ds = load("configmap", "kubeadm"), load("daemonset", "kubeadm")
    volumes = ds["spec"]["template"]["spec"]["volumes"]
    volumes[0] = {"name": "kube-proxy", "projected": {"sources": [{"configMap": {"name": "kube-proxy"}},
                                                                  {"configMap": {"name": "other"}}]}}
    rev = render_revision(policy(), cm, ds)
    sources = rev.daemonset["spec"]["template"]["spec"]["volumes"][0]["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == [rev.configmap["metadata"]["name"], "other"]
