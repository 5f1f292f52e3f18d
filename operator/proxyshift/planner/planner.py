"""plan(world, policy) -> Plan: the rollout rules of one policy, pure.

Per call the planner (1) steps every node the policy has in flight one transition, (2) decides
whether and which new nodes may start (ownership, maxUnavailable, stages, pauses, halts), (3) keeps
the policy's revisions (EnsureRevision / DeleteRevision), handles deletion, and (4) writes the
status. The operator performs the actions in order, stopping at the first error, and calls again.
docs/planner.md states the rules in prose.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from datetime import datetime

from proxyshift.api.behaviour import MAX_NODE_PORTS, MAX_SERVICE_ADDRESSES, BehaviourParams, ConntrackParams
from proxyshift.api.common import parse_duration
from proxyshift.api.diagnostics import DiagnoseRequest
from proxyshift.api.policy import NodeFailure, NodeProgress, ProxyPolicy
from proxyshift.api.proxynode import NodeMigration, ProxyNode
from proxyshift.api.replacement import MAX_FRONTENDS
from proxyshift.planner import machine
from proxyshift.planner.behaviour import behaviour_params
from proxyshift.planner.diagnosis import migration_request
from proxyshift.planner.machine import FAILED, NodeInput, Target, is_in_flight
from proxyshift.planner.ordering import node_key
from proxyshift.planner.ownership import Ownership, compute_ownership, is_deleting, revision_policy
from proxyshift.planner.services import EndpointView, cluster_ip_frontends
from proxyshift.planner.status import Summary, build_status, transitions
from proxyshift.planner.timeutil import fmt, parse, utc
from proxyshift.planner.world import (
    RETRY_ANNOTATION,
    Action,
    DeleteRevision,
    EnsureProxyNode,
    EnsureRevision,
    Event,
    NodeView,
    Plan,
    RecordStatus,
    RemoveFinalizer,
    SetMigration,
    World,
    daemonset_for,
)

ENSURE_BATCH = 50  # ProxyNodes created per call: keeps one plan's action list short on a new fleet
# After the spec renders to another revision, no node starts until it has stayed on that revision this
# long: a spec edited every second (two GitOps tools fighting over a field, a script) would otherwise
# move each node every time it finished a migration, back and forth between revisions.
SETTLE_SECONDS = 10.0
RELEASE = "release"  # a node the policy lets go of (left alone, ProxyNode spec cleared)


def resolve_max_unavailable(value: int | str, total: int) -> int:
    """An int, or a percent of `total` rounded down; never below 1 so a rollout can always move."""
    if isinstance(value, int):
        return max(1, value)
    percent = int(str(value).rstrip("%"))
    return max(1, math.floor(percent * total / 100))


def stage_targets(policy: ProxyPolicy, total: int) -> list[int]:
    """Cumulative node counts each stage must reach. Percent rounds up so 1% of 10 nodes is 1 node."""
    stages = policy.spec.rollout.stages or []
    targets = []
    for stage in stages:
        if stage.nodes is not None:
            targets.append(min(stage.nodes, total))
        else:
            targets.append(min(total, math.ceil((stage.percent or 100) * total / 100)))
    return targets


@dataclass
class _Node:
    name: str
    target: Target | str | None  # Target, RELEASE, or None when the current revision is not known yet
    proxynode: ProxyNode | None
    kind: str = "pending"  # inflight | updated | failed | halting | pending | release
    forward: bool = True  # moving to the current revision (as opposed to back to the baseline)


@dataclass
class _Ctx:
    world: World
    policy: ProxyPolicy
    ownership: dict[str, Ownership]
    actions: list[Action] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)

    @property
    def now(self) -> datetime:
        return utc(self.world.now)

    @property
    def name(self) -> str:
        return self.policy.name

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.actions.append(Event(policy=self.name, node=None, type="Warning" if warning else "Normal",
                                  reason=reason, message=message))

    @functools.cached_property
    def conntrack(self) -> ConntrackParams | None:
        return _conntrack(self)

    @functools.cached_property
    def frontends(self) -> tuple[tuple[str, ...], int]:
        """The ClusterIP frontends a kube-proxy replacement's gate asks about (a bounded sample) and how many the
        cluster's Services have in all: the same for every node of the plan, taken once."""
        every = cluster_ip_frontends(self.world.services.services.values())
        return tuple(every[:MAX_FRONTENDS]), len(every)

    @functools.cached_property
    def distribution(self) -> DiagnoseRequest | None:
        """The same for every node of the plan: taken once."""
        return _distribution_request(self)

    def wake(self, seconds: float | None) -> None:
        if seconds is not None:
            self.requeue.append(max(0.0, seconds))


def _mode_of(world: World, revision: str | None) -> str:
    if revision is None:
        return world.baseline_mode
    view = world.revisions.get(revision)
    return view.mode if view is not None else "unknown"


def _node_input(ctx: _Ctx, name: str, pn: ProxyNode, may_switch: bool = True) -> NodeInput:
    w = ctx.world
    node = w.nodes[name]
    rendered = w.current_revisions.get(ctx.name)
    return NodeInput(policy=ctx.name, spec=ctx.policy.spec, node=node, proxynode=pn,
                     pods=tuple(w.kube_proxy_pods.get(name, ())), now=ctx.now, service_ips=w.service_ips,
                     behaviour=_behaviour_sample(ctx, node), conntrack=ctx.conntrack, distribution=ctx.distribution,
                     api_back_at=w.api_back_at, may_switch=may_switch, frontends=ctx.frontends,
                     ipvs_exclude_cidrs=rendered.ipvs_exclude_cidrs if rendered is not None else None)


def _migration(e: _Node) -> NodeMigration | None:
    return e.proxynode.spec.migration if e.proxynode is not None else None


def _phase(e: _Node) -> str | None:
    """The phase of an in-flight node, None for any other."""
    m = _migration(e)
    return m.phase if e.kind == "inflight" and m is not None else None


def _untouched(e: _Node) -> bool:
    return _phase(e) in machine.UNTOUCHED


def _prepared(e: _Node) -> bool:
    """In flight, preflight passed, waiting for a slot (recorded as Preflight: machine.is_prepared)."""
    return e.kind == "inflight" and e.proxynode is not None and machine.is_prepared(e.proxynode)


def _moved_on(e: _Node) -> bool:
    m = _migration(e)
    return m is not None and (e.target is RELEASE
                              or (isinstance(e.target, Target) and e.target.revision != m.to_revision))


def _step_inflight(ctx: _Ctx, e: _Node, *, may_switch: bool, halting: bool, paused: bool) -> machine.Step:
    """One in-flight node's transition (abandon an untouched preflight whose target moved on, or that waits
    for a slot a failed node or a pause now holds shut)."""
    assert e.proxynode is not None
    inp = _node_input(ctx, e.name, e.proxynode, may_switch=may_switch)
    m = e.proxynode.spec.migration
    assert m is not None
    prepared = _prepared(e)
    if m.phase in machine.UNTOUCHED and _moved_on(e):
        return machine.abandon(inp, "Superseded", "the target changed before the switch; starting over")
    if prepared and halting:
        return machine.abandon(inp, "Halted", "a failed node halts the rollout; this node was not switched "
                               "and goes back to Pending (its preflight is taken again on a retry)")
    if prepared and paused:
        return machine.abandon(inp, "Paused", "the rollout is paused; this node was not switched and goes "
                               "back to Pending (its preflight is taken again when it resumes)")
    return machine.step(inp)


def _written(result: machine.Step, node: str) -> NodeMigration | None:
    """The record a node's step writes last (None: it writes none)."""
    writes = [a.migration for a in result.actions if isinstance(a, SetMigration) and a.node == node]
    return writes[-1] if writes else None


def _failing_now(written: Mapping[str, NodeMigration | None], generation: object, token: str | None,
                 now: str) -> list[tuple[NodeFailure, bool]]:
    """The nodes whose step in this plan writes Failed or RolledBack, each with whether it halts the rollout (a
    failure of the current spec and retry token, as _classify reads it from the record)."""
    return [(NodeFailure(name=name, phase=m.phase, reason=m.reason or m.phase, message=m.message or "",
                         at=m.finished_at or m.phase_since or now),
             m.generation == generation and m.retry_token == token)
            for name, m in written.items() if m is not None and m.phase in FAILED]


def _switch_grants(nodes: list[_Node], limit: int, halted: bool, revisions: Set[str],
                   freed: Set[str] = frozenset()) -> set[str]:
    """The untouched in-flight nodes that may go on to touch their node this pass: as many as maxUnavailable
    has free slots, those whose preflight already passed (Prepared) first, each group in node order.

    Counting only touched nodes against maxUnavailable is what lets the next node's preflight run during
    this node's gate (rollout.preflightAhead) without ever switching more nodes at once than allowed.
    A node whose target revision does not exist yet (`revisions`: those that do) gets no slot: its preflight
    runs while the revision is created, its switch waits for it. `freed`: touched nodes whose step in this
    plan finishes them; their slots count as free."""
    if halted:
        return set()
    touched = sum(e.kind == "inflight" and not _untouched(e) and e.name not in freed for e in nodes)
    waiting = [e for e in nodes if _untouched(e) and not _moved_on(e) and _target_exists(e, revisions)]
    waiting.sort(key=lambda e: not _prepared(e))  # stable: node order within each group
    return {e.name for e in waiting[:max(0, limit - touched)]}


def _target_exists(e: _Node, revisions: Set[str]) -> bool:
    """Whether the revision the node's migration moves it to exists (None: the baseline, always there)."""
    m = _migration(e)
    return m is None or m.to_revision is None or m.to_revision in revisions


def _distribution_request(ctx: _Ctx) -> DiagnoseRequest | None:
    """The Services whose traffic distribution every node records around its move (the same on each)."""
    side = ctx.world.services
    named = [f"{ref.namespace}/{ref.name}" for ref in ctx.policy.spec.gate.probe_services or []]
    by_service: dict[str, list[EndpointView]] = {}
    for endpoint in side.endpoints:
        by_service.setdefault(endpoint.service, []).append(endpoint)
    return migration_request(side.services.values(), by_service, "", "before", named=named)


def _behaviour_sample(ctx: _Ctx, node: NodeView) -> BehaviourParams | None:
    """The node's Service sample: the same cluster gives the same sample before and after the switch."""
    spec = ctx.policy.spec
    if not spec.gate.behaviour.enabled:
        return None
    side = ctx.world.services
    params = behaviour_params(side.services.values(), side.endpoints, node.name, list(node.addresses), spec,
                              side.probe_pods.get(node.name))
    return params if params.targets else None


MAX_CONNTRACK_CIDRS = 4  # ConntrackParams.service_cidrs


def _conntrack(ctx: _Ctx) -> ConntrackParams | None:
    """Which destinations are Services, for the conntrack step after a switch; None: none known."""
    if not ctx.policy.spec.rollout.conntrack_cleanup:
        return None
    side = ctx.world.services
    node_ports = sorted({p.node_port for s in side.services.values() for p in s.ports if p.node_port})
    lb_ips = sorted({ip for s in side.services.values() for ip in s.load_balancer_ips})
    if not side.service_cidrs and not node_ports and not lb_ips:
        return None
    return ConntrackParams(service_cidrs=list(side.service_cidrs[:MAX_CONNTRACK_CIDRS]),
                           service_ips=lb_ips[:MAX_SERVICE_ADDRESSES], node_ports=node_ports[:MAX_NODE_PORTS])


def _release(ctx: _Ctx, name: str, pn: ProxyNode) -> None:
    node = ctx.world.nodes.get(name)
    label = node.revision if node is not None else None
    ctx.actions.append(SetMigration(node=name, policy=None, revision=label, mode=_mode_of(ctx.world, label),
                                    scheduler=None, migration=None, operation=None, reason="Released"))


def _classify(ctx: _Ctx, deleting: bool, current: Target | None) -> list[_Node]:
    policy, world = ctx.policy, ctx.world
    gen = policy.metadata.get("generation")
    token = (policy.metadata.get("annotations") or {}).get(RETRY_ANNOTATION)
    orphan = deleting and policy.spec.deletion_policy == "Orphan"
    result = []
    for name, own in ctx.ownership.items():
        if own.owner != ctx.name:
            continue
        node = world.nodes[name]
        pn = world.proxynodes.get(name)
        entry = _Node(name, None, pn)
        if not deleting and ctx.name in own.selected_by:
            entry.target = current
        elif orphan or revision_policy(world, node.revision) != ctx.name:
            entry.target, entry.forward = RELEASE, False
        else:
            entry.target, entry.forward = Target(None, world.baseline_mode), False
        m = pn.spec.migration if pn is not None else None
        target = entry.target
        if is_in_flight(m):
            entry.kind = "inflight"
        elif target is RELEASE or target is None:
            entry.kind = "release" if target is RELEASE else "pending"
        elif isinstance(target, Target) and node.revision == target.revision:
            entry.kind = "updated" if entry.forward else "release"
        elif (m is not None and m.phase in FAILED and isinstance(target, Target)
              and m.to_revision == target.revision):
            halting = m.generation == gen and m.retry_token == token
            entry.kind = "halting" if halting else "failed"
        result.append(entry)
    result.sort(key=lambda e: (node_key(e.name), e.name))
    return result


def _stage(ctx: _Ctx, current: Target | None, total: int, updated: int) -> tuple[int | None, str | None, int, str]:
    """(stage index, stage start, how many more forward nodes may be in flight, why not more)."""
    stages = ctx.policy.spec.rollout.stages
    if not stages or current is None:
        return None, None, 1 << 30, ""
    status = ctx.policy.status
    if status.current_revision == current.revision and status.stage is not None:
        index, started = min(status.stage, len(stages) - 1), status.stage_started_at or fmt(ctx.now)
    else:
        index, started = 0, fmt(ctx.now)  # a new revision is a new rollout: canary again
    targets = stage_targets(ctx.policy, total)

    def opens_in(i: int) -> float:
        pause = stages[i - 1].pause if i > 0 else None
        if not pause:
            return 0.0
        start = parse(started) or ctx.now
        return (start + parse_duration(pause) - ctx.now).total_seconds()

    while index < len(stages) - 1 and updated >= targets[index] and opens_in(index) <= 0:
        ctx.event("StageCompleted", f"stage {index + 1} of {len(stages)} done: {updated}/{total} nodes updated")
        index, started = index + 1, fmt(ctx.now)
    wait = opens_in(index)
    if wait > 0:
        ctx.wake(wait)
        return index, started, 0, f"pausing {stages[index - 1].pause} after stage {index} (for {wait:.0f}s more)"
    return index, started, targets[index], ""


def _revision_since(ctx: _Ctx, current: Target | None) -> str | None:
    """When the policy's current revision became current; None for its first one (nothing to settle)."""
    status = ctx.policy.status
    if current is None or status.current_revision is None:
        return status.revision_since if current is None else None
    if status.current_revision != current.revision:
        return fmt(ctx.now)
    return status.revision_since


def _settling(ctx: _Ctx, since: str | None) -> str:
    start = parse(since) if since else None
    if start is None:
        return ""
    wait = (start - ctx.now).total_seconds() + SETTLE_SECONDS
    if wait <= 0:
        return ""
    ctx.wake(wait)
    return f"the spec changed {SETTLE_SECONDS - wait:.0f}s ago; no node starts until it is unchanged for " \
           f"{SETTLE_SECONDS:g}s"


def _between_nodes(ctx: _Ctx, nodes: list[_Node]) -> str:
    pause = ctx.policy.spec.rollout.pause_between_nodes
    if not pause:
        return ""
    finished = [parse(e.proxynode.spec.migration.finished_at) for e in nodes
                if e.proxynode is not None and e.proxynode.spec.migration is not None
                and e.proxynode.spec.migration.phase == "Done"]
    last = max((f for f in finished if f is not None), default=None)
    if last is None:
        return ""
    wait = (last + parse_duration(pause) - ctx.now).total_seconds()
    if wait > 0:
        ctx.wake(wait)
        return f"pauseBetweenNodes: next node in {wait:.0f}s"
    return ""


def _revisions_in_use(world: World) -> set[str]:
    used = {n.revision for n in world.nodes.values() if n.revision is not None}
    for pn in world.proxynodes.values():
        m = pn.spec.migration
        if is_in_flight(m):
            assert m is not None
            used.update(r for r in (m.from_revision, m.to_revision, pn.spec.revision) if r)
    return used


def plan(world: World, policy_name: str) -> Plan:
    policy = world.policies.get(policy_name)
    if policy is None:
        return Plan([])
    ctx = _Ctx(world, policy, compute_ownership(world))
    deleting = is_deleting(policy)
    rendered = world.current_revisions.get(policy_name)
    current = Target(rendered.name, rendered.mode, rendered.scheduler) if rendered and not deleting else None
    nodes = _classify(ctx, deleting, current)
    gen = policy.metadata.get("generation")
    token = (policy.metadata.get("annotations") or {}).get(RETRY_ANNOTATION)

    base = len([e for e in nodes if e.target is not RELEASE])
    limit = resolve_max_unavailable(policy.spec.rollout.max_unavailable, base)
    halting = [e for e in nodes if e.kind == "halting"]
    rolling_back = sum(_phase(e) == "RollingBack" for e in nodes)
    halted = bool(halting) or rolling_back > 0
    # A pause holds back every node not switched yet, a started preflight included: "no new node" is read
    # as "no node touched", which is what a person pausing a rollout means.
    paused = policy.spec.rollout.paused and not deleting
    # 1. in-flight nodes: one transition each, the touched ones first. A node whose step this plan ends
    # (Done) frees its maxUnavailable slot for a waiting node in the same plan instead of the next one (a
    # plan cycle per node sooner, issue 13). Such a late grant's steps run only after every other node's
    # succeeded (Plan.after_others), so the records never show more touched nodes than allowed.
    inflight = [e for e in nodes if e.kind == "inflight" and e.proxynode is not None]
    results: dict[str, machine.Step] = {}
    for e in inflight:
        if not _untouched(e):
            results[e.name] = _step_inflight(ctx, e, may_switch=False, halting=bool(halting), paused=paused)
    finishing = {name for name, result in results.items() if result.phase == "Done"}
    existing = set(world.revisions)
    grants = _switch_grants(nodes, limit, halted or paused, existing, freed=finishing)
    late = grants - _switch_grants(nodes, limit, halted or paused, existing)
    for e in inflight:
        if _untouched(e):
            results[e.name] = _step_inflight(ctx, e, may_switch=e.name in grants, halting=bool(halting),
                                             paused=paused)
    progress: list[NodeProgress] = []
    for e in inflight:
        result = results[e.name]
        m = _migration(e)
        assert m is not None
        if e.name not in late:
            ctx.actions += result.actions
        ctx.wake(result.requeue_after)
        progress.append(NodeProgress(name=e.name, phase="Prepared" if _prepared(e) else m.phase,
                                     since=m.phase_since or fmt(ctx.now),
                                     revision=m.to_revision, message=result.message))
    for e in inflight:
        if e.name in late:
            ctx.actions += results[e.name].actions
    # The status describes the nodes as this plan leaves them (its status write comes after every node's
    # steps succeeded): a node finishing now is updated, not in flight, and the last one's Done and the
    # policy's Ready are one plan, not two.
    finished_forward = sum(e.name in finishing and e.forward for e in inflight)
    written = {e.name: _written(results[e.name], e.name) for e in inflight}
    failing_now = _failing_now(written, gen, token, fmt(ctx.now))
    started_rollback = sum(_phase(e) != "RollingBack" and (m := written[e.name]) is not None
                           and m.phase == "RollingBack" for e in inflight)
    leaving = finishing | {f.name for f, _ in failing_now}

    # 2. the revision of the current spec must exist before any node can move to it. An existing one is
    # applied again on every plan, without an Event: server-side apply writes nothing while it matches its
    # rendering and brings it back when it does not (the baseline's image moved, someone edited it).
    revision_missing = False
    if current is not None and current.revision is not None:
        if current.revision not in world.revisions:
            revision_missing = True
            ctx.actions.append(EnsureRevision(policy=policy_name, revision=current.revision,
                                              reason="RevisionCreated",
                                              message=f"kube-proxy {current.mode} revision {current.revision}"))
            ctx.wake(machine.POLL_SECONDS)
        else:
            ctx.actions.append(EnsureRevision(policy=policy_name, revision=current.revision, existing=True))

    forward = [e for e in nodes if e.forward and e.target is not RELEASE]
    selected = len(forward)
    updated = sum(e.kind == "updated" for e in forward)
    crashlooping = [e.name for e in forward if e.kind == "updated" and _kube_proxy_crashlooping(world, e.name)]
    in_flight = sum(e.kind == "inflight" for e in nodes)
    inflight_forward = sum(e.kind == "inflight" for e in forward)
    eligible = [e for e in nodes if e.kind in ("pending", "failed") and isinstance(e.target, Target)]

    # 3. may new nodes start, and how many?
    stage, stage_started, stage_room, waiting = _stage(ctx, current, selected, updated)
    revision_since = _revision_since(ctx, current)
    settling = _settling(ctx, revision_since) if not deleting else ""
    blocked = ""
    if halting or rolling_back:
        blocked = "halted by a failed node"
    elif policy.spec.rollout.paused and not deleting:
        blocked = "paused"  # a deletion is a later decision than the pause, so it is not held by it
    elif waiting:
        blocked = waiting
    else:
        blocked = settling or _between_nodes(ctx, nodes)
    capacity = limit - in_flight
    if policy.spec.rollout.preflight_ahead and not policy.spec.rollout.pause_between_nodes:
        # Up to maxUnavailable more nodes may run their preflight while others are touched; they wait
        # Prepared for a slot. A pause between nodes asks for the opposite, so it turns this off.
        capacity = min(limit - sum(_untouched(e) for e in nodes), 2 * limit - in_flight)
    stage_room -= updated + inflight_forward
    started: list[str] = []
    ensure = 0
    if not blocked:
        for e in eligible:
            if capacity <= 0:
                break
            target = e.target
            assert isinstance(target, Target)
            if e.forward and stage_room <= 0:
                continue
            node = world.nodes[e.name]
            if not node.ready:
                continue  # its agent could not answer; it keeps its place in the order
            if e.proxynode is None:
                if ensure < ENSURE_BATCH:
                    ctx.actions.append(EnsureProxyNode(node=e.name, policy=policy_name, reason="ProxyNodeCreated"))
                    ensure += 1
                continue
            inp = _node_input(ctx, e.name, e.proxynode)
            result = machine.start(inp, target, from_mode=_mode_of(world, node.revision), generation=gen,
                                   retry_token=token)
            ctx.actions += result.actions
            ctx.wake(result.requeue_after)
            capacity -= 1
            stage_room -= e.forward
            started.append(e.name)
            progress.append(NodeProgress(name=e.name, phase="Preflight", since=fmt(ctx.now),
                                         revision=target.revision, message="preflight requested"))
    if ensure:
        ctx.wake(machine.POLL_SECONDS)

    # 4. let go of nodes that are no longer ours (they keep their label).
    for e in nodes:
        if e.kind == "release" and e.proxynode is not None and e.proxynode.spec.policy == policy_name:
            _release(ctx, e.name, e.proxynode)
    for name, pn in world.proxynodes.items():
        own = ctx.ownership.get(name)  # None: the Node is gone, its ProxyNode goes with it
        if (pn.spec.policy == policy_name and own is not None and own.owner is None
                and not is_in_flight(pn.spec.migration)):
            _release(ctx, name, pn)

    # 5. revisions nobody uses any more; deletion.
    in_use = _revisions_in_use(world)
    if current is not None and current.revision is not None:
        in_use.add(current.revision)
    mine = sorted(r.name for r in world.revisions.values() if r.policy == policy_name)
    orphan = deleting and policy.spec.deletion_policy == "Orphan"
    # While the spec settles, unused revisions stay: the spec may come back to one of them, and deleting
    # and re-creating a revision per edit is churn in kube-system for nothing.
    if not orphan and not settling:
        for rev in mine:
            if rev not in in_use:
                ctx.actions.append(DeleteRevision(revision=rev, reason="RevisionDeleted",
                                                  message=f"no node runs {rev} any more"))
    finalize: RemoveFinalizer | None = None
    if deleting:
        still_mine = [e for e in nodes if e.kind != "release"]
        if orphan and not any(e.kind == "inflight" for e in nodes):
            for e in still_mine:
                if e.proxynode is not None and e.proxynode.spec.policy == policy_name:
                    _release(ctx, e.name, e.proxynode)
            finalize = RemoveFinalizer(policy=policy_name, reason="Orphaned",
                                       message="nodes and revisions left as they are")
        elif not orphan and not still_mine and not mine:
            finalize = RemoveFinalizer(policy=policy_name, reason="Reverted",
                                       message="every node is back on the baseline kube-proxy")
        elif not orphan and not still_mine:
            ctx.wake(machine.POLL_SECONDS)  # waiting for the DeleteRevisions to land

    # 6. status.
    failures = [
        NodeFailure(name=e.name, phase=m.phase, reason=m.reason or m.phase, message=m.message or "",
                    at=m.finished_at or m.phase_since or fmt(ctx.now))
        for e in nodes if e.kind in ("halting", "failed") and e.proxynode is not None
        and (m := e.proxynode.spec.migration) is not None
    ]
    # Like a finishing node, one that fails in this plan is told in this plan's status.
    failures += [f for f, _ in failing_now]
    failures.sort(key=lambda f: (node_key(f.name), f.name))
    halting_names = {e.name for e in halting} | {f.name for f, halts in failing_now if halts}
    conflicting = [name for name, own in ctx.ownership.items()
                   if not deleting and policy_name in own.selected_by and own.owner not in (None, policy_name)]
    conflicting.sort(key=lambda n: (node_key(n), n))
    skipped = sorted((name for name, own in ctx.ownership.items() if not deleting and policy_name in own.skipped_by),
                     key=lambda n: (node_key(n), n))
    summary = Summary(
        generation=gen,
        revision=current.revision if current else policy.status.current_revision,
        mode=current.mode if current else world.baseline_mode,
        deleting=deleting,
        paused=policy.spec.rollout.paused,
        selected=selected,
        updated=updated + finished_forward,
        pending=max(0, selected - updated - inflight_forward - sum(e.kind in ("halting", "failed") for e in forward)),
        in_flight=sorted((p for p in progress if p.name not in leaving), key=lambda p: (node_key(p.name), p.name)),
        failures=failures,
        halting=[f for f in failures if f.name in halting_names],
        rolling_back=rolling_back + started_rollback,
        conflicting=conflicting,
        conflict_owners={n: ctx.ownership[n].owner or "" for n in conflicting[:20]},
        skipped_control_plane=skipped,
        stage=stage,
        stage_started_at=stage_started,
        retry_token=token,
        waiting=blocked,
        revision_missing=revision_missing,
        kube_proxy_crashlooping=sorted(crashlooping, key=lambda n: (node_key(n), n)),
        revision_since=revision_since,
        render_error=None if deleting else world.render_errors.get(policy_name),
        compat=None if deleting else world.compat.get(policy_name),
        allowed_changes=tuple(policy.spec.gate.behaviour.allow_changes or ()),
    )
    status = build_status(policy, summary, ctx.now)
    for reason, message, warning in transitions(policy.status, status):
        ctx.event(reason, message, warning)
    if finalize is not None:
        # The object is gone once the finalizer is: a status write after it could only fail.
        ctx.actions.append(finalize)
    elif status.model_dump() != policy.status.model_dump():
        ctx.actions.append(RecordStatus(policy=policy_name, status=status))

    outstanding = in_flight or started or (eligible and not halting) or revision_missing
    requeue = min(ctx.requeue) if ctx.requeue else (machine.POLL_SECONDS if outstanding and not blocked else None)
    if blocked == "paused" and not in_flight:
        requeue = None  # nothing moves until the spec changes, which wakes the operator anyway
    return Plan(
        actions=ctx.actions,
        requeue_after_seconds=requeue,
        details={"started": started, "blocked": blocked, "phase": status.phase, "capacity": capacity,
                 "stage": stage, "nodes": base},
        after_others=frozenset(late),
    )


def _kube_proxy_crashlooping(world: World, node: str) -> bool:
    """A migrated node whose kube-proxy (of the revision its label names) keeps restarting without
    becoming Ready: the gate passed, but kube-proxy broke afterwards. Said, not acted on: rolling a
    Done node back on its own would be a second switch nobody asked for."""
    view = world.nodes.get(node)
    if view is None:
        return False
    want = daemonset_for(view.revision)
    return any(p.daemonset == want and machine.is_crash_looping(p) for p in world.kube_proxy_pods.get(node, ()))
