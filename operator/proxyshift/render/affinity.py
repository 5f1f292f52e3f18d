"""The one change proxyshift makes to the baseline kube-proxy DaemonSet, as JSON patches.

The baseline must leave the nodes that a revision runs on: it gets the
required node affinity `proxyshift.io/revision DoesNotExist`, once. Node
selector terms are ORed and the expressions inside a term ANDed, so the
expression is added to every term: the baseline then runs exactly where it
ran before AND the node has no revision label. An empty term matches no node
at all; it is left alone, since adding the expression would make it match.

Two ways back:
- `affinity_patch_pair(ds)` gives the forward patch and its exact inverse,
  guarded by `test` operations, so the inverse fails (instead of removing
  something else) if the DaemonSet changed in between; the operator records it.
- `undo_baseline_affinity_patch(ds)` works from the live object alone (after a
  restart, or when nothing was recorded): it removes our expression and the
  containers that held nothing else.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from proxyshift.render.names import LABEL_REVISION

POD_SPEC = "/spec/template/spec"
AFFINITY = f"{POD_SPEC}/affinity"
NODE_AFFINITY = f"{AFFINITY}/nodeAffinity"
REQUIRED = f"{NODE_AFFINITY}/requiredDuringSchedulingIgnoredDuringExecution"
TERMS = f"{REQUIRED}/nodeSelectorTerms"


def revision_expression() -> dict[str, str]:
    return {"key": LABEL_REVISION, "operator": "DoesNotExist"}


def _is_ours(expr: Any) -> bool:
    return isinstance(expr, dict) and expr.get("key") == LABEL_REVISION and expr.get("operator") == "DoesNotExist" \
        and not expr.get("values")


def _is_empty_term(term: Any) -> bool:
    return not isinstance(term, dict) or (not term.get("matchExpressions") and not term.get("matchFields"))


def _pod_spec(ds: dict[str, Any]) -> dict[str, Any]:
    try:
        pod = ds["spec"]["template"]["spec"]
    except (KeyError, TypeError) as exc:
        raise ValueError("not a DaemonSet: no spec.template.spec") from exc
    if not isinstance(pod, dict):
        raise ValueError("not a DaemonSet: spec.template.spec is not an object")
    return pod


def _forward_ops(ds: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(forward ops, inverse ops in application order) for the affinity the DaemonSet lacks."""
    pod = _pod_spec(ds)
    term = {"matchExpressions": [revision_expression()]}

    def create(path: str, value: Any, existed: bool, old: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        forward = [{"op": "add", "path": path, "value": value}]
        undo = [{"op": "test", "path": path, "value": value}]
        # A member that existed as null or {} is put back as it was; one that did not is removed.
        undo.append({"op": "replace", "path": path, "value": old} if existed else {"op": "remove", "path": path})
        return forward, undo

    affinity = pod.get("affinity")
    if not isinstance(affinity, dict):
        return create(AFFINITY, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}}, "affinity" in pod, affinity)
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, dict):
        return create(NODE_AFFINITY, {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}, "nodeAffinity" in affinity, node_affinity)
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, dict):
        return create(REQUIRED, {"nodeSelectorTerms": [term]},
                      "requiredDuringSchedulingIgnoredDuringExecution" in node_affinity, required)
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list) or not terms:
        return create(TERMS, [term], "nodeSelectorTerms" in required, terms)

    forward: list[dict[str, Any]] = []
    undo: list[dict[str, Any]] = []
    for index, existing in enumerate(terms):
        if _is_empty_term(existing):
            continue
        expressions = existing.get("matchExpressions")
        if isinstance(expressions, list) and any(_is_ours(e) for e in expressions):
            continue
        path = f"{TERMS}/{index}/matchExpressions"
        if isinstance(expressions, list):
            at = f"{path}/{len(expressions)}"
            forward.append({"op": "add", "path": f"{path}/-", "value": revision_expression()})
            undo[:0] = [{"op": "test", "path": at, "value": revision_expression()}, {"op": "remove", "path": at}]
        else:
            f, u = create(path, [revision_expression()], "matchExpressions" in existing, expressions)
            forward += f
            undo[:0] = u
    return forward, undo


def baseline_affinity_patch(ds: dict[str, Any]) -> jsonpatch.JsonPatch | None:
    """The patch that keeps the baseline DaemonSet off nodes with a revision label; None if already there."""
    forward, _ = _forward_ops(ds)
    return jsonpatch.JsonPatch(forward) if forward else None


def affinity_patch_pair(ds: dict[str, Any]) -> tuple[jsonpatch.JsonPatch, jsonpatch.JsonPatch] | None:
    """(forward, exact inverse) for this DaemonSet; None if it already has the affinity everywhere."""
    forward, undo = _forward_ops(ds)
    if not forward:
        return None
    return jsonpatch.JsonPatch(forward), jsonpatch.JsonPatch(undo)


def undo_baseline_affinity_patch(ds: dict[str, Any]) -> jsonpatch.JsonPatch | None:
    """From the live DaemonSet alone: remove our expression everywhere, and what held only it."""
    pod = _pod_spec(ds)
    cleaned = without_revision_affinity(pod.get("affinity"))
    if cleaned == pod.get("affinity") or (cleaned is None and "affinity" not in pod):
        return None
    before = {"affinity": pod["affinity"]}
    after = {"affinity": cleaned} if cleaned is not None else {}
    ops = jsonpatch.make_patch(before, after).patch
    for op in ops:
        op["path"] = POD_SPEC + op["path"]
    # Guard: apply only to the affinity this undo was computed from.
    return jsonpatch.JsonPatch([{"op": "test", "path": AFFINITY, "value": pod["affinity"]}, *ops])


def without_revision_affinity(affinity: Any) -> dict[str, Any] | None:
    """A copy of a pod affinity without our expression and without containers that held only it."""
    if not isinstance(affinity, dict):
        return None
    result = copy.deepcopy(affinity)
    node_affinity = result.get("nodeAffinity")
    if not isinstance(node_affinity, dict):
        return result
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, dict) or not isinstance(required.get("nodeSelectorTerms"), list):
        return result
    removed = False
    kept_terms = []
    for term in required["nodeSelectorTerms"]:
        expressions = term.get("matchExpressions") if isinstance(term, dict) else None
        if not isinstance(expressions, list) or not any(_is_ours(e) for e in expressions):
            kept_terms.append(term)
            continue
        removed = True
        term["matchExpressions"] = [e for e in expressions if not _is_ours(e)]
        if not term["matchExpressions"]:
            del term["matchExpressions"]
        if term:  # a term that held only our expression was ours alone
            kept_terms.append(term)
    if not removed:
        return result
    if kept_terms:
        required["nodeSelectorTerms"] = kept_terms
    else:
        del node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        if not node_affinity:
            del result["nodeAffinity"]
    return result or None
