"""`proxyshift diagnose service NAMESPACE/NAME [--node N ...]`: why is this Service's load uneven?

Reads the Service and its EndpointSlices, asks each node's agent (ProxyNode.spec.diagnose) for what its
kernel counted, waits for the answers (bounded), and prints per node: the mode, the Service's rules or
virtual servers, each endpoint's share and readiness, and the verdict (planner/diagnosis.py) with the
likely causes; with several nodes also the verdict over all of them.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NoReturn, cast

import kubernetes
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.api.diagnostics import DiagnoseRequest, NodeDiagnostics, ServiceCounters
from proxyshift.controller.cliargs import add_cluster_flags, cluster_errors, load_api
from proxyshift.controller.status_view import table
from proxyshift.manifest import UsageError
from proxyshift.planner.diagnosis import Diagnosis, combine, diagnose, request_service
from proxyshift.planner.services import (
    SERVICE_NAME_LABEL,
    EndpointView,
    ServiceView,
    endpoints_from_slice,
    service_view_from_k8s,
)

DEFAULT_TIMEOUT_SECONDS = 15.0
MAX_TIMEOUT_SECONDS = 300.0
POLL_SECONDS = 0.3
MAX_NODES = 64  # a diagnosis is read by a person; name nodes with --node on a larger cluster
ALL_NODES = "all nodes"


def parse_target(text: str) -> tuple[str, str]:
    namespace, _, name = text.partition("/")
    if not namespace or not name or "/" in name:
        raise UsageError(f"{text!r}: give the Service as NAMESPACE/NAME")
    return namespace, name


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2 (proxyshift.cli), not usage + error
        raise UsageError(f"{message} (usage: proxyshift diagnose service NAMESPACE/NAME [--node N ...] "
                         "[--kubeconfig K] [--context C] [--timeout S])")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="proxyshift diagnose",
                                description="each endpoint's share of a Service's traffic from the nodes' kernel "
                                "counters, and why it is uneven")
    p.add_argument("kind", help="what to diagnose: service")
    p.add_argument("target", help="NAMESPACE/NAME of the Service")
    p.add_argument("--node", action="append", default=[], help="only this node (repeatable; default every node)")
    add_cluster_flags(p)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                   help=f"seconds to wait for the nodes' answers (default {DEFAULT_TIMEOUT_SECONDS:g})")
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        raise SystemExit(0 if argv else 2)
    if argv[0] != "service":
        raise UsageError(f"cannot diagnose {argv[0]!r}: only 'service NAMESPACE/NAME' is known")
    args = p.parse_args(list(argv))
    if not 0 < args.timeout <= MAX_TIMEOUT_SECONDS:
        raise UsageError(f"--timeout {args.timeout:g}: give seconds between 0 and {MAX_TIMEOUT_SECONDS:g}")
    parse_target(args.target)
    return args


# ---- rendering (pure) ----

def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def render_diagnosis(d: Diagnosis, endpoints: Sequence[EndpointView]) -> list[str]:
    nodes = {e.address: e.node_name or "-" for e in endpoints}
    rows = [["ENDPOINT", "READY", "NODE", d.basis.upper(), "SHARE", "CONNTRACK ESTABLISHED"]]
    for s in d.shares:
        ready = "-" if s.ready is None else ("yes" if s.ready else "NO")
        rows.append([s.address, ready, nodes.get(s.address, "(not in any EndpointSlice)"), str(s.count),
                     _pct(s.share) if d.total else "-", str(s.established)])
    lines = ["  " + line for line in table(rows).splitlines()]
    p = f", p={d.p_value:.3g}" if d.p_value is not None else ""
    lines.append(f"  verdict: {d.verdict} ({d.total} {d.basis}{p})")
    lines += [f"  cause {c.name}: {c.message}" for c in d.causes]
    return lines


def render(service: ServiceView, endpoints: Sequence[EndpointView], answers: dict[str, NodeDiagnostics | None],
           timeout: float) -> str:
    lines = [f"Service {service.key}: {service.type}, ClusterIPs {', '.join(service.cluster_ips) or '-'}, "
             f"sessionAffinity {service.session_affinity}, internalTrafficPolicy "
             f"{service.internal_traffic_policy}, externalTrafficPolicy {service.external_traffic_policy}",
             f"EndpointSlices: {sum(e.ready for e in endpoints)}/{len(endpoints)} endpoints ready"]
    answered: list[ServiceCounters] = []
    for node in sorted(answers):
        answer = answers[node]
        lines.append("")
        if answer is None:
            lines.append(f"node {node}: no answer within {timeout:g}s (is its proxyshift agent running?)")
            continue
        if answer.error:
            lines.append(f"node {node}: the agent could not read its counters: {answer.error}")
            continue
        counters = next((s for s in answer.services if s.service == service.key), None)
        if counters is None:
            lines.append(f"node {node}: the answer has no counters for {service.key}")
            continue
        answered.append(counters)
        head = f"node {node}: mode {answer.mode or 'unknown'}, counters from {counters.source}"
        if answer.duration_seconds is not None:
            head += f" (read in {answer.duration_seconds:g}s)"
        if counters.scheduler:
            head += f", ipvs scheduler {counters.scheduler}"
        if counters.persistence_seconds:
            head += f", persistence {counters.persistence_seconds}s"
        lines.append(head + (" (output truncated: counts are partial)" if counters.truncated else ""))
        lines += [f"  rules: {r}" for r in counters.rules] or ["  rules: none found for this Service"]
        lines += [f"  could not read: {e}" for e in counters.errors]
        lines += render_diagnosis(diagnose(service, endpoints, node, counters, answer.mode), endpoints)
    if len(answered) > 1:
        lines += ["", f"{ALL_NODES} ({len(answered)} nodes):"]
        lines += render_diagnosis(diagnose(service, endpoints, ALL_NODES, combine(answered)), endpoints)
    return "\n".join(lines)


# ---- the cluster ----

def _request_id(clock: Callable[[], float]) -> str:
    return f"diagnose-{int(clock())}-{secrets.token_hex(3)}"


def read_service(namespace: str, name: str) -> tuple[ServiceView, list[EndpointView]]:
    client = kubernetes.client.ApiClient()
    core, discovery = kubernetes.client.CoreV1Api(client), kubernetes.client.DiscoveryV1Api(client)
    try:
        body = client.sanitize_for_serialization(core.read_namespaced_service(name, namespace))
    except ApiException as exc:
        if exc.status == 404:
            raise UsageError(f"no Service {namespace}/{name}") from None
        raise
    view = service_view_from_k8s(body)
    if view is None:
        raise UsageError(f"Service {namespace}/{name} cannot be read")
    slices = discovery.list_namespaced_endpoint_slice(namespace, label_selector=f"{SERVICE_NAME_LABEL}={name}")
    endpoints = [e for s in slices.items for e in endpoints_from_slice(client.sanitize_for_serialization(s))]
    return view, endpoints


def ask_nodes(custom: Any, nodes: list[str], request: DiagnoseRequest, timeout: float,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> dict[str, NodeDiagnostics | None]:
    """Write the request to each node's ProxyNode and collect the answers until the deadline."""
    body = {"spec": {"diagnose": request.to_k8s()}}
    for node in nodes:
        custom.patch_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes", node, body)
    answers: dict[str, NodeDiagnostics | None] = dict.fromkeys(nodes)
    deadline = clock() + timeout
    while True:
        for node in [n for n, a in answers.items() if a is None]:
            obj = custom.get_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes", node)
            found = (obj.get("status") or {}).get("diagnostics") or {}
            if found.get("id") == request.id:
                try:
                    answers[node] = NodeDiagnostics.model_validate(found)
                except ValidationError as exc:
                    answers[node] = NodeDiagnostics(id=request.id, error=f"unreadable answer: {exc}"[:400])
            elif ((obj.get("spec") or {}).get("diagnose") or {}).get("id") != request.id:
                # The operator replaces a ProxyNode's spec whole during a migration; ask again.
                custom.patch_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes", node, body)
        if all(a is not None for a in answers.values()) or clock() >= deadline:
            return answers
        sleep(POLL_SECONDS)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    namespace, name = parse_target(args.target)
    custom = load_api(args.kubeconfig, args.context)
    with cluster_errors():
        service, endpoints = read_service(namespace, name)
        if service.headless or not service.cluster_ips:
            print(f"Service {service.key} is headless: kube-proxy writes no rules for it, clients pick "
                  "endpoints themselves (DNS), so there is nothing on the nodes to count")
            return 0
        # The custom-objects API types its answers `object`: they are the decoded JSON, dicts here.
        listed = cast(dict[str, Any], custom.list_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes"))
        known = sorted(p["metadata"]["name"] for p in listed["items"])
        unknown = [n for n in args.node if n not in known]
        if unknown:
            raise UsageError(f"no ProxyNode for {', '.join(unknown)} (known: {', '.join(known[:10]) or 'none'})")
        nodes = args.node or known
        if len(nodes) > MAX_NODES:
            raise UsageError(f"{len(nodes)} nodes: name up to {MAX_NODES} with --node")
        if not nodes:
            raise UsageError("no ProxyNodes in this cluster: is proxyshift installed?")
        request = DiagnoseRequest(id=_request_id(time.time), services=[request_service(service, endpoints)],
                                  requested_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        answers = ask_nodes(custom, nodes, request, args.timeout)
    print(render(service, endpoints, answers, args.timeout))
    return 0 if any(a is not None for a in answers.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
