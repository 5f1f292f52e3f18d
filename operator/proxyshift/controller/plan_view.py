"""`proxyshift plan -f policy.yaml`: what a policy would do to the current cluster; changes nothing.

Reads Nodes, ProxyNodes (the agents' inventory), existing policies and the
baseline kube-proxy, then asks the pure planner's preview: which nodes, in what
order and stages, and which will fail preflight.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import UTC, datetime

import kubernetes
from pydantic import ValidationError

from proxyshift.api.common import API_GROUP, API_VERSION
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller.settings import CONFIG
from proxyshift.controller.snapshot import current_revisions, node_view, revision_view
from proxyshift.controller.status_view import load_api
from proxyshift.manifest import UsageError, read_manifest
from proxyshift.planner.advice import advise
from proxyshift.planner.preview import preview
from proxyshift.planner.world import World
from proxyshift.render import LABEL_MANAGED_BY, MANAGED_BY


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
    nodes = {}
    for n in core.list_node().items:
        conditions = [{"type": c.type, "status": c.status} for c in (n.status.conditions or [])]
        nodes[n.metadata.name] = node_view(n.metadata.name, n.metadata.labels or {},
                                           {"unschedulable": n.spec.unschedulable}, {"conditions": conditions})
    proxynodes = {p["metadata"]["name"]: ProxyNode.model_validate(p)
                  for p in custom.list_cluster_custom_object(API_GROUP, API_VERSION, "proxynodes")["items"]}
    policies: dict[str, ProxyPolicy] = {}
    for body in custom.list_cluster_custom_object(API_GROUP, API_VERSION, "proxypolicies")["items"]:
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
        raise SystemExit(errors[policy.name])
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
            problems = stage.preflight_failures.get(name)
            if not problems:
                verdict = "ok"
            elif all(p.startswith("no inventory yet") for p in problems):
                verdict = "preflight unknown: " + "; ".join(problems)
            else:
                verdict = "WILL FAIL PREFLIGHT: " + "; ".join(problems)
            lines.append(f"  {name:<30} {world.nodes[name].revision or 'baseline':<28} {verdict}")
    conflicts = [n for n, pn in world.proxynodes.items() if pn.spec.policy not in (None, policy.name)
                 and policy.spec.node_selector.matches(world.nodes.get(n).labels if n in world.nodes else {})]
    if conflicts:
        lines.append(f"owned by other policies (untouched unless those are newer): {', '.join(sorted(conflicts)[:20])}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="proxyshift plan", description="Show what a policy would do.")
    parser.add_argument("-f", "--filename", required=True, help="ProxyPolicy manifest ('-' for stdin)")
    parser.add_argument("--kubeconfig")
    args = parser.parse_args(list(argv))
    policy = read_policy(args.filename)
    load_api(args.kubeconfig)
    world = read_world(policy)
    print(render_preview(policy, world))
    tip = advise(*cluster_size(), world.baseline_mode)
    if tip:
        print(f"advice: {tip}")
    return 0


def cluster_size() -> tuple[int, int]:
    """(Services, endpoints) of the cluster: what a full kube-proxy sync has to write."""
    services = kubernetes.client.CoreV1Api().list_service_for_all_namespaces().items
    slices = kubernetes.client.DiscoveryV1Api().list_endpoint_slice_for_all_namespaces().items
    return len(services), sum(len(s.endpoints or []) for s in slices)

