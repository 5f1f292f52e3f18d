"""The parts of KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) proxyshift touches.

A baseline config read from the cluster carries many fields we do not model;
every model here keeps unknown fields (extra="allow") so rendering a revision
never drops a setting the cluster's operator chose.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml
from pydantic import ConfigDict, Field

from proxyshift.api.common import KubeModel

KUBE_PROXY_CONFIG_API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"


class _Preserving(KubeModel):
    model_config = ConfigDict(
        alias_generator=KubeModel.model_config["alias_generator"],
        populate_by_name=True,
        extra="allow",
    )
    # A baseline's explicit nulls are part of its shape; rendering keeps them.
    null_means_unset = False


class KPIPVSConfiguration(_Preserving):
    scheduler: str | None = None
    strict_arp: bool | None = Field(default=None, alias="strictARP")
    sync_period: str | None = None
    min_sync_period: str | None = None
    tcp_timeout: str | None = None
    tcp_fin_timeout: str | None = None
    udp_timeout: str | None = None
    exclude_cidrs: list[str] | None = Field(default=None, alias="excludeCIDRs")


class KPIPTablesConfiguration(_Preserving):
    masquerade_all: bool | None = None
    masquerade_bit: int | None = None
    min_sync_period: str | None = None
    sync_period: str | None = None
    localhost_node_ports: bool | None = None


class KPNFTablesConfiguration(_Preserving):
    masquerade_all: bool | None = None
    masquerade_bit: int | None = None
    min_sync_period: str | None = None
    sync_period: str | None = None


class KPConntrackConfiguration(_Preserving):
    max_per_core: int | None = None
    min: int | None = None
    tcp_established_timeout: str | None = None
    tcp_close_wait_timeout: str | None = None
    tcp_be_liberal: bool | None = None
    udp_timeout: str | None = None
    udp_stream_timeout: str | None = None


class KubeProxyConfiguration(_Preserving):
    api_version: str = KUBE_PROXY_CONFIG_API_VERSION
    kind: str = "KubeProxyConfiguration"
    mode: str | None = None
    ipvs: KPIPVSConfiguration | None = None
    iptables: KPIPTablesConfiguration | None = None
    nftables: KPNFTablesConfiguration | None = None
    conntrack: KPConntrackConfiguration | None = None
    feature_gates: dict[str, bool] | None = None
    # CIDRs and the keywords primary, localhost, all. Unset: every local address in iptables and
    # ipvs mode, the primary node IPs in nftables mode (kube-proxy 1.37's defaulting).
    node_port_addresses: list[str] | None = None
    metrics_bind_address: str | None = None
    healthz_bind_address: str | None = None

    @classmethod
    def from_yaml(cls, text: str) -> KubeProxyConfiguration:
        # A copy of the parse: callers overlay the policy's settings on what they get.
        return _parse_config(text).model_copy(deep=True)

    def to_dict(self) -> dict[str, Any]:
        # exclude_unset keeps the baseline's shape: only what was there plus what we set.
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True, default_flow_style=False)


@functools.lru_cache(maxsize=64)
def _parse_config(text: str) -> KubeProxyConfiguration:
    """One parse per distinct config text. The operator renders every policy on the baseline's config at
    every step; pure-Python YAML made that most of each step's time (py-spy: ~85% at four nodes)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        # A ValueError like every other unreadable baseline, with the parser's own line and column.
        raise ValueError(f"kube-proxy config.conf is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise ValueError("kube-proxy config.conf is not a YAML mapping")
    if data.get("kind", "KubeProxyConfiguration") != "KubeProxyConfiguration":
        raise ValueError(f"kube-proxy config.conf has kind {data.get('kind')!r}, not KubeProxyConfiguration")
    return KubeProxyConfiguration.model_validate(data)
