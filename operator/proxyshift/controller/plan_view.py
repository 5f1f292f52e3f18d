"""`proxyshift plan -f policy.yaml`: what a policy would do to the current cluster; changes nothing.

Reads Nodes, ProxyNodes (the agents' inventory), existing policies and the
baseline kube-proxy, then asks the pure planner's preview: which nodes, in what
order and stages, and which will fail preflight; for a move to nftables, which
nodes hold IPVS virtual servers that are not kube-proxy's (the nftables
kube-proxy deletes them) and whether the policy accepts that. Then the compatibility report:
per mode the selected nodes run now, every behaviour the target mode changes for
this cluster's Services (read from Services and EndpointSlices) and the setting
that keeps today's behaviour.

`-o json|yaml` prints the same as a PlanReport (planner/reports.py, docs/cli.md). Exit code: 0 when no
node is predicted to fail preflight, 1 when one is, 2 for a bad manifest or a cluster that cannot be used.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import kubernetes
from pydantic import ValidationError

from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller.cliargs import add_cluster_flags, add_output_flag, cluster_errors, load_api
from proxyshift.controller.settings import CONFIG
from proxyshift.controller.snapshot import current_revisions, node_view, revision_view
from proxyshift.manifest import UsageError, read_manifest
from proxyshift.modes import FOREIGN_IPVS_CHANGE, NFTABLES_DELETES_IPVS
from proxyshift.planner.advice import advise
from proxyshift.planner.compat import CompatFinding
from proxyshift.planner.preview import (
    BASELINE_SOURCE,
    CompatGroup,
    ForeignIPVSNode,
    compat_preview,
    foreign_ipvs_nodes,
    preview,
)
from proxyshift.planner.reports import conflicting_nodes, dump, plan_report, preflight_verdict
from proxyshift.planner.services import EndpointView, ServiceView, endpoints_from_slice, service_view_from_k8s
from proxyshift.planner.world import NodeView, World
from proxyshift.render import LABEL_MANAGED_BY, MANAGED_BY
from proxyshift.render.kubeproxyconfig import baseline_config, render_config
from proxyshift.render.names import revision_object_names

# Bounds of what `plan` reads: pages of the list calls, and the most objects it looks at.
LIST_PAGE = 500
MAX_LISTED = 20_000


def read_policy(path: str) -> ProxyPolicy:
    body = read_manifest(path, "ProxyPolicy")
    if not isinstance(body.get("metadata"), dict):
        body["metadata"] = {}
    body["metadata"].setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    try:
        return ProxyPolicy.model_validate(body)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:10]]
        raise UsageError(f"{path}: the API server would refuse this policy: " + "; ".join(problems)) from None


def read_world(policy: ProxyPolicy) -> World:
    custom = kubernetes.client.CustomObjectsApi()
    core, apps = kubernetes.client.CoreV1Api(), kubernetes.client.AppsV1Api()
    ns = CONFIG.kube_proxy_namespace
    nodes: dict[str, NodeView] = {}
    for n in core.list_node().items:
        # A listed Node always has metadata (with its name), spec and status; the client types them Optional.
        meta = cast(kubernetes.client.V1ObjectMeta, n.metadata)
        name = cast(str, meta.name)
        status = cast(kubernetes.client.V1NodeStatus, n.status)
        conditions = [{"type": c.type, "status": c.status} for c in (status.conditions or [])]
        nodes[name] = node_view(name, meta.labels or {},
                                {"unschedulable": cast(kubernetes.client.V1NodeSpec, n.spec).unschedulable},
                                {"conditions": conditions})
    # The custom-objects API types its answers `object`: they are the decoded JSON, dicts here.
    listed_proxynodes = cast(dict[str, Any], custom.list_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes"))
    proxynodes = {p["metadata"]["name"]: ProxyNode.model_validate(p) for p in listed_proxynodes["items"]}
    listed_policies = cast(dict[str, Any], custom.list_cluster_custom_object(API_GROUP, API_VERSION, "proxypolicies"))
    policies: dict[str, ProxyPolicy] = {}
    for body in listed_policies["items"]:
        try:
            policies[body["metadata"]["name"]] = ProxyPolicy.model_validate(body)
        except ValidationError:
            continue
    policies[policy.name] = policy
    client = kubernetes.client.ApiClient()
    revisions = {}
    for ds in apps.list_namespaced_daemon_set(ns, label_selector=f"{LABEL_MANAGED_BY}={MANAGED_BY}").items:
        view = revision_view(client.sanitize_for_serialization(ds))
        if view:
            revisions[view.name] = view
    cm = client.sanitize_for_serialization(core.read_namespaced_config_map(CONFIG.baseline_configmap, ns))
    ds = client.sanitize_for_serialization(apps.read_namespaced_daemon_set(CONFIG.baseline_daemonset, ns))
    targets, errors = current_revisions(policies, cm, ds)
    if policy.name in errors:
        raise UsageError(f"policy {policy.name}: {errors[policy.name]}")
    return World(now=datetime.now(UTC), policies=policies, nodes=nodes, proxynodes=proxynodes,
                 revisions=revisions, kube_proxy_pods={}, current_revisions=targets)


def render_preview(policy: ProxyPolicy, world: World) -> str:
    stages = preview(world, policy.name)
    target = world.current_revisions[policy.name]
    lines = [f"ProxyPolicy {policy.name}: mode {policy.spec.mode} -> revision {target.name}"]
    total = sum(len(s.nodes) for s in stages)
    if total == 0:
        lines.append("no node would change (the selector matches none, or all already run this revision)")
    for stage in stages:
        pause = f", then pause {stage.pause}" if stage.pause else ""
        lines.append(f"stage {stage.stage}: up to {stage.target} nodes updated{pause}")
        for name in stage.nodes:
            problems = stage.preflight_failures.get(name, [])
            verdict = {"ok": "ok", "unknown": "preflight unknown: ", "fail": "WILL FAIL PREFLIGHT: "}[
                preflight_verdict(problems)] + "; ".join(problems)
            if not problems and stage.preflight_notes.get(name):
                verdict = "; ".join([verdict, *stage.preflight_notes[name]])
            lines.append(f"  {name:<30} {world.nodes[name].revision or 'baseline':<28} {verdict}")
    conflicts = conflicting_nodes(policy, world)
    if conflicts:
        lines.append(f"owned by other policies (untouched unless those are newer): {', '.join(conflicts[:20])}")
    lines += render_foreign_ipvs(foreign_ipvs_nodes(world, policy.name))
    return "\n".join(lines)


MAX_FOREIGN_NODES_SHOWN = 20


def render_foreign_ipvs(nodes: Sequence[ForeignIPVSNode]) -> list[str]:
    """The nodes holding IPVS virtual servers that are not kube-proxy's, which the move to nftables deletes."""
    if not nodes:
        return []
    accepted = nodes[0].accepted
    verdict = (f"accepted by gate.behaviour.allowChanges [{FOREIGN_IPVS_CHANGE}]: the switch deletes them" if accepted
               else f"refused: preflight fails on these nodes unless gate.behaviour.allowChanges names "
               f"{FOREIGN_IPVS_CHANGE}")
    lines = [f"foreign IPVS: {len(nodes)} node(s) hold IPVS virtual servers that are not kube-proxy's; "
             f"{NFTABLES_DELETES_IPVS}; {verdict}"]
    for entry in nodes[:MAX_FOREIGN_NODES_SHOWN]:
        more = entry.count - len(entry.virtual_servers)
        names = ", ".join(entry.virtual_servers) + (f" and {more} more" if more > 0 else "")
        lines.append(f"  {entry.node:<30} {'ACCEPTED' if entry.accepted else 'REFUSED'}: {entry.count} ({names})")
    if len(nodes) > MAX_FOREIGN_NODES_SHOWN:
        lines.append(f"  and {len(nodes) - MAX_FOREIGN_NODES_SHOWN} more node(s)")
    return lines


def _finding_lines(finding: CompatFinding) -> list[str]:
    if finding.preserved:
        return [f"  {finding.change:<20} kept by {finding.preserving}: {finding.summary}"]
    lines = [f"  {finding.change:<20} {finding.summary}"]
    if finding.service_count:
        more = finding.service_count - len(finding.services)
        names = ", ".join(finding.services) + (f" and {more} more" if more else "")
        lines.append(f"  {'':<20} affects {finding.service_count} Service(s): {names}")
    elif finding.change != "ForeignIPVSFlush":
        lines.append(f"  {'':<20} affects no Service in this cluster today")
    keep = f"keep today's behaviour with {finding.preserving}" if finding.preserving else (
        "no kube-proxy setting keeps today's behaviour")
    if finding.change == FOREIGN_IPVS_CHANGE:
        lines.append(f"  {'':<20} {keep}; preflight refuses a node holding virtual servers that are not "
                     f"kube-proxy's (listed under 'foreign IPVS' above) unless gate.behaviour.allowChanges: "
                     f"[{finding.change}]")
    else:
        lines.append(f"  {'':<20} {keep}; or accept it with gate.behaviour.allowChanges: [{finding.change}]"
                     if finding.change in _GATED else f"  {'':<20} {keep}")
    return lines


# The changes the behaviour gate can see on a node (the others it cannot probe).
_GATED = frozenset({"LocalhostNodePorts", "NodePortAddresses", "SessionAffinity", "TrafficPolicyLocal"})


def render_compat(policy: ProxyPolicy, groups: Sequence[CompatGroup]) -> str:
    """The compatibility report `plan -f` prints after the stage table."""
    if not groups:
        return "compatibility: no node would change mode or configuration"
    lines = []
    for group in groups:
        source = "the baseline kube-proxy" if group.source == BASELINE_SOURCE else f"revision {group.source}"
        shown = ", ".join(group.nodes[:5]) + (f" and {len(group.nodes) - 5} more" if len(group.nodes) > 5 else "")
        lines.append(f"compatibility: {group.mode} -> {policy.spec.mode} for {len(group.nodes)} node(s) on {source} "
                     f"({shown})")
        if not group.findings:
            lines.append("  no known behaviour difference")
        for finding in group.findings:
            lines.extend(_finding_lines(finding))
    return "\n".join(lines)


def _list_all(call: Callable[..., Any]) -> list[dict[str, Any]]:
    """Every item of a list call, page by page, up to MAX_LISTED."""
    client = kubernetes.client.ApiClient()
    items: list[dict[str, Any]] = []
    token = None
    while len(items) < MAX_LISTED:
        page = call(limit=LIST_PAGE, _continue=token) if token else call(limit=LIST_PAGE)
        items += [client.sanitize_for_serialization(i) for i in page.items or []]
        token = page.metadata._continue if page.metadata else None
        if not token:
            break
    return items[:MAX_LISTED]


def read_services() -> tuple[list[ServiceView], list[EndpointView]]:
    services = [v for b in _list_all(kubernetes.client.CoreV1Api().list_service_for_all_namespaces)
                if (v := service_view_from_k8s(b)) is not None]
    endpoints = [e for b in _list_all(kubernetes.client.DiscoveryV1Api().list_endpoint_slice_for_all_namespaces)
                 for e in endpoints_from_slice(b)]
    return services, endpoints


def read_configs(world: World) -> dict[str, KubeProxyConfiguration | None]:
    """The KubeProxyConfiguration each source runs: the baseline's, and every known revision's."""
    core, client = kubernetes.client.CoreV1Api(), kubernetes.client.ApiClient()
    ns = CONFIG.kube_proxy_namespace
    configs: dict[str, KubeProxyConfiguration | None] = {}
    names = {BASELINE_SOURCE: CONFIG.baseline_configmap} | {r: revision_object_names(r)[0] for r in world.revisions}
    for source, name in names.items():
        try:
            configs[source] = baseline_config(client.sanitize_for_serialization(
                core.read_namespaced_config_map(name, ns)))
        except (kubernetes.client.ApiException, ValueError, KeyError):
            configs[source] = None  # unknown: the report assumes kube-proxy's defaults for that mode
    return configs


def compat_groups(policy: ProxyPolicy, world: World, services: Sequence[ServiceView],
                  endpoints: Sequence[EndpointView],
                  configs: dict[str, KubeProxyConfiguration | None]) -> list[CompatGroup]:
    baseline = configs.get(BASELINE_SOURCE)
    to_config = render_config(policy.spec, baseline) if baseline is not None else None
    return compat_preview(world, policy.name, configs, to_config, services, endpoints)


def compat_report(policy: ProxyPolicy, world: World, services: Sequence[ServiceView],
                  endpoints: Sequence[EndpointView], configs: dict[str, KubeProxyConfiguration | None]) -> str:
    return render_compat(policy, compat_groups(policy, world, services, endpoints, configs))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="proxyshift plan", description="Show what a policy would do.")
    parser.add_argument("-f", "--filename", required=True, help="ProxyPolicy manifest ('-' for stdin)")
    add_cluster_flags(parser)
    add_output_flag(parser)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    policy = read_policy(args.filename)
    load_api(args.kubeconfig, args.context)
    with cluster_errors():
        world = read_world(policy)
        services, endpoints = read_services()
        configs = read_configs(world)
    groups = compat_groups(policy, world, services, endpoints, configs)
    # (Services, endpoints): what a full kube-proxy sync has to write.
    tip = advise(len(services), len(endpoints), world.baseline_mode)
    report = plan_report(policy, world, preview(world, policy.name), groups, tip, gated=_GATED)
    if args.output != "table":
        print(dump(report, args.output))
        return report.exit_code
    print(render_preview(policy, world))
    print(render_compat(policy, groups))
    if tip:
        print(f"advice: {tip}")
    return report.exit_code
