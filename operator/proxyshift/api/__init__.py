"""pydantic models of the proxyshift CRDs and of KubeProxyConfiguration: the single source of the API."""

from proxyshift.api.common import GROUP_VERSION, Condition, LabelSelector, parse_duration
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy, ProxyPolicySpec, ProxyPolicyStatus
from proxyshift.api.proxynode import ProxyNode, ProxyNodeSpec, ProxyNodeStatus

__all__ = [
    "GROUP_VERSION",
    "Condition",
    "KubeProxyConfiguration",
    "LabelSelector",
    "ProxyNode",
    "ProxyNodeSpec",
    "ProxyNodeStatus",
    "ProxyPolicy",
    "ProxyPolicySpec",
    "ProxyPolicyStatus",
    "parse_duration",
]
