"""Server-side apply: the operator's field manager and the managedFields arithmetic it needs. Pure.

Every object the operator manages (revision ConfigMaps and DaemonSets, ProxyNode specs) is written as an
apply of the whole rendered object under the field manager `proxyshift`. The API server then does what
a hand-written "desired is a subset of live" diff used to: server defaults and fields other managers set
are left alone, an unchanged apply writes nothing (no new resourceVersion, no rollout), and a field the
operator applied before and no longer applies is removed.

That last rule only covers fields the manager `proxyshift` (operation Apply) owns. A field another
manager owns (a ProxyNode written before the operator used apply, or a person's `kubectl edit`) stays
when the operator stops applying it. For the ProxyNode spec, which the operator alone owns by contract,
`take_spec_ownership` moves such ownership to `proxyshift` (what `kubectl apply --server-side` does
when it upgrades client-side-applied objects, k8s.io/client-go/util/csaupgrade), so the next apply
removes what the planner dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

FIELD_MANAGER = "proxyshift"
APPLY_PATCH = "application/apply-patch+yaml"
APPLY = "Apply"
SPEC = "f:spec"


def _is_ours(entry: Mapping[str, Any], manager: str) -> bool:
    return entry.get("manager") == manager and entry.get("operation") == APPLY and not entry.get("subresource")


def union_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The union of two FieldsV1 sets (tries of `f:`/`k:`/`v:`/`i:` keys, `.` marking the node itself)."""
    merged: dict[str, Any] = copy.deepcopy(dict(a))
    for key, value in b.items():
        if key in merged and isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key] = union_fields(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def foreign_spec_owners(managed_fields: Iterable[Mapping[str, Any]] | None, manager: str = FIELD_MANAGER) -> list[str]:
    """The managers other than `manager`'s Apply that own something under spec, as "manager (operation)"."""
    return [f"{e.get('manager')} ({e.get('operation')})" for e in managed_fields or ()
            if not _is_ours(e, manager) and (e.get("fieldsV1") or {}).get(SPEC)]


def take_spec_ownership(managed_fields: Iterable[Mapping[str, Any]] | None, api_version: str,
                        manager: str = FIELD_MANAGER) -> list[dict[str, Any]] | None:
    """managedFields with every other manager's spec fields moved into `manager`'s Apply entry.

    None when no other manager owns anything under spec (nothing to do). An entry left owning nothing
    is dropped, as the API server drops empty entries itself.
    """
    entries = [copy.deepcopy(dict(e)) for e in managed_fields or ()]
    taken: dict[str, Any] = {}
    kept: list[dict[str, Any]] = []
    for entry in entries:
        fields = entry.get("fieldsV1") or {}
        if _is_ours(entry, manager) or not fields.get(SPEC):
            kept.append(entry)
            continue
        taken = union_fields(taken, {SPEC: fields[SPEC]})
        rest = {k: v for k, v in fields.items() if k != SPEC}
        if rest:
            kept.append({**entry, "fieldsV1": rest})
    if not taken:
        return None
    ours = next((e for e in kept if _is_ours(e, manager)), None)
    if ours is None:
        ours = {"manager": manager, "operation": APPLY, "apiVersion": api_version, "fieldsType": "FieldsV1",
                "fieldsV1": {}}
        kept.append(ours)
    ours["fieldsV1"] = union_fields(ours.get("fieldsV1") or {}, taken)
    return kept
