"""`proxyshift plan`: which nodes each stage will take, in order, and which will fail preflight.

The prediction reads the inventory the agents already reported in ProxyNode.status (modules,
kernel, tool versions); the real preflight on the node stays the authority.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ForeignIPVS, ProxyNode
from proxyshift.modes import (
    DEFAULT_MODE,
    FOREIGN_IPVS_CHANGE,
    IPVS_PRUNES_UNEXCLUDED,
    MODE_FACTS,
    NFTABLES_DELETES_IPVS,
    deletes_foreign_ipvs,
    described_address,
    outside_exclude_cidrs,
    prunes_unexcluded_ipvs,
    version_text,
)
from proxyshift.planner.compat import CompatFinding, compatibility
from proxyshift.planner.ordering import node_key
from proxyshift.planner.ownership import compute_ownership
from proxyshift.planner.planner import stage_targets
from proxyshift.planner.services import EndpointView, ServiceView
from proxyshift.planner.world import World

BASELINE_SOURCE = "baseline"


@dataclass(frozen=True)
class PreviewStage:
    stage: int  # 1-based, as a person counts
    target: int  # cumulative number of updated nodes at the end of the stage
    pause: str | None
    nodes: list[str]  # in the order they will be migrated
    preflight_failures: dict[str, list[str]] = field(default_factory=dict)  # node -> problems
    preflight_notes: dict[str, list[str]] = field(default_factory=dict)  # node -> what a passing preflight accepts


def _version(text: str | None, parts: int) -> tuple[int, ...] | None:
    if not text:
        return None
    match = re.search(r"(\d+(?:\.\d+)*)", text)
    if not match:
        return None
    numbers = [int(x) for x in match.group(1).split(".")][:parts]
    return tuple(numbers + [0] * (parts - len(numbers)))


def predict_preflight(pn: ProxyNode | None, policy: ProxyPolicy) -> list[str]:
    """Problems the node's preflight will report, judging from the inventory its agent published."""
    if pn is None or (pn.status.heartbeat is None and not pn.status.kernel_release):
        return ["no inventory yet: the node's agent has not reported"]
    mode = policy.spec.mode
    have = set(pn.status.modules)
    tools = pn.status.tools
    facts = MODE_FACTS[mode]
    problems = []
    if facts.min_kernel is not None:
        kernel = _version(pn.status.kernel_release, 2)
        if kernel is None or kernel < facts.min_kernel:
            problems.append(f"kernel {pn.status.kernel_release or 'unknown'} is older than "
                            f"{version_text(facts.min_kernel)} ({mode} needs it)")
    for need in facts.tools:
        if need.min_version is None:
            if need.tool not in tools:
                problems.append(f"{need.tool} not found ({mode} mode needs it)")
            continue
        found = _version(tools.get(need.tool), len(need.min_version))
        if found is None or found < need.min_version:
            problems.append(f"{need.tool} {tools.get(need.tool) or 'not found'}: {mode} mode needs "
                            f"{need.tool} >= {version_text(need.min_version)}")
    needed = [need.module for need in facts.modules(policy.spec.scheduler)]
    foreign = pn.status.foreign_ipvs
    if deletes_foreign_ipvs(mode) and foreign is not None and foreign.count and not accepts_foreign_ipvs(policy):
        problems.append(f"{foreign.describe()}: {NFTABLES_DELETES_IPVS}; accept it with gate.behaviour.allowChanges: "
                        f"[{FOREIGN_IPVS_CHANGE}]")
    pruned = pruned_by_ipvs(foreign, policy)
    if pruned is not None and not accepts_foreign_ipvs(policy):
        problems.append(f"{pruned.describe()}: {IPVS_PRUNES_UNEXCLUDED}; add their addresses to spec.ipvs.excludeCIDRs "
                        f"or accept it with gate.behaviour.allowChanges: [{FOREIGN_IPVS_CHANGE}]")
    needed += list(policy.spec.preflight.extra_modules or [])
    missing = [m for m in needed if m not in have]
    if missing:
        verb = "will be loaded (loadModules)" if policy.spec.preflight.load_modules else "missing"
        if not policy.spec.preflight.load_modules:
            problems.append(f"kernel modules {verb}: {', '.join(missing)}")
    return problems


def pruned_by_ipvs(foreign: ForeignIPVS | None, policy: ProxyPolicy) -> ForeignIPVS | None:
    """The foreign virtual servers an ipvs kube-proxy of this policy would delete (outside the policy's
    excludeCIDRs; the baseline's are not known here, the node's preflight decides), None when none or not ipvs.
    Those past the status's bounded list are counted as deleted: their addresses are not known."""
    if not prunes_unexcluded_ipvs(policy.spec.mode) or foreign is None or not foreign.count:
        return None
    excluded = list((policy.spec.ipvs.exclude_cidrs if policy.spec.ipvs else None) or [])
    listed = [t for t in foreign.virtual_servers if outside_exclude_cidrs(described_address(t), excluded)]
    unlisted = max(0, foreign.count - len(foreign.virtual_servers))
    count = len(listed) + unlisted
    return ForeignIPVS(count=count, virtual_servers=listed) if count else None


def accepts_foreign_ipvs(policy: ProxyPolicy) -> bool:
    return FOREIGN_IPVS_CHANGE in (policy.spec.gate.behaviour.allow_changes or [])


def preflight_notes(pn: ProxyNode | None, policy: ProxyPolicy) -> list[str]:
    """What the node's preflight will pass only because the policy accepts it (a person should still know)."""
    foreign = pn.status.foreign_ipvs if pn is not None else None
    if deletes_foreign_ipvs(policy.spec.mode) and foreign is not None and foreign.count and accepts_foreign_ipvs(
            policy):
        return [f"{FOREIGN_IPVS_CHANGE} accepted: the switch deletes {foreign.describe()}"]
    pruned = pruned_by_ipvs(foreign, policy)
    if pruned is not None and accepts_foreign_ipvs(policy):
        return [f"{FOREIGN_IPVS_CHANGE} accepted: the ipvs kube-proxy deletes {pruned.describe()} at its first sync"]
    return []


@dataclass(frozen=True)
class ForeignIPVSNode:
    """A node the policy would move to nftables that holds IPVS virtual servers that are not kube-proxy's."""

    node: str
    count: int
    virtual_servers: tuple[str, ...]
    accepted: bool  # the policy names ForeignIPVSFlush: preflight passes and the switch deletes them


def foreign_ipvs_nodes(world: World, policy_name: str) -> list[ForeignIPVSNode]:
    """From the agents' inventory (status.foreignIPVS), in migration order; empty unless the target is nftables."""
    policy = world.policies[policy_name]
    if not deletes_foreign_ipvs(policy.spec.mode):
        return []
    found = []
    for stage in preview(world, policy_name):
        for name in stage.nodes:
            pn = world.proxynodes.get(name)
            foreign = pn.status.foreign_ipvs if pn is not None else None
            if foreign is not None and foreign.count:
                found.append(ForeignIPVSNode(name, foreign.count, tuple(foreign.virtual_servers),
                                             accepts_foreign_ipvs(policy)))
    return found


def preview(world: World, policy_name: str) -> list[PreviewStage]:
    policy = world.policies[policy_name]
    ownership = compute_ownership(world)
    rendered = world.current_revisions.get(policy_name)
    names = sorted(
        (n for n, own in ownership.items() if own.owner == policy_name and policy_name in own.selected_by),
        key=lambda n: (node_key(n), n),
    )
    total = len(names)
    todo = [n for n in names if rendered is None or world.nodes[n].revision != rendered.name]
    done = total - len(todo)
    stages = policy.spec.rollout.stages
    targets = stage_targets(policy, total) if stages else [total]
    pauses = [s.pause for s in stages] if stages else [None]
    result, taken = [], 0
    for index, (target, pause) in enumerate(zip(targets, pauses, strict=True)):
        count = max(0, target - done - taken)
        batch = todo[taken : taken + count]
        taken += len(batch)
        failures, notes = {}, {}
        for name in batch:
            problems = predict_preflight(world.proxynodes.get(name), policy)
            if problems:
                failures[name] = problems
            accepted = preflight_notes(world.proxynodes.get(name), policy)
            if accepted:
                notes[name] = accepted
        result.append(PreviewStage(index + 1, target, pause, batch, failures, notes))
    return result


@dataclass(frozen=True)
class CompatGroup:
    """The nodes that would move from one source (the baseline or a revision), and what the move changes."""

    source: str  # BASELINE_SOURCE or the revision name the nodes run now
    mode: str  # the source's kube-proxy mode
    nodes: list[str]
    findings: list[CompatFinding]


def node_source(world: World, name: str) -> tuple[str, str]:
    """(source, mode) a node runs now: its revision when the operator knows it, else the baseline."""
    revision = world.nodes[name].revision
    if revision and revision in world.revisions:
        return revision, world.revisions[revision].mode or world.baseline_mode
    return BASELINE_SOURCE, world.baseline_mode


def compat_preview(
    world: World,
    policy_name: str,
    configs: Mapping[str, KubeProxyConfiguration | None],
    to_config: KubeProxyConfiguration | None,
    services: Iterable[ServiceView],
    endpoints: Iterable[EndpointView],
) -> list[CompatGroup]:
    """The compatibility report per source among the nodes the policy would move.

    `configs` maps a source (BASELINE_SOURCE or a revision name) to the KubeProxyConfiguration its
    nodes run, None where it is unknown (kube-proxy's defaults are assumed); a baseline config's
    own mode wins over world.baseline_mode.
    """
    services, endpoints = list(services), list(endpoints)
    policy_mode = world.policies[policy_name].spec.mode
    groups: dict[tuple[str, str], list[str]] = {}
    for stage in preview(world, policy_name):
        for name in stage.nodes:
            source, mode = node_source(world, name)
            if source == BASELINE_SOURCE and (baseline := configs.get(BASELINE_SOURCE)) is not None:
                mode = baseline.mode or DEFAULT_MODE
            groups.setdefault((source, mode), []).append(name)
    to_mode = (to_config.mode if to_config else None) or policy_mode
    return [CompatGroup(source, mode, nodes,
                        compatibility(mode, configs.get(source), to_mode, to_config, services, endpoints))
            for (source, mode), nodes in sorted(groups.items())]
