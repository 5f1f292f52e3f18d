"""Revision rendering: kube-proxy ConfigMaps/DaemonSets per policy config, their hashes, the baseline's JSON
patches and the server-side apply bookkeeping. No I/O."""

from proxyshift.render.affinity import (
    affinity_patch_pair,
    baseline_affinity_patch,
    undo_baseline_affinity_patch,
    without_revision_affinity,
)
from proxyshift.render.apply import APPLY_PATCH, FIELD_MANAGER, foreign_spec_owners, take_spec_ownership
from proxyshift.render.immutable import needs_recreate
from proxyshift.render.kubeproxyconfig import config_hash, render_config
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
from proxyshift.render.replacement import node_config_name, node_config_names
from proxyshift.render.revision import RenderedRevision, render_revision, revision_labels

__all__ = [
    "ANNOTATION_CONFIG_HASH",
    "ANNOTATION_MODE",
    "ANNOTATION_POLICY",
    "APPLY_PATCH",
    "FIELD_MANAGER",
    "LABEL_MANAGED_BY",
    "LABEL_POLICY",
    "LABEL_REVISION",
    "MANAGED_BY",
    "RenderedRevision",
    "affinity_patch_pair",
    "baseline_affinity_patch",
    "config_hash",
    "foreign_spec_owners",
    "needs_recreate",
    "node_config_name",
    "node_config_names",
    "policy_label_value",
    "render_config",
    "render_revision",
    "revision_labels",
    "revision_name",
    "revision_object_names",
    "take_spec_ownership",
    "undo_baseline_affinity_patch",
    "without_revision_affinity",
]
