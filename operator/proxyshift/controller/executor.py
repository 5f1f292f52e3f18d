"""Performs the planner's actions against the API: one idempotent call (or small set) per action."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jsonpatch
from kubernetes.client.exceptions import ApiException

from proxyshift import render
from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller import metrics
from proxyshift.controller.event_sender import EventSender
from proxyshift.controller.kube import ClusterAPI, describe_api_error
from proxyshift.controller.revision_keeper import RevisionKeeper
from proxyshift.controller.settings import BASELINE_PATCH_ANNOTATION, CONFIG, OperatorConfig
from proxyshift.planner import world as w

log = logging.getLogger(__name__)


def _annotation_path(key: str) -> str:
    return "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")


class StepBlocked(Exception):
    """The action cannot complete yet (e.g. a PodDisruptionBudget refuses an eviction); retry later."""


@dataclass(frozen=True)
class Written:
    """A write the next plan must see: (index, key, resourceVersion the write produced)."""

    index: str
    key: str
    resource_version: str


# A node's Normal Events that PROXYSHIFT_NODE_EVENTS=outcomes keeps: how its migration ended.
OUTCOME_REASONS = frozenset({"Migrated", "RolledBack", "Reverted", "Released"})


def announced_elsewhere(actions: list[w.Action]) -> set[tuple[str | None, str]]:
    """(node, reason) of the plan's own Events: an action with the same reason on the same node is
    already told about (the switch's label move and its "Switching" Event), so it needs no second one."""
    return {(a.node, a.reason) for a in actions if isinstance(a, w.Event)}


def by_node(actions: list[w.Action]) -> tuple[list[list[w.Action]], list[w.Action]]:
    """The plan's actions as (one list per node, in plan order; the policy's own, in plan order).

    A node's actions depend on each other (intent recorded before the label moves) and keep their
    order; different nodes' do not, so they may run side by side. The policy's own actions (revisions,
    its status, the finalizer) describe the plan's outcome and come after.
    """
    nodes: dict[str, list[w.Action]] = {}
    rest: list[w.Action] = []
    for action in actions:
        node = getattr(action, "node", None)
        if node:
            nodes.setdefault(node, []).append(action)
        else:
            rest.append(action)
    return list(nodes.values()), rest


def in_waves(actions: list[w.Action], after_others: Set[str]) -> tuple[list[list[list[w.Action]]], list[w.Action]]:
    """by_node in two waves: the nodes of `after_others` (Plan.after_others) only after every other node's
    steps succeeded. Each wave's node groups may run side by side; the policy's own actions come last."""
    groups, rest = by_node(actions)
    first: list[list[w.Action]] = []
    late: list[list[w.Action]] = []
    for group in groups:
        (late if getattr(group[0], "node", None) in after_others else first).append(group)
    return [first, late], rest


@dataclass
class Executor:
    api: ClusterAPI
    node_uids: Mapping[str, str] = field(default_factory=dict)
    # Its node_events: "steps", an Event per step on the node and its policy (issue 5); "outcomes", only
    # Warnings and how each node's migration ended (at thousands of nodes Events are otherwise most of the
    # operator's writes, issue 7: at most 8 per node); "auto", steps up to step_events_max_nodes selected nodes.
    config: OperatorConfig = CONFIG
    fleet: dict[str, int] = field(default_factory=dict)  # policy -> nodes it moves (or reverts), at its last plan
    _drain_said: dict[str, str] = field(default_factory=dict)  # node -> the blocked drain last told
    # Which existing revisions need applying again (revision_keeper.py); made from the config.
    kept: RevisionKeeper = field(init=False)
    # Posts Events off the plan's path (event_sender.py); None: each Event is posted where it is made.
    events: EventSender | None = None

    def __post_init__(self) -> None:
        self.kept = RevisionKeeper(self.config.revision_reapply_seconds)

    def perform(self, action: w.Action, policies: dict[str, ProxyPolicy], *, announce: bool = True) -> Written | None:
        kind = type(action).__name__
        policy_name = getattr(action, "policy", None) or ""
        metrics.ACTIONS.labels(policy_name or "-", kind).inc()
        handler = ACTION_HANDLERS.get(type(action))
        if handler is None:
            raise NotImplementedError(f"no executor for action {kind}")
        written = handler(self, action, policies)
        if announce and action.reason and not isinstance(action, w.Event | w.RecordStatus | w.SetMigration):
            # Every API step the operator takes (label moved, cordon, drain, revision created or deleted,
            # ProxyNode released, ...) leaves an Event where a person looks: on the node it touched,
            # else on the policy. SetMigration records intent; the planner emits its own Events for those.
            self._announce(action, policies)
        return written

    def _announce(self, action: w.Action, policies: dict[str, ProxyPolicy]) -> None:
        self._emit(getattr(action, "node", None), getattr(action, "policy", None), action.reason,
                   action.message or action.reason, "Normal", policies)

    def events_for(self, policy: str | None) -> str:
        """`steps` or `outcomes` for this policy's nodes, resolving `auto` by the policy's size."""
        if self.config.node_events != "auto":
            return self.config.node_events
        return "steps" if self.fleet.get(policy or "", 0) <= self.config.step_events_max_nodes else "outcomes"

    def _emit(self, node: str | None, policy: str | None, reason: str, message: str, type_: str,
              policies: dict[str, ProxyPolicy]) -> None:
        """A node's step: on the node, and with `steps` on its policy too, where `kubectl describe
        proxypolicy` shows the rollout's progress. With `outcomes` only Warnings and how each node ended
        are told, on the node: at 5,000 nodes Events are otherwise most of the operator's writes."""
        if node:
            outcomes = self.events_for(policy) == "outcomes"
            if outcomes and type_ == "Normal" and reason not in OUTCOME_REASONS:
                metrics.EVENTS_SKIPPED.inc()
                return
            self._post_event(kind="Node", name=node, uid=self.node_uids.get(node), namespace=None,
                             reason=reason, message=message, type_=type_, api_version="v1")
            if outcomes or not policy:
                return
            message = f"{node}: {message}"
        if policy:
            known = policies.get(policy)
            self._post_event(kind="ProxyPolicy", name=policy, uid=known.metadata.get("uid") if known else None,
                             namespace=None, reason=reason, message=message, type_=type_)

    def _post_event(self, **event: Any) -> None:
        """Through the background sender when there is one (the operator's), else here and now."""
        if self.events is not None:
            self.events.send(**event)
        else:
            self.api.emit_event(**event)

    # ---- revisions ----

    def _baseline(self) -> tuple[dict[str, Any], dict[str, Any]]:
        cm = self.api.read_configmap(self.config.baseline_configmap)
        ds = self.api.read_daemonset(self.config.baseline_daemonset)
        if cm is None or ds is None:
            missing = self.config.baseline_configmap if cm is None else self.config.baseline_daemonset
            raise StepBlocked(f"baseline kube-proxy object {self.config.kube_proxy_namespace}/{missing} not found")
        return cm, ds

    def _do_EnsureRevision(self, action: w.EnsureRevision, policies: dict[str, ProxyPolicy]) -> None:
        if action.existing and not self.kept.due(action.revision):
            return
        cm, ds = self._baseline()
        rendered = render.render_revision(policies[action.policy], cm, ds)
        if rendered.name != action.revision:
            raise StepBlocked(f"revision {action.revision} no longer matches the spec (now {rendered.name})")
        self.ensure_baseline_affinity(ds)
        try:
            if rendered.node_config is not None:
                self._apply_node_config(rendered.node_config, rendered.mode)
            # A replacement revision's ConfigMap is its record (the revision index sees it): after its node config.
            self.api.apply_configmap(rendered.configmap)
            if rendered.kube_proxy_daemonset is not None:
                self.api.apply_daemonset(rendered.kube_proxy_daemonset)
            self.kept.applied(action.revision)
        except ApiException as exc:
            if not action.existing:
                raise
            # Keeping an existing revision as rendered must not stop the policy's rollout and status:
            # its nodes run the revision as it is. Counted, so the reconcile-errors alert sees it.
            metrics.RECONCILE_ERRORS.labels(action.policy, f"revision-apply-api{exc.status}").inc()
            log.warning("could not apply revision %s again: %s", action.revision, describe_api_error(exc))

    def _apply_node_config(self, node_config: dict[str, Any], mode: str) -> None:
        try:
            self.api.apply_node_config(node_config)
        except ApiException as exc:
            if exc.status != 404:
                raise
            raise StepBlocked(f"the cluster does not serve {node_config['kind']} ({node_config['apiVersion']}): "
                              f"install Cilium with its CRDs before moving nodes to {mode}") from exc

    def ensure_baseline_affinity(self, ds: dict[str, Any]) -> None:
        """Keep the baseline DaemonSet off nodes that carry a revision label, once; record the exact undo."""
        pair = render.affinity_patch_pair(ds)
        if pair is None:
            return
        forward, undo = pair
        ops = list(forward.patch)
        if not (ds.get("metadata") or {}).get("annotations"):
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
        ops.append({"op": "add", "path": _annotation_path(BASELINE_PATCH_ANNOTATION),
                    "value": json.dumps(undo.patch, sort_keys=True)})
        self.api.json_patch_daemonset(self.config.baseline_daemonset, jsonpatch.JsonPatch(ops))

    def undo_baseline_affinity(self) -> None:
        """Return the baseline DaemonSet to exactly what it was before proxyshift touched it."""
        ds = self.api.read_daemonset(self.config.baseline_daemonset)
        if ds is None:
            return
        recorded = ((ds.get("metadata") or {}).get("annotations") or {}).get(BASELINE_PATCH_ANNOTATION)
        forget = [{"op": "remove", "path": _annotation_path(BASELINE_PATCH_ANNOTATION)}] if recorded else []
        if recorded:
            # The exact inverse recorded when the affinity was added; it applies only if nobody has
            # changed the affinity since (its own test operations), else fall back to the live object.
            exact = jsonpatch.JsonPatch([*json.loads(recorded), *forget])
            try:
                exact.apply(ds)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                pass
            else:
                self.api.json_patch_daemonset(self.config.baseline_daemonset, exact)
                return
        undo = render.undo_baseline_affinity_patch(ds)
        ops = [*(undo.patch if undo is not None else []), *forget]
        if ops:
            self.api.json_patch_daemonset(self.config.baseline_daemonset, jsonpatch.JsonPatch(ops))

    def _do_DeleteRevision(self, action: w.DeleteRevision, _: dict[str, ProxyPolicy]) -> None:
        cm_name, ds_name = render.revision_object_names(action.revision)
        self.api.delete_daemonset(ds_name)
        for api_version, kind, name in render.node_config_names(action.revision):
            self.api.delete_node_config(api_version, kind, name)
        self.api.delete_configmap(cm_name)

    # ---- nodes ----

    def _do_EnsureProxyNode(self, action: w.EnsureProxyNode, _: dict[str, ProxyPolicy]) -> Written:
        rv = self.api.ensure_proxynode(action.node, self.node_uids.get(action.node), {"policy": action.policy},
                                       replace=False)
        return Written("proxynode_index", action.node, rv)

    def _do_SetMigration(self, action: w.SetMigration, _: dict[str, ProxyPolicy]) -> Written:
        spec: dict[str, Any] = {
            "policy": action.policy,
            "revision": action.revision,
            "mode": action.mode,
            "scheduler": action.scheduler,
            "migration": action.migration.to_k8s() if action.migration else None,
            "operation": action.operation.to_k8s() if action.operation else None,
            "diagnose": action.diagnose.to_k8s() if action.diagnose else None,
        }
        # ensure_proxynode replaces the spec of the existing ProxyNode (or creates it): None removes a
        # field, so a finished operation is cleared explicitly.
        rv = self.api.ensure_proxynode(action.node, self.node_uids.get(action.node), spec)
        return Written("proxynode_index", action.node, rv)

    def _do_SetRevisionLabel(self, action: w.SetRevisionLabel, _: dict[str, ProxyPolicy]) -> Written:
        return Written("node_index", action.node,
                       self.api.set_node_label(action.node, w.REVISION_LABEL, action.revision,
                                               with_labels=dict(action.labels)))

    def _do_Cordon(self, action: w.Cordon, _: dict[str, ProxyPolicy]) -> Written:
        return Written("node_index", action.node, self.api.set_unschedulable(action.node, True))

    def _do_Uncordon(self, action: w.Uncordon, _: dict[str, ProxyPolicy]) -> Written:
        return Written("node_index", action.node, self.api.set_unschedulable(action.node, False))

    def _do_Drain(self, action: w.Drain, policies: dict[str, ProxyPolicy]) -> None:
        remaining, blocked = self.api.evict_pods(action.node)
        if blocked:
            message = f"drain of {action.node} waits: " + "; ".join(blocked[:5])
            if self._drain_said.get(action.node) != message:
                # Said once per new reason: the rollout retries every few seconds while a budget refuses.
                self._drain_said[action.node] = message
                self._emit(action.node, None, "DrainBlocked", message, "Warning", policies)
            raise StepBlocked(message)
        self._drain_said.pop(action.node, None)
        if remaining:
            # The planner records the switch only after Drain returns: wait until the pods are gone.
            raise StepBlocked(f"drain of {action.node}: {remaining} pods still terminating")

    # ---- policy ----

    def _do_RecordStatus(self, action: w.RecordStatus, _: dict[str, ProxyPolicy]) -> None:
        status = action.status.to_k8s()
        self.api.patch_policy_status(action.policy, status)

    def _do_RemoveFinalizer(self, action: w.RemoveFinalizer, _: dict[str, ProxyPolicy]) -> None:
        # kopf owns the finalizer: the delete handler returning (instead of asking to retry) removes it.
        return None

    def _do_Event(self, action: w.Event, policies: dict[str, ProxyPolicy]) -> None:
        self._emit(action.node, action.policy, action.reason, action.message, action.type, policies)


# The dispatch table: the API call(s) of each planner action type (a unit test checks every type has one).
# Each handler takes the action of its own key; the table's type cannot say so, hence Any.
ActionHandler = Callable[[Executor, Any, dict[str, ProxyPolicy]], Written | None]
ACTION_HANDLERS: Mapping[type[w.Action], ActionHandler] = MappingProxyType({
    w.EnsureRevision: Executor._do_EnsureRevision,
    w.DeleteRevision: Executor._do_DeleteRevision,
    w.EnsureProxyNode: Executor._do_EnsureProxyNode,
    w.SetMigration: Executor._do_SetMigration,
    w.SetRevisionLabel: Executor._do_SetRevisionLabel,
    w.Cordon: Executor._do_Cordon,
    w.Uncordon: Executor._do_Uncordon,
    w.Drain: Executor._do_Drain,
    w.RecordStatus: Executor._do_RecordStatus,
    w.RemoveFinalizer: Executor._do_RemoveFinalizer,
    w.Event: Executor._do_Event,
})
