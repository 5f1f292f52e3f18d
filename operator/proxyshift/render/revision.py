"""Render a policy's revision: the kube-proxy ConfigMap and DaemonSet in kube-system that run its config.

Like a Deployment's ReplicaSets: one revision per distinct rendered
KubeProxyConfiguration, named `<policy>-<hash>`. Everything that is not about
the config or the node selection (image, command, env, tolerations, volumes,
priority, update strategy) comes from the baseline DaemonSet, so a revision
runs the cluster's own kube-proxy, only differently configured.

Revision objects carry no ownerReference to the policy on purpose: with
deletionPolicy Orphan the nodes stay on the revision after the policy is gone,
and garbage collection would delete the DaemonSet under them, leaving those
nodes without any kube-proxy (the baseline avoids them by its affinity).
The operator deletes a revision itself once no node uses it.

A mode that replaces kube-proxy (its facts say kube_proxy False: Cilium's KPR) renders no DaemonSet: its
revision is a ConfigMap that records the node config and, for the replacement itself, a CiliumNodeConfig
(render/replacement.py). Moving a node onto it takes the node's kube-proxy away by the same label.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import yaml

from proxyshift.api.policy import ProxyMode, ProxyPolicy
from proxyshift.modes import MODE_FACTS
from proxyshift.render.affinity import without_revision_affinity
from proxyshift.render.kubeproxyconfig import baseline_config, config_hash, find_config_key, render_config
from proxyshift.render.names import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_MODE,
    ANNOTATION_POLICY,
    LABEL_MANAGED_BY,
    LABEL_POLICY,
    LABEL_REVISION,
    MANAGED_BY,
    policy_label_value,
    revision_name,
    revision_object_names,
)
from proxyshift.render.replacement import NODE_CONFIG_KEY, node_config_hash, node_config_text, render_node_config

DEFAULT_NAMESPACE = "kube-system"


@dataclass(frozen=True)
class RenderedRevision:
    """Everything the operator needs to create (or compare) one revision."""

    name: str
    hash: str
    mode: ProxyMode
    configmap: dict[str, Any]
    # The kube-proxy DaemonSet that runs the revision; None for a mode that replaces kube-proxy.
    kube_proxy_daemonset: dict[str, Any] | None
    # What the revision runs: the KubeProxyConfiguration, or (no kube-proxy) the replacement's node config.
    config: dict[str, Any]
    # The replacement's own per-node config (Cilium's CiliumNodeConfig); None for a kube-proxy mode.
    node_config: dict[str, Any] | None = None

    @property
    def daemonset(self) -> dict[str, Any]:
        """The kube-proxy DaemonSet, for a revision that has one (ask kube_proxy_daemonset when it may not)."""
        if self.kube_proxy_daemonset is None:
            raise ValueError(f"revision {self.name} ({self.mode}) runs no kube-proxy DaemonSet")
        return self.kube_proxy_daemonset

    @property
    def labels(self) -> dict[str, str]:
        """proxyshift's own labels on its objects (policy, revision, managed-by), for selecting them."""
        return {k: v for k, v in self.configmap["metadata"]["labels"].items() if k.startswith("proxyshift.io/")}


def revision_labels(policy: str, revision: str) -> dict[str, str]:
    return {
        LABEL_POLICY: policy_label_value(policy),
        LABEL_REVISION: revision,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def _object_metadata(baseline: dict[str, Any], name: str, labels: dict[str, str], hash_: str) -> dict[str, Any]:
    # Only identity and our labels: uid, resourceVersion, managedFields, kubectl/kubeadm
    # annotations and the like belong to the baseline object, not to a new one.
    meta = baseline.get("metadata") or {}
    return {
        "name": name,
        "namespace": meta.get("namespace") or DEFAULT_NAMESPACE,
        "labels": {**(meta.get("labels") or {}), **labels},
        "annotations": {ANNOTATION_CONFIG_HASH: hash_},
    }


def _point_volumes_at(pod_spec: dict[str, Any], old_cm: str, new_cm: str) -> int:
    """Re-point every volume that mounts the baseline ConfigMap; returns how many were changed."""
    changed = 0
    for volume in pod_spec.get("volumes") or []:
        cm = volume.get("configMap")
        if cm is not None and cm.get("name") == old_cm:
            cm["name"] = new_cm
            changed += 1
        for source in (volume.get("projected") or {}).get("sources") or []:
            cm = source.get("configMap")
            if cm is not None and cm.get("name") == old_cm:
                cm["name"] = new_cm
                changed += 1
    return changed


def render_configmap(
    baseline_cm: dict[str, Any], name: str, labels: dict[str, str], hash_: str, config_yaml: str
) -> dict[str, Any]:
    data = dict(baseline_cm.get("data") or {})
    data[find_config_key(baseline_cm)] = config_yaml
    cm: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _object_metadata(baseline_cm, name, labels, hash_),
        "data": data,
    }
    if baseline_cm.get("binaryData"):
        cm["binaryData"] = dict(baseline_cm["binaryData"])
    return cm


def render_daemonset(
    baseline_ds: dict[str, Any], baseline_cm_name: str, name: str, cm_name: str,
    labels: dict[str, str], hash_: str,
) -> dict[str, Any]:
    spec = copy.deepcopy(baseline_ds["spec"])
    revision = labels[LABEL_REVISION]

    # The selector must not equal the baseline's, or two DaemonSets would claim the same pods.
    selector = spec.setdefault("selector", {})
    selector["matchLabels"] = {**(selector.get("matchLabels") or {}), LABEL_REVISION: revision}

    template = spec.setdefault("template", {})
    tmeta = template.setdefault("metadata", {})
    tmeta.pop("creationTimestamp", None)
    # Pods keep the baseline's labels (k8s-app=kube-proxy: dashboards and scrapers find them);
    # the baseline DaemonSet never adopts them because they carry our DaemonSet as controller.
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}
    tmeta["annotations"] = {**(tmeta.get("annotations") or {}), ANNOTATION_CONFIG_HASH: hash_}

    pod = template.setdefault("spec", {})
    pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), LABEL_REVISION: revision}
    # A live baseline carries our "revision label DoesNotExist" affinity; copied here it
    # would contradict the nodeSelector above and the revision would run nowhere.
    affinity = without_revision_affinity(pod.get("affinity"))
    if affinity:
        pod["affinity"] = affinity
    else:
        pod.pop("affinity", None)
    if _point_volumes_at(pod, baseline_cm_name, cm_name) == 0:
        raise ValueError(
            f"baseline DaemonSet {baseline_ds.get('metadata', {}).get('name')} mounts no ConfigMap "
            f"named {baseline_cm_name}: cannot point it at the revision's config"
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _object_metadata(baseline_ds, name, labels, hash_),
        "spec": spec,
    }


def render_revision(
    policy: ProxyPolicy, baseline_configmap: dict[str, Any], baseline_daemonset: dict[str, Any]
) -> RenderedRevision:
    """The revision a policy renders to on top of the baseline kube-proxy. Pure: no I/O, inputs untouched."""
    if not MODE_FACTS[policy.spec.mode].kube_proxy:
        return render_replacement_revision(policy, baseline_configmap)
    policy_name = policy.name
    config = render_config(policy.spec, baseline_config(baseline_configmap))
    hash_ = config_hash(config)
    revision = revision_name(policy_name, hash_)
    cm_name, ds_name = revision_object_names(revision)
    labels = revision_labels(policy_name, revision)
    config_dict = config.to_dict()
    config_yaml = config_text(json.dumps(config_dict, sort_keys=True))
    baseline_cm_name = (baseline_configmap.get("metadata") or {}).get("name", "kube-proxy")
    configmap = render_configmap(baseline_configmap, cm_name, labels, hash_, config_yaml)
    daemonset = render_daemonset(baseline_daemonset, baseline_cm_name, ds_name, cm_name, labels, hash_)
    for obj in (configmap, daemonset):
        obj["metadata"]["annotations"].update({ANNOTATION_POLICY: policy_name, ANNOTATION_MODE: policy.spec.mode})
    return RenderedRevision(
        name=revision,
        hash=hash_,
        mode=policy.spec.mode,
        configmap=configmap,
        kube_proxy_daemonset=daemonset,
        config=config_dict,
    )


def render_replacement_revision(policy: ProxyPolicy, baseline_configmap: dict[str, Any]) -> RenderedRevision:
    """A revision of a mode that replaces kube-proxy: a ConfigMap recording its node config, and the node config
    itself; no DaemonSet, so a node labelled with it runs no kube-proxy."""
    facts = MODE_FACTS[policy.spec.mode]
    if facts.replacement is None:
        raise ValueError(f"mode {policy.spec.mode} runs no kube-proxy and names no replacement")
    defaults = facts.replacement.node_config(policy.spec)
    hash_ = node_config_hash(policy.spec.mode, defaults)
    revision = revision_name(policy.name, hash_)
    cm_name, _ = revision_object_names(revision)
    labels = revision_labels(policy.name, revision)
    annotations = {ANNOTATION_CONFIG_HASH: hash_, ANNOTATION_POLICY: policy.name, ANNOTATION_MODE: policy.spec.mode}
    namespace = (baseline_configmap.get("metadata") or {}).get("namespace") or DEFAULT_NAMESPACE
    configmap: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": cm_name, "namespace": namespace, "labels": dict(labels),
                     "annotations": dict(annotations)},
        "data": {NODE_CONFIG_KEY: node_config_text(defaults)},
    }
    node_config = render_node_config(facts, revision, namespace, labels, annotations, defaults)
    return RenderedRevision(name=revision, hash=hash_, mode=policy.spec.mode, configmap=configmap,
                            kube_proxy_daemonset=None, config=dict(defaults), node_config=node_config)


@functools.lru_cache(maxsize=256)
def config_text(canonical: str) -> str:
    """The ConfigMap's config.conf for a rendered config (given as canonical JSON, so it can be a cache
    key): every step renders every policy, and the same config always dumps to the same text."""
    return yaml.safe_dump(json.loads(canonical), sort_keys=True, default_flow_style=False, allow_unicode=True)
