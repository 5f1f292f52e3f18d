"""A revision of a mode that replaces kube-proxy (Cilium's KPR): its per-node config and its record. Pure.

Cilium's documented per-node migration ("Kubernetes Without kube-proxy", per-node configuration): a
CiliumNodeConfig (cilium.io/v2, in Cilium's namespace) whose nodeSelector picks the labelled nodes and whose
defaults set `kube-proxy-replacement: "true"`; the Cilium agent reads it when it starts on such a node. The
object's kind and settings are the mode's facts (proxyshift.modes.cilium_kpr); ours selects the replacement
label AND the node's revision label, so two policies' revisions with different settings never both apply to
one node.

Such a revision runs no kube-proxy DaemonSet. Its ConfigMap (`kube-proxy-<revision>`, the name every revision's
ConfigMap has) carries the same settings as text: it is the revision's record in any cluster, with or without
Cilium's CRDs, and an object the admission policies already let the operator write.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from proxyshift.modes import MODE_FACTS, ModeFacts
from proxyshift.render.names import HASH_LENGTH, LABEL_REVISION

# The ConfigMap data key that records the node config of a replacement revision.
NODE_CONFIG_KEY = "kube-proxy-replacement.yaml"
NODE_CONFIG_PREFIX = "proxyshift-"


def node_config_name(revision: str) -> str:
    """`proxyshift-<revision>`: a revision is at most 52 characters, so this is a valid label value too."""
    return f"{NODE_CONFIG_PREFIX}{revision}"


def node_config_names(revision: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every node config a revision of any replacement mode could have: a revision's
    deletion removes them without knowing its mode (the kinds a cluster does not serve answer 404)."""
    kinds = sorted({f.replacement.node_config_kind for f in MODE_FACTS.values() if f.replacement is not None})
    return [(api_version, kind, node_config_name(revision)) for api_version, kind in kinds]


def node_config_hash(mode: str, settings: dict[str, str]) -> str:
    """The revision's hash: the mode and its node settings, canonical. The baseline kube-proxy's config is not in
    it: no kube-proxy runs such a revision, so a baseline edit must not move its nodes."""
    canonical = json.dumps({"mode": mode, "defaults": settings}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]


def render_node_config(facts: ModeFacts, revision: str, namespace: str, labels: dict[str, str],
                       annotations: dict[str, str], settings: dict[str, str]) -> dict[str, Any]:
    if facts.replacement is None:
        raise ValueError(f"mode {facts.mode} replaces no kube-proxy: it has no node config")
    key, value = facts.replacement.node_label
    api_version, kind = facts.replacement.node_config_kind
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": node_config_name(revision), "namespace": namespace, "labels": dict(labels),
                     "annotations": dict(annotations)},
        "spec": {
            "nodeSelector": {"matchLabels": {key: value, LABEL_REVISION: revision}},
            "defaults": dict(settings),
        },
    }


def node_config_text(settings: dict[str, str]) -> str:
    return yaml.safe_dump(settings, sort_keys=True, default_flow_style=False)
