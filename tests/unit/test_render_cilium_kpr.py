"""A cilium-kpr revision (issue 19): no kube-proxy DaemonSet, a ConfigMap that records it, the CiliumNodeConfig
that turns Cilium's kube-proxy replacement on for its nodes; and the executor that applies and deletes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller import executor as ex
from proxyshift.controller import snapshot
from proxyshift.planner import world as w
from proxyshift.render import LABEL_REVISION, node_config_names, render_revision
from proxyshift.render.names import is_label_value
from proxyshift.render.replacement import NODE_CONFIG_KEY

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).parent.parent / "fixtures" / "baseline"
LABEL = "proxyshift.io/kube-proxy-replacement"


def baseline() -> tuple[dict[str, Any], dict[str, Any]]:
    cm = yaml.safe_load((FIXTURES / "kube-proxy-configmap.yaml").read_text())
    ds = yaml.safe_load((FIXTURES / "kube-proxy-daemonset.yaml").read_text())
    return cm, ds


def policy(name: str = "blue", **spec: Any) -> ProxyPolicy:
    return ProxyPolicy.model_validate({
        "metadata": {"name": name, "uid": "u-1", "generation": 1},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": "cilium-kpr", **spec},
    })


def test_a_cilium_kpr_revision_has_no_daemonset_and_a_cilium_node_config() -> None:
    cm, ds = baseline()
    rendered = render_revision(policy(cilium={"loadBalancerAlgorithm": "maglev", "hostNamespaceOnly": False},
                                      nodePortAddresses=["198.18.0.0/15", "fd00::/8"]), cm, ds)
    assert rendered.kube_proxy_daemonset is None and rendered.mode == "cilium-kpr"
    config = rendered.node_config
    assert config is not None
    assert (config["apiVersion"], config["kind"]) == ("cilium.io/v2", "CiliumNodeConfig")
    assert config["metadata"]["name"] == f"proxyshift-{rendered.name}"
    assert config["metadata"]["namespace"] == "kube-system"
    # Its nodes: the ones handed to Cilium AND on this revision (two policies' settings never mix on a node).
    assert config["spec"]["nodeSelector"] == {"matchLabels": {LABEL: "cilium", LABEL_REVISION: rendered.name}}
    assert config["spec"]["defaults"] == {"kube-proxy-replacement": "true", "bpf-lb-algorithm": "maglev",
                                          "bpf-lb-sock-hostns-only": "false",
                                          "nodeport-addresses": "198.18.0.0/15,fd00::/8"}
    # The ConfigMap is the revision's record: the operator's revision index reads it as it reads a DaemonSet.
    record = rendered.configmap
    assert record["metadata"]["name"] == f"kube-proxy-{rendered.name}"
    assert yaml.safe_load(record["data"][NODE_CONFIG_KEY]) == config["spec"]["defaults"]
    view = snapshot.revision_view(record)
    assert view is not None and (view.name, view.policy, view.mode) == (rendered.name, "blue", "cilium-kpr")
    assert rendered.labels[LABEL_REVISION] == rendered.name


def test_a_baseline_edit_does_not_move_cilium_kpr_nodes_but_a_setting_does() -> None:
    cm, ds = baseline()
    first = render_revision(policy(), cm, ds)
    edited = dict(cm, data={k: v.replace("iptables", "nftables") for k, v in cm["data"].items()})
    assert render_revision(policy(), edited, ds).name == first.name
    assert render_revision(policy(cilium={"loadBalancerAlgorithm": "maglev"}), cm, ds).name != first.name
    # The default socket is the agent's business, not the node's config: no new revision for it.
    assert render_revision(policy(cilium={"socketPath": "/run/c.sock"}), cm, ds).name == first.name


@given(name=st.from_regex(r"[a-z]([a-z0-9-]{0,80}[a-z0-9])?", fullmatch=True),
       algorithm=st.sampled_from([None, "random", "maglev"]), host_only=st.sampled_from([None, True, False]),
       addresses=st.one_of(st.none(), st.lists(st.sampled_from(["198.18.0.0/15", "198.19.0.0/16", "fd00::/8"]),
                                               min_size=1, max_size=3, unique=True)))
def test_render_properties_of_cilium_kpr_revisions(name: str, algorithm: str | None, host_only: bool | None,
                                                   addresses: list[str] | None) -> None:
    cm, ds = baseline()
    cilium = {k: v for k, v in (("loadBalancerAlgorithm", algorithm), ("hostNamespaceOnly", host_only))
              if v is not None}
    rendered = render_revision(policy(name, cilium=cilium, nodePortAddresses=addresses), cm, ds)
    config = rendered.node_config
    assert config is not None and rendered.kube_proxy_daemonset is None
    defaults = config["spec"]["defaults"]
    assert defaults["kube-proxy-replacement"] == "true"
    assert all(isinstance(v, str) for v in defaults.values())  # Cilium reads its options as strings
    assert ("bpf-lb-algorithm" in defaults) == (algorithm is not None)
    assert ("nodeport-addresses" in defaults) == (addresses is not None)
    assert is_label_value(rendered.name) and is_label_value(config["metadata"]["name"])
    assert config["metadata"]["name"] in {n for _, _, n in node_config_names(rendered.name)}
    assert render_revision(policy(name, cilium=cilium, nodePortAddresses=addresses), cm, ds) == rendered


class RecordingAPI:
    def __init__(self, missing_kind: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.cm, self.ds = baseline()
        self.missing_kind = missing_kind

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args if not kwargs else (*args, kwargs)))
            if name == "apply_node_config" and self.missing_kind:
                raise ApiException(status=404, reason="the server could not find the requested resource")
            if name == "read_configmap":
                return self.cm
            if name == "read_daemonset":
                return self.ds
            return "101"

        return record


def test_the_executor_applies_the_node_config_before_the_record_and_no_daemonset() -> None:
    api = RecordingAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # RecordingAPI has the calls the executor makes
    p = policy()
    name = render_revision(p, api.cm, api.ds).name
    executor.perform(w.EnsureRevision(policy="blue", revision=name), {"blue": p})
    kinds = [c[0] for c in api.calls if c[0].startswith("apply_")]
    assert kinds == ["apply_node_config", "apply_configmap"]
    # The baseline kube-proxy still learns to stay off labelled nodes: a KPR node must not run it either.
    assert any(c[0] == "json_patch_daemonset" for c in api.calls)
    executor.perform(w.DeleteRevision(revision=name), {})
    assert ("delete_node_config", ("cilium.io/v2", "CiliumNodeConfig", f"proxyshift-{name}")) in api.calls
    assert ("delete_configmap", (f"kube-proxy-{name}",)) in api.calls


def test_a_cluster_without_cilium_crds_blocks_the_revision_with_words() -> None:
    api = RecordingAPI(missing_kind=True)
    executor = ex.Executor(api)  # type: ignore[arg-type]  # RecordingAPI has the calls the executor makes
    p = policy()
    name = render_revision(p, api.cm, api.ds).name
    with pytest.raises(ex.StepBlocked, match=r"does not serve CiliumNodeConfig \(cilium.io/v2\): install Cilium"):
        executor.perform(w.EnsureRevision(policy="blue", revision=name), {"blue": p})
    assert not any(c[0] == "apply_configmap" for c in api.calls), "no record of a revision that cannot work"


def test_the_executor_moves_the_replacement_label_with_the_revision_label() -> None:
    api = RecordingAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # RecordingAPI has the calls the executor makes
    executor.perform(w.SetRevisionLabel(node="n1", revision="blue-1", reason="Switching",
                                        labels=((LABEL, "cilium"),)), {})
    assert ("set_node_label", ("n1", LABEL_REVISION, "blue-1", {"with_labels": {LABEL: "cilium"}})) in api.calls


def test_asking_a_cilium_kpr_revision_for_its_daemonset_is_an_error_not_a_none() -> None:
    cm, ds = baseline()
    with pytest.raises(ValueError, match=r"runs no kube-proxy DaemonSet"):
        _ = render_revision(policy(), cm, ds).daemonset
