"""The KubeProxyConfiguration a revision runs, and its hash.

The rendered config is the baseline's config with the policy's mode and mode
settings laid on top; every field of the baseline that proxyshift does not
model is kept. The hash covers exactly what kube-proxy reads from the file,
in a canonical form (sorted keys, no whitespace), so dict ordering never
matters and any value kube-proxy would see differently gives a new hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from proxyshift.api.kubeproxy import KPConntrackConfiguration, KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicySpec
from proxyshift.modes import MODE_FACTS, overlay
from proxyshift.render.names import HASH_LENGTH

CONFIG_KEY = "config.conf"


def find_config_key(configmap: dict[str, Any]) -> str:
    """The data key holding the KubeProxyConfiguration (kubeadm: config.conf)."""
    data: dict[str, Any] = configmap.get("data") or {}
    if CONFIG_KEY in data:
        return CONFIG_KEY
    for key, text in sorted(data.items()):
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(parsed, dict) and parsed.get("kind") == "KubeProxyConfiguration":
            return key
    name = (configmap.get("metadata") or {}).get("name", "?")
    raise ValueError(f"ConfigMap {name} holds no KubeProxyConfiguration (looked for {CONFIG_KEY})")


def baseline_config(configmap: dict[str, Any]) -> KubeProxyConfiguration:
    return KubeProxyConfiguration.from_yaml(configmap["data"][find_config_key(configmap)])


def render_config(spec: ProxyPolicySpec, baseline: KubeProxyConfiguration) -> KubeProxyConfiguration:
    """Baseline config + the policy's mode, mode settings, nodePortAddresses and conntrack settings.

    The baseline is not modified; what the policy leaves unset keeps the baseline's value.
    """
    config = baseline.model_copy(deep=True)
    config.mode = spec.mode
    # Each mode renders its own section (spec.<mode>; proxyshift.modes.<mode>.render_settings).
    MODE_FACTS[spec.mode].render_settings(config, spec)
    if spec.node_port_addresses is not None:
        config.node_port_addresses = list(spec.node_port_addresses)
    if spec.conntrack is not None:
        config.conntrack = config.conntrack or KPConntrackConfiguration()
        overlay(config.conntrack, spec.conntrack)
    return config


def canonical_json(config: KubeProxyConfiguration) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def config_hash(config: KubeProxyConfiguration) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:HASH_LENGTH]
