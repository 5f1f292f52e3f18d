"""The Services side of the operator's world, mirrored: Services, EndpointSlices, ServiceCIDRs and the
pod-network probe servers. They feed the Service-behaviour sample (which Services a node is probed
with, which endpoints are local to it, where its pod path starts) and the conntrack step (which
destinations are Service addresses).

None of these changes wakes a rollout: a sample taken a moment late is still a sample, and waking every
policy on every EndpointSlice update would turn a busy cluster's churn into planning load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller.mirror import Mirror
from proxyshift.controller.rest import Collection
from proxyshift.controller.settings import CONFIG
from proxyshift.controller.snapshot import probe_pod_endpoint
from proxyshift.planner.services import EndpointView, ServiceView, endpoints_from_slice, service_view_from_k8s
from proxyshift.planner.world import ServiceSide

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MAX_SERVICE_CIDRS = 8


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _service_item(obj: dict[str, Any]) -> tuple[str, ServiceView] | None:
    view = service_view_from_k8s(obj)
    return (_key(obj), view) if view is not None else None


def _slice_item(obj: dict[str, Any]) -> tuple[str, tuple[EndpointView, ...]] | None:
    if not ((obj.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL):
        return None
    return _key(obj), tuple(endpoints_from_slice(obj))


def _cidr_item(obj: dict[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    name = (obj.get("metadata") or {}).get("name")
    cidrs = (obj.get("spec") or {}).get("cidrs") or []
    return (str(name), tuple(str(c) for c in cidrs if isinstance(c, str))) if name else None


def _probe_item(obj: dict[str, Any]) -> tuple[str, tuple[str, str]] | None:
    found = probe_pod_endpoint(obj)
    return (_key(obj), found) if found is not None else None


def _quiet(*_: Any) -> None:
    pass


def service_mirrors() -> dict[str, Mirror]:
    # Raw collections, not the typed API classes (controller/rest.py says why).
    return {
        "services": Mirror("services", Collection("/api/v1/services").list, _service_item, _quiet),
        "endpointslices": Mirror("endpointslices", Collection("/apis/discovery.k8s.io/v1/endpointslices").list,
                                 _slice_item, _quiet),
        "servicecidrs": Mirror("servicecidrs", Collection("/apis/networking.k8s.io/v1/servicecidrs").list,
                               _cidr_item, _quiet),
        "probepods": Mirror("probepods", Collection(f"/api/v1/namespaces/{CONFIG.probe_namespace}/pods").list,
                            _probe_item, _quiet, kwargs={"label_selector": CONFIG.probe_pod_label}),
    }


def service_world(mirrors: Mapping[str, Mirror]) -> ServiceSide:
    if "services" not in mirrors:
        return ServiceSide()
    endpoints = tuple(view for views in mirrors["endpointslices"].items.values() for view in views)
    cidrs = sorted({c for found in mirrors["servicecidrs"].items.values() for c in found})[:MAX_SERVICE_CIDRS]
    return ServiceSide(
        services=dict(mirrors["services"].items),
        endpoints=endpoints,
        service_cidrs=tuple(cidrs),
        probe_pods=dict(mirrors["probepods"].items.values()),
    )


def probe_service_ips(side: ServiceSide, policy: ProxyPolicy) -> dict[str, str]:
    """ClusterIPs of the Services the policy's gate connects to ("namespace/name" -> IP), from the mirror
    of every Service the behaviour sample reads anyway (headless ones have none)."""
    ips: dict[str, str] = {}
    for ref in policy.spec.gate.probe_services or []:
        view = side.services.get(f"{ref.namespace}/{ref.name}")
        if view is not None and not view.headless and view.cluster_ips:
            ips[view.key] = view.cluster_ips[0]
    return ips
