"""Server-side apply on the local cluster, the operator running as its ServiceAccount (issue 16, item 7).

A revision applied again unchanged writes nothing (no new resourceVersion, no new generation, the node's
kube-proxy pod keeps running); a rendered field someone changed is applied back; the managedFields say
`proxyshift`, operation Apply; and a ProxyNode spec keeps its replace semantics against another manager's
fields while the agent's status is left alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client, config

from proxyshift.controller.kube import ClusterAPI
from tests.support.operator_harness import GROUP, REVISION_LABEL, VERSION, Harness, policy, service_account_kubeconfig

pytestmark = pytest.mark.e2e

GREEN = "ps-node-3"
READY_TIMEOUT = 420


def _actions(h: Harness, policy_name: str, action: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{h.operator.metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "proxyshift_actions_total" and s.labels == {"policy": policy_name, "action": action})


def _applied_by_proxyshift(meta: client.V1ObjectMeta | dict[str, Any]) -> bool:
    entries = meta.managed_fields if isinstance(meta, client.V1ObjectMeta) else meta.get("managedFields")
    pairs = {(e.manager, e.operation) if isinstance(e, client.V1ManagedFieldsEntry)
             else (e["manager"], e["operation"]) for e in entries or []}
    return ("proxyshift", "Apply") in pairs


def test_an_unchanged_revision_is_not_written_again_and_a_changed_one_is(harness: Harness) -> None:
    h = harness
    h.apply(policy("green-apply", "nftables", pool="green", deletionPolicy="Revert"))
    h.wait_condition("green-apply", "Ready", READY_TIMEOUT)
    revision = h.node_labels(GREEN)[REVISION_LABEL]
    name = f"kube-proxy-{revision}"
    apps, core = client.AppsV1Api(h.api_client), h.core

    def state() -> tuple[Any, Any, str]:
        ds = apps.read_namespaced_daemon_set(name, "kube-system")
        cm = core.read_namespaced_config_map(name, "kube-system")
        pods = core.list_namespaced_pod("kube-system", label_selector=f"{REVISION_LABEL}={revision}").items
        assert [p.spec.node_name if p.spec else None for p in pods] == [GREEN]
        uid = pods[0].metadata.uid if pods[0].metadata else None
        assert uid is not None
        return ds, cm, uid

    ds, cm, pod_uid = state()
    assert _applied_by_proxyshift(ds.metadata) and _applied_by_proxyshift(cm.metadata)
    assert _applied_by_proxyshift(h.proxynodes()[GREEN]["metadata"])

    # Reconciles: every plan applies the current revision again; touching the policy makes plans.
    before = _actions(h, "green-apply", "EnsureRevision")
    for i in range(3):
        h.patch("green-apply", {"metadata": {"annotations": {"e2e.proxyshift.io/touch": str(i)}}})
        time.sleep(2)
    h.wait_for(lambda: _actions(h, "green-apply", "EnsureRevision") >= before + 2, 60,
               "the operator to apply the revision again")
    ds2, cm2, pod_uid2 = state()
    assert (ds2.metadata.resource_version, ds2.metadata.generation) == (ds.metadata.resource_version,
                                                                       ds.metadata.generation)
    assert cm2.metadata.resource_version == cm.metadata.resource_version
    assert pod_uid2 == pod_uid  # no rollout

    # A rendered field changed by someone else (another field manager) is applied back at the next plan.
    apps.patch_namespaced_daemon_set(name, "kube-system", {"spec": {"revisionHistoryLimit": 3}},
                                     field_manager="e2e-person")
    assert apps.read_namespaced_daemon_set(name, "kube-system").spec.revision_history_limit == 3
    h.patch("green-apply", {"metadata": {"annotations": {"e2e.proxyshift.io/touch": "drift"}}})
    h.wait_for(lambda: apps.read_namespaced_daemon_set(name, "kube-system").spec.revision_history_limit
               == ds.spec.revision_history_limit, 60, "the rendered revisionHistoryLimit to be applied back")
    ds3, _, pod_uid3 = state()
    assert ds3.metadata.generation == ds.metadata.generation + 2  # the edit and the apply, nothing more
    assert pod_uid3 == pod_uid  # not a pod template field: still no rollout

    h.delete("green-apply", wait=READY_TIMEOUT)


def test_a_proxynode_spec_is_replaced_whatever_else_wrote_it(cluster: Any, harness: Harness,
                                                             tmp_path: Path) -> None:
    """As the operator's ServiceAccount, on a ProxyNode of no Node (so neither the operator nor an agent
    writes it meanwhile): fields the apply leaves out go, also those another manager set; status stays."""
    h = harness
    kubeconfig = service_account_kubeconfig(cluster, "proxyshift-operator", tmp_path / "operator.kubeconfig")
    api = ClusterAPI(config.new_client_from_config(config_file=str(kubeconfig)))
    name = "ps-e2e-apply"
    custom = h.custom
    try:
        api.ensure_proxynode(name, None, {"policy": "p", "revision": "p-1", "mode": "nftables"})
        custom.patch_cluster_custom_object_status(GROUP, VERSION, "proxynodes", name,
                                                  {"status": {"observedMode": "iptables"}})
        # Another manager sets a spec field the operator never applied.
        custom.patch_cluster_custom_object(GROUP, VERSION, "proxynodes", name, {"spec": {"scheduler": "rr"}},
                                           field_manager="e2e-person")
        rv = api.ensure_proxynode(name, None, {"policy": "p", "revision": None, "mode": "nftables"})
        live = cast(dict[str, Any], custom.get_cluster_custom_object(GROUP, VERSION, "proxynodes", name))
        assert live["spec"] == {"policy": "p", "mode": "nftables"}
        assert live["status"]["observedMode"] == "iptables"
        spec_owners = {(e["manager"], e["operation"]) for e in live["metadata"]["managedFields"]
                       if "f:spec" in (e.get("fieldsV1") or {})}
        assert spec_owners == {("proxyshift", "Apply")}
        # Applied again unchanged: no write.
        assert api.ensure_proxynode(name, None, {"policy": "p", "mode": "nftables"}) == rv
        # A merge (the inventory's, EnsureProxyNode's) keeps the rest of the spec.
        api.ensure_proxynode(name, None, {"policy": "q"}, replace=False)
        live = cast(dict[str, Any], custom.get_cluster_custom_object(GROUP, VERSION, "proxynodes", name))
        assert live["spec"] == {"policy": "q", "mode": "nftables"}
    finally:
        try:
            custom.delete_cluster_custom_object(GROUP, VERSION, "proxynodes", name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
