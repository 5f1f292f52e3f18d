"""A pure scenario simulator for the planner: a fake cluster that applies Plan actions.

It plays the API server (labels, cordons, ProxyNode specs, revisions, status), the DaemonSet
controller and kubelet (kube-proxy pods follow the node's revision label with a delay), and the
node agent (runs each operation id once, probes a fake kube-proxy). Faults are per node and mode.
After every step it checks the safety invariants and records violations instead of raising, so a
property test can report them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from proxyshift.agent.hold import abandoned
from proxyshift.api.common import parse_duration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import (
    IN_FLIGHT,
    KubeProxyFacts,
    NodeMigration,
    OperationStatus,
    ProxyNode,
    ProxyNodeSpec,
    ProxyNodeStatus,
    RuleHold,
    attempt_key,
)
from proxyshift.planner.machine import (
    HOLD_ROLLBACK_SECONDS,
    RECONNECT_GRACE,
    UNTOUCHED,
    is_in_flight,
    is_prepared,
)
from proxyshift.planner.ownership import compute_ownership, is_deleting
from proxyshift.planner.planner import plan, resolve_max_unavailable
from proxyshift.planner.timeutil import fmt
from proxyshift.planner.world import (
    BASELINE_DAEMONSET,
    Action,
    Cordon,
    DeleteRevision,
    Drain,
    EnsureProxyNode,
    EnsureRevision,
    Event,
    KubeProxyPodView,
    NodeView,
    Plan,
    RecordStatus,
    RemoveFinalizer,
    RevisionTarget,
    RevisionView,
    SetMigration,
    SetRevisionLabel,
    Uncordon,
    World,
    daemonset_for,
)

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def make_policy(
    name: str,
    mode: str = "nftables",
    selector: dict[str, Any] | None = None,
    *,
    created: str = "2026-11-30T10:00:00Z",
    generation: int = 1,
    rollout: dict[str, Any] | None = None,
    gate: dict[str, Any] | None = None,
    extra_spec: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
) -> ProxyPolicy:
    spec: dict[str, Any] = {
        "nodeSelector": selector if selector is not None else {"matchLabels": {"pool": "blue"}},
        "mode": mode,
        "rollout": rollout or {},
        "gate": {"timeout": "2m", **(gate or {})},
        **(extra_spec or {}),
    }
    metadata: dict[str, Any] = {"name": name, "creationTimestamp": created, "generation": generation}
    if annotations:
        metadata["annotations"] = annotations
    return ProxyPolicy.model_validate({"metadata": metadata, "spec": spec})


def edit(sim: Sim, name: str, **spec_changes: object) -> None:
    """A user edit: new spec, generation + 1."""
    p = sim.policies[name]
    spec = p.spec.to_k8s() | spec_changes
    meta = dict(p.metadata, generation=int(p.metadata.get("generation", 1)) + 1)
    sim.policies[name] = ProxyPolicy.model_validate({"metadata": meta, "spec": spec, "status": p.status.to_k8s()})


@dataclass
class Faults:
    preflight_fail: set[str] = field(default_factory=set)  # nodes
    crash: set[tuple[str, str]] = field(default_factory=set)  # (node, mode): kube-proxy never gets Ready
    wrong_mode: set[tuple[str, str]] = field(default_factory=set)  # (node, mode): reports another mode
    sync_failures: set[tuple[str, str]] = field(default_factory=set)
    cleanup_fail: set[str] = field(default_factory=set)
    hold_fail: set[str] = field(default_factory=set)  # the agent's rule hold fails (the switch goes on)
    # The node's old kube-proxy restarts (once) while the node waits Prepared: a hold made before goes with it.
    restart_prepared: set[str] = field(default_factory=set)
    agent_dead: set[str] = field(default_factory=set)
    no_connect: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Held:
    """A rule hold the fake agent keeps: the operation that made it, until when, and the kube-proxy pod it was
    made under (the hold goes once another one has synced, as agent/loop.py's _maybe_release_hold)."""

    operation_id: str
    expires: datetime
    pod: str | None


@dataclass
class Sim:
    nodes: dict[str, NodeView]
    policies: dict[str, ProxyPolicy]
    baseline_mode: str = "iptables"
    now: datetime = T0
    faults: Faults = field(default_factory=Faults)
    proxynodes: dict[str, ProxyNode] = field(default_factory=dict)
    revisions: dict[str, RevisionView] = field(default_factory=dict)
    pods: dict[str, list[KubeProxyPodView]] = field(default_factory=dict)
    service_ips: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    log: list[tuple[datetime, str, Action]] = field(default_factory=list)
    finalized: set[str] = field(default_factory=set)
    create_proxynodes: bool = True
    _pod_seq: int = 0
    _starts: dict[str, int] = field(default_factory=dict)  # per policy, since the last world()
    _touches: dict[str, int] = field(default_factory=dict)  # likewise: nodes moved past Prepared
    _finishes: dict[str, int] = field(default_factory=dict)  # likewise: touched nodes written out of flight
    holds: dict[str, Held] = field(default_factory=dict)  # node -> the fake agent's rule hold
    restarted: set[str] = field(default_factory=set)  # restart_prepared faults that fired

    @classmethod
    def build(cls, node_labels: dict[str, dict[str, str]], policies: Iterable[ProxyPolicy], **kw: Any) -> Sim:
        sim = cls(nodes={n: NodeView(n, dict(labels)) for n, labels in node_labels.items()},
                  policies={p.name: p for p in policies}, **kw)
        for name in sim.nodes:
            if sim.create_proxynodes:
                sim.proxynodes[name] = sim._new_proxynode(name)
            sim.pods[name] = [sim._new_pod(name, BASELINE_DAEMONSET, ready=True)]
        return sim

    # ---- the cluster's parts ----

    def _new_proxynode(self, name: str) -> ProxyNode:
        return ProxyNode(
            metadata={"name": name},
            spec=ProxyNodeSpec(),
            status=ProxyNodeStatus(kernel_release="6.8.0", modules=["nf_conntrack", "nf_tables"],
                                   tools={"nft": "1.0.9", "iptables": "1.8.10"}, heartbeat=fmt(self.now)),
        )

    def _new_pod(self, node: str, ds: str, ready: bool = False) -> KubeProxyPodView:
        self._pod_seq += 1
        return KubeProxyPodView(node=node, name=f"{ds}-{self._pod_seq}", daemonset=ds, ready=ready, running=True,
                                deleting=False, started_at=self.now)

    def render(self, policy: ProxyPolicy) -> RevisionTarget:
        body = json.dumps({"mode": policy.spec.mode, "ipvs": policy.spec.ipvs and policy.spec.ipvs.to_k8s()},
                          sort_keys=True)
        digest = hashlib.sha256(body.encode()).hexdigest()[:8]
        return RevisionTarget(f"{policy.name}-{digest}", policy.spec.mode, policy.spec.scheduler)

    def mode_of_ds(self, ds: str) -> str:
        if ds == BASELINE_DAEMONSET:
            return self.baseline_mode
        for rev in self.revisions.values():
            if daemonset_for(rev.name) == ds:
                return rev.mode
        return "unknown"

    def world(self) -> World:
        """A fresh snapshot; every plan gets its own, so start counting for the capacity check anew."""
        self._starts.clear()
        self._touches.clear()
        self._finishes.clear()
        live = {n: p.model_copy(deep=True) for n, p in self.policies.items() if n not in self.finalized}
        return World(
            now=self.now,
            policies=live,
            nodes={n: replace(v, labels=dict(v.labels)) for n, v in self.nodes.items()},
            proxynodes={n: p.model_copy(deep=True) for n, p in self.proxynodes.items()},
            revisions=dict(self.revisions),
            kube_proxy_pods={n: list(p) for n, p in self.pods.items()},
            baseline_mode=self.baseline_mode,
            current_revisions={n: self.render(p) for n, p in live.items() if not is_deleting(p)},
            service_ips=dict(self.service_ips),
        )

    # ---- applying actions ----

    def apply(self, policy: str, action: Action, world: World) -> None:
        self.log.append((self.now, policy, action))
        self._check_action(policy, action, world)
        if isinstance(action, Event) and action.node is not None and "rules held since the preflight" in action.message:
            self._check_held(action.node)
        if isinstance(action, EnsureRevision):
            target = self.render(self.policies[action.policy])
            assert target.name == action.revision
            self.revisions.setdefault(action.revision, RevisionView(action.revision, action.policy, target.mode,
                                                                   action.revision.rsplit("-", 1)[1]))
        elif isinstance(action, DeleteRevision):
            users = [n for n, v in self.nodes.items() if v.revision == action.revision]
            if users:
                self.violations.append(f"DeleteRevision {action.revision} while nodes {users} use it")
            self.revisions.pop(action.revision, None)
        elif isinstance(action, EnsureProxyNode):
            pn = self.proxynodes.setdefault(action.node, self._new_proxynode(action.node))
            pn.spec.policy = action.policy
        elif isinstance(action, SetMigration):
            pn = self.proxynodes.setdefault(action.node, self._new_proxynode(action.node))
            pn.spec = ProxyNodeSpec(policy=action.policy, revision=action.revision, mode=action.mode,
                                    scheduler=action.scheduler, migration=action.migration,
                                    operation=action.operation)
        elif isinstance(action, SetRevisionLabel):
            if action.revision is not None and action.revision not in self.revisions:
                self.violations.append(f"{action.node} labelled with missing revision {action.revision}")
            labels = dict(self.nodes[action.node].labels)
            labels.pop("proxyshift.io/revision", None)
            if action.revision is not None:
                labels["proxyshift.io/revision"] = action.revision
            self.nodes[action.node] = replace(self.nodes[action.node], labels=labels)
        elif isinstance(action, Cordon):
            self.nodes[action.node] = replace(self.nodes[action.node], unschedulable=True)
        elif isinstance(action, Uncordon):
            self.nodes[action.node] = replace(self.nodes[action.node], unschedulable=False)
        elif isinstance(action, RecordStatus):
            self.policies[action.policy] = self.policies[action.policy].model_copy(update={"status": action.status})
        elif isinstance(action, RemoveFinalizer):
            self.finalized.add(action.policy)
        elif isinstance(action, Drain | Event):
            pass
        else:  # pragma: no cover
            raise AssertionError(f"unknown action {action!r}")

    def _check_action(self, policy: str, action: Action, world: World) -> None:
        """Rules checked from first principles, not with the planner's own ownership code."""
        node = getattr(action, "node", None)
        if node is None or isinstance(action, Event):
            return
        p = world.policies[policy]
        view = world.nodes.get(node)
        pn = world.proxynodes.get(node)
        mine_in_flight = pn is not None and pn.spec.policy == policy and is_in_flight(pn.spec.migration)
        if isinstance(action, SetMigration) and action.policy is None:
            if pn is None or pn.spec.policy != policy or is_in_flight(pn.spec.migration):
                self.violations.append(f"{policy} released {node}, which is not its idle node")
            return
        if pn is not None and pn.spec.policy not in (None, policy) and is_in_flight(pn.spec.migration):
            self.violations.append(f"{policy} acted on {node}, in flight for {pn.spec.policy}: {action!r}")
        if view is None or not view.exists:
            self.violations.append(f"{policy} acted on missing node {node}")
            return
        selected = not is_deleting(p) and p.spec.node_selector.matches(view.labels)
        label_mine = view.revision is not None and view.revision.startswith(f"{policy}-")
        if not (selected or mine_in_flight or label_mine):
            self.violations.append(f"{policy} acted on {node} outside its selector: {type(action).__name__}")
        key = (str(p.metadata.get("creationTimestamp")), policy)
        older = [o.name for o in world.policies.values() if not is_deleting(o) and o.name != policy
                 and (str(o.metadata.get("creationTimestamp")), o.name) < key
                 and o.spec.node_selector.matches(view.labels)]
        if older and not mine_in_flight:
            self.violations.append(f"{policy} acted on {node}, which older policy {older[0]} selects")
        if isinstance(action, SetMigration) and action.migration is not None and action.migration.phase == "Preflight":
            before = pn.spec.migration if pn is not None else None
            starting = before is None or before.phase not in IN_FLIGHT
            if starting and p.spec.rollout.paused and not is_deleting(p):
                self.violations.append(f"{policy} started {node} while paused")
            if starting:
                self._check_capacity(policy, node, world)
        if isinstance(action, SetMigration) and action.migration is not None and not is_in_flight(action.migration):
            before = pn.spec.migration if pn is not None else None
            if before is not None and is_in_flight(before) and before.phase not in UNTOUCHED:
                self._finishes[policy] = self._finishes.get(policy, 0) + 1
        if isinstance(action, SetMigration) and action.migration is not None \
                and action.migration.phase not in UNTOUCHED | {"Pending", "Failed"}:
            before = pn.spec.migration if pn is not None else None
            if before is not None and before.phase in UNTOUCHED:
                self._check_touch(policy, node, world)
                self._check_preflight_passed(node, world, action.migration)
        if isinstance(action, SetMigration) and action.migration is not None and action.migration.phase in UNTOUCHED:
            before = pn.spec.migration if pn is not None else None
            if before is not None and before.phase in IN_FLIGHT and before.attempt == action.migration.attempt:
                # Starting a node is one write, and its preflight passing (Prepared) costs none.
                self.violations.append(f"{self.now}: {policy} wrote {node} again while it stayed untouched "
                                       f"({before.phase} -> {action.migration.phase})")

    def _owned_phases(self, policy: str, world: World) -> tuple[int, list[str]]:
        owned = [n for n, o in compute_ownership(world).items() if o.owner == policy]
        limit = resolve_max_unavailable(world.policies[policy].spec.rollout.max_unavailable, len(owned))
        phases = [m.phase for n in owned if n in world.proxynodes
                  and is_in_flight(m := world.proxynodes[n].spec.migration) and m is not None]
        return limit, phases

    def _check_capacity(self, policy: str, node: str, world: World) -> None:
        """A start may only take a free slot. Untouched nodes (Preflight, Prepared) before the plan + started
        by it <= maxUnavailable; without preflightAhead (or with a pause between nodes), every node in
        flight counts.

        Checked at the start, not as a standing invariant: with a percentage the limit shrinks when
        nodes leave the policy, and nodes already in flight cannot be un-started.
        """
        rollout = world.policies[policy].spec.rollout
        self._starts[policy] = self._starts.get(policy, 0) + 1
        limit, phases = self._owned_phases(policy, world)
        ahead = rollout.preflight_ahead and not rollout.pause_between_nodes
        counted = sum(ph in UNTOUCHED for ph in phases) if ahead else len(phases)
        if counted + self._starts[policy] > limit or (ahead and len(phases) + self._starts[policy] > 2 * limit):
            self.violations.append(f"{self.now}: {policy} started {node} with {phases} in flight "
                                   f"and {self._starts[policy] - 1} started, maxUnavailable {limit}")

    def _check_preflight_passed(self, node: str, world: World, after: NodeMigration) -> None:
        """No node is touched without a passed preflight of the same migration: the agent's answer to the
        Preflight operation of that attempt and revision, for the target mode, still the node's operation."""
        pn = world.proxynodes[node]
        op, last, before = pn.spec.operation, pn.status.last_operation, pn.spec.migration
        attempt = f"{after.to_revision or 'baseline'}.{after.attempt or 0}."
        passed = (op is not None and last is not None and op.type == "Preflight" and last.id == op.id
                  and last.state == "Succeeded" and op.id.startswith(attempt)
                  and op.params.get("mode") == after.to_mode and before is not None
                  and (before.to_revision, before.attempt) == (after.to_revision, after.attempt))
        if not passed:
            self.violations.append(f"{self.now}: {node} touched ({after.phase}) without a passed preflight of "
                                   f"{attempt}: operation {op and op.id}, answer {last and (last.id, last.state)}")

    def _check_held(self, node: str) -> None:
        """A switch that says it runs under the hold made with the preflight does: the agent keeps a hold of
        this migration, made after it started, that outlives a rollback of this switch."""
        held, m = self.holds.get(node), self.proxynodes[node].spec.migration
        if held is None or m is None or not held.operation_id.startswith(f"{attempt_key(m)}.Preflight."):
            self.violations.append(f"{self.now}: {node} switched claiming the preflight's rule hold, but the agent "
                                   f"holds {held and held.operation_id}")
            return
        policy = self.policies[self.proxynodes[node].spec.policy or ""]
        # The switch and the gate each gate.timeout and an API server outage's grace, then a rollback.
        needed = 2 * (parse_duration(policy.spec.gate.timeout) + RECONNECT_GRACE) \
            + timedelta(seconds=HOLD_ROLLBACK_SECONDS)
        if held.expires - self.now < needed:
            self.violations.append(f"{self.now}: {node} switched under a hold that ends at {held.expires}, too soon "
                                   f"for its switch, gate and a rollback ({needed})")

    def check_holds(self) -> None:
        """After the agents ran: a node keeps a rule hold only while its record names the hold's migration in
        flight (not back to Pending, not ended, not another attempt, not released by its policy), or while no
        kube-proxy serves the node without it."""
        for node in [n for n in self.holds if n not in self.nodes]:
            del self.holds[node]  # the node was deleted: its kernel's rules with it
        for node, held in self.holds.items():
            if self._serving_pod(node) is None:
                continue
            pn = self.proxynodes.get(node)
            m = pn.spec.migration if pn is not None else None
            if m is None or m.phase not in IN_FLIGHT or not held.operation_id.startswith(f"{attempt_key(m)}."):
                self.violations.append(f"{self.now}: {node} keeps the rule hold of {held.operation_id} while its "
                                       f"record is {m and (m.phase, attempt_key(m))}")

    def _check_touch(self, policy: str, node: str, world: World) -> None:
        """The standing promise of maxUnavailable: a node leaves Preflight/Prepared for a step that touches it
        only while fewer than maxUnavailable nodes are touched (those switched in this plan included, those
        whose finish this plan wrote before it not)."""
        self._touches[policy] = self._touches.get(policy, 0) + 1
        limit, phases = self._owned_phases(policy, world)
        touched = sum(ph not in UNTOUCHED for ph in phases) - self._finishes.get(policy, 0)
        if touched + self._touches[policy] > limit:
            self.violations.append(f"{self.now}: {policy} switched {node} with {touched} nodes touched "
                                   f"and {self._touches[policy] - 1} switched, maxUnavailable {limit}")

    # ---- the fake kubelet / DaemonSet controller and agent ----

    def tick(self, seconds: float = 1.0) -> None:
        self.now += timedelta(seconds=seconds)
        for name, view in self.nodes.items():
            self._kubelet(name, view)
            if name not in self.faults.agent_dead and name in self.proxynodes:
                self._agent(name)
        self.check_pods()
        self.check_holds()

    def _kubelet(self, name: str, view: NodeView) -> None:
        want = daemonset_for(view.revision)
        pn = self.proxynodes.get(name)
        if name in self.faults.restart_prepared and name not in self.restarted and pn is not None \
                and is_prepared(pn):
            # The old kube-proxy restarts while the node waits for its slot: a new process, Ready at once.
            self.restarted.add(name)
            self.pods[name] = [self._new_pod(name, p.daemonset, ready=True) if not p.deleting else p
                               for p in self.pods.get(name, [])]
        exists = want == BASELINE_DAEMONSET or view.revision in self.revisions
        pods = []
        for pod in self.pods.get(name, []):
            if pod.daemonset != want or not (want == BASELINE_DAEMONSET or pod.daemonset in self._ds_names()):
                if not pod.deleting:
                    pods.append(replace(pod, deleting=True, ready=False))
                continue  # a deleting pod goes away on the next tick
            mode = self.mode_of_ds(pod.daemonset)
            if (name, mode) in self.faults.crash:
                pods.append(replace(pod, ready=False, restarts=pod.restarts + 1))
            else:
                pods.append(replace(pod, ready=True))
        if exists and not any(p.daemonset == want for p in pods):
            pods.append(self._new_pod(name, want))
        self.pods[name] = pods

    def _ds_names(self) -> set[str]:
        return {daemonset_for(r) for r in self.revisions}

    def _facts(self, name: str) -> KubeProxyFacts:
        ready = [p for p in self.pods.get(name, []) if p.ready and not p.deleting]
        if not ready:
            return KubeProxyFacts(error="connection refused", probed_at=fmt(self.now))
        pod = ready[0]
        mode = self.mode_of_ds(pod.daemonset)
        start = pod.started_at.timestamp() if pod.started_at else 0.0
        age = (self.now - pod.started_at).total_seconds() if pod.started_at else 0.0
        shown = "iptables" if mode != "iptables" and (name, mode) in self.faults.wrong_mode else mode
        return KubeProxyFacts(
            proxy_mode=shown, healthz_status=200, process_start_time=start, last_sync_timestamp=start + 0.5,
            sync_count=1 + int(age), sync_duration_p99_seconds=0.05,
            sync_failures=3 if (name, mode) in self.faults.sync_failures else 0, probed_at=fmt(self.now),
        )

    def _serving_pod(self, name: str) -> str | None:
        ready = [p for p in self.pods.get(name, []) if p.ready and not p.deleting]
        return ready[0].name if ready else None

    def _hold(self, name: str, op_id: str, ttl: object) -> None:
        self.holds[name] = Held(op_id, self.now + timedelta(seconds=float(str(ttl or 600))), self._serving_pod(name))

    def _keep_or_release_hold(self, name: str, pn: ProxyNode) -> None:
        """The agent's rules: the hold goes when its migration is over (hold.abandoned, the real function) and a
        kube-proxy serves without it, when another kube-proxy has synced (a Ready pod here), or when its time ran
        out. status.hold tells."""
        held = self.holds.get(name)
        serving = self._serving_pod(name)
        if held is not None and ((abandoned(held.operation_id, pn.spec.migration) and serving is not None)
                                 or self.now >= held.expires or serving not in (None, held.pod)):
            del self.holds[name]
        held = self.holds.get(name)
        pn.status.hold = RuleHold(operation_id=held.operation_id, expires=fmt(held.expires)) if held else None

    def _agent(self, name: str) -> None:
        pn = self.proxynodes[name]
        pn.status.heartbeat = fmt(self.now)
        self._keep_or_release_hold(name, pn)
        op = pn.spec.operation
        if op is None:
            return
        last = pn.status.last_operation
        if last is None or last.id != op.id:
            # First sight: recorded as Running, the result comes on the next tick.
            pn.status.last_operation = OperationStatus(id=op.id, type=op.type, state="Running",
                                                       started_at=fmt(self.now))
            return
        if last.state != "Running":
            return
        state, message, details = "Succeeded", "ok", {}
        if op.type == "Preflight" and name in self.faults.preflight_fail:
            state, message = "Failed", f"kernel module ip_vs_{op.params.get('scheduler') or 'rr'} missing"
        elif op.type == "Preflight" and op.params.get("hold"):
            # A passed preflight makes the hold it was asked for (a failing hold fails only the hold).
            made = name not in self.faults.hold_fail
            if made:
                self._hold(name, op.id, op.params["hold"].get("ttlSeconds"))
            details = {"hold": {"ok": made, "message": "9 chains copied" if made else "exit status 4"}}
        elif op.type == "Hold" and name in self.faults.hold_fail:
            state, message = "Failed", "iptables-restore: exit status 4"
        elif op.type == "Hold":
            self._hold(name, op.id, op.params.get("ttlSeconds"))
        elif op.type == "Cleanup" and name in self.faults.cleanup_fail:
            state, message = "Failed", "iptables-restore: exit status 1"
        elif op.type == "Probe":
            facts = pn.status.kube_proxy = self._facts(name)
            ok = name not in self.faults.no_connect
            details = {"connects": {s: (True if ok else "connection refused") for s in op.params.get("services", [])}}
            if op.params.get("cleanup") and facts.proxy_mode == op.params.get("awaitMode"):
                # The flush in the gate's probe, once kube-proxy runs the mode awaited (it has synced here).
                flushed = name not in self.faults.cleanup_fail
                details["cleanup"] = {"ok": flushed,
                                      "message": "3 chains removed" if flushed else "iptables-restore: exit status 1"}
        if op.type == "Cleanup":
            self.holds.pop(name, None)  # every cleanup drops the hold with the flush
        pn.status.last_operation = last.model_copy(update={"state": state, "message": message, "details": details,
                                                           "finished_at": fmt(self.now)})
        self._keep_or_release_hold(name, pn)

    # ---- driving ----

    def check_pods(self) -> None:
        """After the DaemonSet controller ran: every node has a pod of the DaemonSet its label names."""
        for name, view in self.nodes.items():
            want = daemonset_for(view.revision)
            if not any(p.daemonset == want and not p.deleting for p in self.pods.get(name, [])):
                self.violations.append(f"{self.now}: no {want} pod on {name}")

    def check_invariants(self) -> None:
        for name, view in self.nodes.items():
            if view.revision is not None and view.revision not in self.revisions:
                self.violations.append(f"{self.now}: {name} labelled with missing revision {view.revision}")

    def step(self, policies: Iterable[str] | None = None) -> dict[str, Plan]:
        plans = {}
        for name in sorted(policies or self.policies):
            if name in self.finalized or name not in self.policies:
                continue
            world = self.world()
            result = plan(world, name)
            plans[name] = result
            for action in result.actions:
                self.apply(name, action, world)
        self.check_invariants()
        return plans

    def run(self, max_steps: int = 400, tick: float = 1.0, until: Any = None) -> int:
        """Plan, apply, tick, until every live policy is Ready with nothing in flight (or `until()`)."""
        for i in range(max_steps):
            self.step()
            if until is not None and until():
                return i
            if until is None and self.settled():
                return i
            self.tick(tick)
        return max_steps

    def settled(self) -> bool:
        for name, p in self.policies.items():
            if name in self.finalized:
                continue
            if is_deleting(p) or p.status.phase not in ("Ready", "Degraded"):
                return False
            if any(is_in_flight(pn.spec.migration) for pn in self.proxynodes.values() if pn.spec.policy == name):
                return False
        return True

    def phase(self, node: str) -> str | None:
        """The node's phase as the planner sees it: a passed Preflight waiting for a slot is Prepared."""
        pn = self.proxynodes[node]
        m = pn.spec.migration
        return ("Prepared" if is_prepared(pn) else m.phase) if m else None

    def events(self, reason: str | None = None) -> list[Event]:
        return [a for _, _, a in self.log if isinstance(a, Event) and (reason is None or a.reason == reason)]

    def actions(self, kind: type) -> list[Any]:
        return [a for _, _, a in self.log if isinstance(a, kind)]
