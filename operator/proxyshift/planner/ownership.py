"""Which policy owns which node.

Rules, in order:
1. A node mid-migration stays with the policy that started it until the migration ends: handing
   a half-switched node to another policy would leave two state machines on one node.
2. Otherwise the oldest live (not deleting) policy whose selector matches the node owns it, by
   metadata.creationTimestamp then name. A newer policy that also matches reports Conflict.
3. Otherwise the policy recorded in ProxyNode.spec.policy keeps it if the node still carries one of
   that policy's revisions, so that it can take the node back to the baseline (the node left the
   pool, or the policy is being deleted with deletionPolicy Revert). Nobody else would.

A control-plane node (label node-role.kubernetes.io/control-plane, or the older .../master) counts
as selected only by a policy with `controlPlaneNodes: Include`. A kube-proxy that fails there can
cut the control plane's own Service paths (webhooks, aggregated APIs), so a broad selector such as
{} must not reach it by accident. A policy whose selector matches one it skips lists it in
`skipped_by`, and does not take it back to the baseline either (rule 3): "skip" means untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyshift.api.policy import ProxyPolicy
from proxyshift.planner.machine import is_in_flight
from proxyshift.planner.world import World

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


@dataclass(frozen=True)
class Ownership:
    owner: str | None
    selected_by: tuple[str, ...]  # live policies whose selector matches, oldest first
    skipped_by: tuple[str, ...] = ()  # live policies whose selector matches a control-plane node they skip


def is_control_plane(labels: dict[str, str]) -> bool:
    return any(key in labels for key in CONTROL_PLANE_LABELS)


def selects(policy: ProxyPolicy, labels: dict[str, str]) -> bool:
    """Whether the policy takes a node with these labels: its selector, minus skipped control-plane nodes."""
    if not policy.spec.node_selector.matches(labels):
        return False
    return policy.spec.control_plane_nodes == "Include" or not is_control_plane(labels)


def policy_age_key(policy: ProxyPolicy) -> tuple[str, str]:
    # RFC 3339 timestamps in UTC sort as strings; a policy without one (not yet stored) sorts last.
    return (str(policy.metadata.get("creationTimestamp") or "~"), policy.name)


def is_deleting(policy: ProxyPolicy) -> bool:
    return bool(policy.metadata.get("deletionTimestamp"))


def revision_policy(world: World, revision: str | None) -> str | None:
    if revision is None:
        return None
    view = world.revisions.get(revision)
    if view is not None:
        return view.policy
    # A label naming a revision that no longer exists: fall back on the "<policy>-<hash>" shape.
    for name in world.policies:
        if revision.startswith(f"{name}-") and "-" not in revision[len(name) + 1 :]:
            return name
    return None


def compute_ownership(world: World) -> dict[str, Ownership]:
    live = sorted((p for p in world.policies.values() if not is_deleting(p)), key=policy_age_key)
    result: dict[str, Ownership] = {}
    for name, node in world.nodes.items():
        if not node.exists:
            continue
        selected_by = tuple(p.name for p in live if selects(p, node.labels))
        skipped_by = tuple(p.name for p in live if p.name not in selected_by
                           and p.spec.node_selector.matches(node.labels))
        pn = world.proxynodes.get(name)
        recorded = pn.spec.policy if pn is not None else None
        owner: str | None = None
        if recorded in world.policies and pn is not None and is_in_flight(pn.spec.migration):
            owner = recorded
        elif selected_by:
            owner = selected_by[0]
        elif (recorded in world.policies and recorded not in skipped_by
              and revision_policy(world, node.revision) == recorded):
            owner = recorded
        result[name] = Ownership(owner, selected_by, skipped_by)
    return result
