"""`proxyshift status [POLICY] [--watch] [-o json|yaml]`: the rollout as a person (or a script) wants to see it.

Exit code (docs/cli.md): 0 when every policy shown is Ready, 1 when one is not (or --until-done ended
Degraded or timed out), 2 for bad input, an unknown policy or a cluster that cannot be used.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, cast

import kubernetes
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.api.diagnostics import NodeDistribution
from proxyshift.controller.cliargs import add_cluster_flags, add_output_flag, cluster_errors, load_api
from proxyshift.manifest import UsageError
from proxyshift.planner.diagnosis import distribution_lines
from proxyshift.planner.reports import EXIT_NOT_READY, EXIT_OK, FAILED_PHASES, StatusReport, dump, status_report
from proxyshift.planner.services import EndpointView, ServiceView, endpoints_from_slice, service_view_from_k8s

TERMINAL_PHASES = frozenset({"Ready", "Degraded"})


def age(stamp: str | None, now: datetime) -> str:
    if not stamp:
        return "-"
    seconds = int((now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    if seconds < 120:
        return f"{max(seconds, 0)}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total if total else width
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def condition_line(cond: dict[str, Any]) -> str:
    return f"{cond.get('type')}={cond.get('status')} ({cond.get('reason')}): {cond.get('message', '')}"


def render_policies(policies: list[dict[str, Any]]) -> str:
    rows = [["NAME", "MODE", "PHASE", "PROGRESS", "REVISION"]]
    for p in sorted(policies, key=lambda p: p["metadata"]["name"]):
        st = p.get("status") or {}
        rows.append([p["metadata"]["name"], p["spec"].get("mode", ""), st.get("phase") or "-",
                     st.get("progress") or "-", st.get("currentRevision") or "-"])
    return table(rows)


def shown_phase(node: dict[str, Any]) -> str:
    """The node's phase as the planner sees it: a Preflight the agent passed is Prepared (not written)."""
    spec, st = node.get("spec") or {}, node.get("status") or {}
    phase = str((spec.get("migration") or {}).get("phase") or "Pending")
    op, last = spec.get("operation") or {}, st.get("lastOperation") or {}
    passed = op.get("type") == "Preflight" and op.get("id") and last.get("id") == op.get("id") \
        and last.get("state") == "Succeeded"
    return "Prepared" if phase == "Preflight" and passed else phase


def render_policy(policy: dict[str, Any], proxynodes: list[dict[str, Any]], now: datetime) -> str:
    name = policy["metadata"]["name"]
    st = policy.get("status") or {}
    counts = st.get("nodes") or {}
    lines = [
        f"ProxyPolicy {name}: mode {policy['spec'].get('mode')}  phase {st.get('phase') or 'Pending'}"
        f"  revision {st.get('currentRevision') or '-'}",
        "progress " + bar(int(counts.get("updated", 0)), int(counts.get("selected", 0))),
    ]
    lines += ["  " + condition_line(c) for c in st.get("conditions") or [] if c.get("status") == "True"]
    owned = [n for n in proxynodes if (n.get("spec") or {}).get("policy") == name]
    if owned:
        rows = [["NODE", "PHASE", "MODE", "TARGET", "SINCE", "LEFTOVERS", "LAST ERROR"]]
        for node in sorted(owned, key=lambda n: n["metadata"]["name"]):
            spec, nst = node.get("spec") or {}, node.get("status") or {}
            mig = spec.get("migration") or {}
            error = mig.get("message") if mig.get("phase") in FAILED_PHASES else ""
            rows.append([
                node["metadata"]["name"], shown_phase(node), nst.get("observedMode") or "?",
                spec.get("mode") or "baseline", age(mig.get("phaseSince"), now),
                ",".join(nst.get("leftovers") or []) or "-", (error or "")[:80],
            ])
        lines += ["", table(rows)]
    for failure in st.get("failed") or []:
        lines.append(f"  failed {failure.get('name')}: {failure.get('reason')}: {failure.get('message', '')}")
    return "\n".join(lines)


def read(api: kubernetes.client.CustomObjectsApi, policy: str | None) -> tuple[list[dict[str, Any]],
                                                                          list[dict[str, Any]] | None]:
    """The policies to show (all, or the one named) and, for one policy, every ProxyNode."""
    # The custom-objects API types its answers `object`: they are the decoded JSON, dicts here.
    if policy is None:
        listed = cast(dict[str, Any], api.list_cluster_custom_object(API_GROUP, API_VERSION, "proxypolicies"))
        return listed["items"], None
    try:
        body = cast(dict[str, Any], api.get_cluster_custom_object(API_GROUP, API_VERSION, "proxypolicies", policy))
    except ApiException as exc:
        if exc.status == 404:
            raise UsageError(f"ProxyPolicy {policy!r} not found") from None
        raise
    return [body], cast(dict[str, Any], api.list_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes"))["items"]


def render_table(api: kubernetes.client.CustomObjectsApi, policy: str | None) -> tuple[str, StatusReport]:
    policies, nodes = read(api, policy)
    report = status_report(policies, nodes)
    if nodes is None:
        return (render_policies(policies) if policies else "no ProxyPolicies"), report
    text = render_policy(policies[0], nodes, datetime.now(UTC))
    lines = distribution_section([n for n in nodes if (n.get("spec") or {}).get("policy") == policy])
    return text + ("\n\n" + "\n".join(lines) if lines else ""), report


MAX_DISTRIBUTION_NODES = 10  # status shows the move's effect on the first nodes that recorded it


def distribution_section(proxynodes: list[dict[str, Any]]) -> list[str]:
    """How each recorded Service's load looked on a node before and after its move (status.distribution)."""
    recorded: list[tuple[str, NodeDistribution]] = []
    for pn in sorted(proxynodes, key=lambda n: n["metadata"]["name"]):
        raw = (pn.get("status") or {}).get("distribution")
        if raw:
            try:
                recorded.append((pn["metadata"]["name"], NodeDistribution.model_validate(raw)))
            except ValidationError:
                continue  # an agent's malformed record is left out, not shown half
    recorded = recorded[:MAX_DISTRIBUTION_NODES]
    keys = {c.service for _, d in recorded for side in (d.before, d.after) if side for c in side.services}
    if not keys:
        return []
    services, endpoints = _read_services(sorted(keys))
    lines = ["traffic distribution before -> after the move:"]
    for node, d in recorded:
        lines += ["  " + line for line in distribution_lines(node, d.before, d.after, services, endpoints)]
    return lines if len(lines) > 1 else []


def _read_services(keys: list[str]) -> tuple[dict[str, ServiceView], dict[str, list[EndpointView]]]:
    core, discovery = kubernetes.client.CoreV1Api(), kubernetes.client.DiscoveryV1Api()
    client = kubernetes.client.ApiClient()
    services: dict[str, ServiceView] = {}
    endpoints: dict[str, list[EndpointView]] = {}
    for key in keys:
        namespace, name = key.split("/", 1)
        try:
            view = service_view_from_k8s(client.sanitize_for_serialization(
                core.read_namespaced_service(name, namespace)))
            slices = discovery.list_namespaced_endpoint_slice(
                namespace, label_selector=f"kubernetes.io/service-name={name}").items
        except ApiException as exc:
            if exc.status == 404:
                continue  # deleted since it was recorded
            raise
        if view is not None:
            services[key] = view
            endpoints[key] = [e for s in slices for e in endpoints_from_slice(client.sanitize_for_serialization(s))]
    return services, endpoints


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="proxyshift status", description="Show a policy's rollout.")
    parser.add_argument("policy", nargs="?", help="ProxyPolicy name (default: list all)")
    add_cluster_flags(parser)
    add_output_flag(parser)
    parser.add_argument("-w", "--watch", action="store_true",
                        help="redraw every interval (with -o json|yaml: print each changed report)")
    parser.add_argument("--until-done", action="store_true",
                        help="with --watch: exit when the policy is Ready (0) or Degraded (1)")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=0,
                        help="with --until-done: give up after N s (exit 1)")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    api = load_api(args.kubeconfig, args.context)
    started = time.monotonic()
    last = None
    while True:
        with cluster_errors():
            if args.output == "table":
                text, report = render_table(api, args.policy)
            else:
                policies, nodes = read(api, args.policy)
                report = status_report(policies, nodes)
                text = dump(report, args.output)
        phase = report.policies[0].phase if args.policy is not None and report.policies else None
        if args.output != "table":
            if text != last:
                # A watch prints a stream of documents; YAML needs the separator to stay one stream.
                print(("---\n" if args.watch and args.output == "yaml" else "") + text, flush=True)
            last = text
        else:
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(text + ("\n" if args.watch else ""), flush=True)
        if not args.watch:
            return report.exit_code
        if args.until_done and phase in TERMINAL_PHASES:
            return EXIT_OK if phase == "Ready" else EXIT_NOT_READY
        if args.timeout and time.monotonic() - started > args.timeout:
            print(f"timed out after {args.timeout:g}s in phase {phase}", file=sys.stderr)
            return EXIT_NOT_READY
        time.sleep(args.interval)
