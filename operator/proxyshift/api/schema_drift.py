"""Whether the CRDs the API server serves can hold what this version of proxyshift writes.

Helm installs a chart's `crds/` only when they are absent and never upgrades them, so after `helm upgrade` a
new operator and its agents often run against the CRDs of an older release. The API server then drops
every field the old schema does not name (pruning) without an error: a field added since, say the rule
hold an agent reports in `status.hold`, is simply never stored, and the operator reads its absence as a
fact. A changed type or a value missing from an enum is refused instead, on the first write that needs it,
in the middle of a rollout.

The API server publishes each served CRD's schema in its OpenAPI v3 document
(`/openapi/v3/apis/<group>/<version>`, readable by every authenticated client through the default
`system:discovery` role). The operator compares it at its start with the schema its own models generate
(api/crdgen.py) and waits, saying which fields are missing or narrower, until the CRDs are upgraded.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxyshift.api.common import API_GROUP, API_VERSION

# Where a schema says "anything goes below here": nothing under it can be missing.
_PRESERVE = "x-kubernetes-preserve-unknown-fields"
# Kubernetes checks metadata itself; the published schema refers to ObjectMeta instead of spelling it out.
_SKIPPED = frozenset({"metadata"})
# Bounds a newer version may have widened, each with "the served one is narrower than ours": an old CRD's
# narrower bound refuses a write this version makes.
_BOUNDS: Mapping[str, Callable[[Any, Any], bool]] = MappingProxyType({
    **dict.fromkeys(("maxLength", "maxItems", "maxProperties", "maximum"), operator.lt),
    **dict.fromkeys(("minLength", "minItems", "minProperties", "minimum"), operator.gt),
})
# What a person runs to bring the CRDs up to this version (Helm's crds/ never are).
UPGRADE_COMMAND = "kubectl apply --server-side -k config/crd"
# How many differences a message lists before it only counts the rest.
MESSAGE_LIST_LIMIT = 8


@dataclass(frozen=True)
class Drift:
    """One way the served schema of `kind` falls short of ours at `path` (".spec.migration.probeSaid")."""

    kind: str
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.kind} {self.path}: {self.problem}"


def expected_schemas() -> dict[str, dict[str, Any]]:
    """Kind -> the openAPIV3Schema this version's models generate (what crds/ holds)."""
    from proxyshift.api.crdgen import RESOURCES, openapi_schema

    return {r.kind: openapi_schema(r.model, spec_required=r.spec_required) for r in RESOURCES}


def served_schemas(document: Mapping[str, Any], group: str = API_GROUP,
                   version: str = API_VERSION) -> dict[str, Mapping[str, Any]]:
    """Kind -> its schema in an OpenAPI v3 document of `group`/`version`, found by the group-version-kind the
    API server stamps on each (the schema's name is the API server's own convention, not relied on)."""
    schemas = (document.get("components") or {}).get("schemas") or {}
    found: dict[str, Mapping[str, Any]] = {}
    for schema in schemas.values():
        if not isinstance(schema, Mapping):
            continue
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            if isinstance(gvk, Mapping) and gvk.get("group") == group and gvk.get("version") == version \
                    and isinstance(gvk.get("kind"), str):
                found[gvk["kind"]] = schema
    return found


def schema_drift(kind: str, ours: Mapping[str, Any], served: Mapping[str, Any]) -> list[Drift]:
    """What `served` lacks of `ours`: properties it does not name (the API server would prune them), types
    that differ, enum values it refuses and bounds narrower than ours (it would refuse a write this version
    makes). Only the topmost missing property of a subtree is listed."""
    drifts: list[Drift] = []
    _compare(kind, "", ours, served, drifts)
    return drifts


def _compare(kind: str, path: str, ours: Mapping[str, Any], served: Mapping[str, Any], out: list[Drift]) -> None:
    if served.get(_PRESERVE):
        return
    here = path or "."
    if _type_of(ours) != _type_of(served):
        out.append(Drift(kind, here, f"type {_type_of(ours)}, served as {_type_of(served)}"))
        return
    refused = [v for v in ours.get("enum") or [] if "enum" in served and v not in served["enum"]]
    if refused:
        out.append(Drift(kind, here, "the served schema refuses " + ", ".join(map(repr, refused))))
    for bound, narrower in _BOUNDS.items():
        if bound in served and (bound not in ours or narrower(served[bound], ours[bound])):
            out.append(Drift(kind, here, f"{bound} {served[bound]} served, {ours.get(bound, 'none')} here"))
    served_props = served.get("properties") or {}
    for name, sub in (ours.get("properties") or {}).items():
        if path == "" and name in _SKIPPED:
            continue
        if name not in served_props:
            out.append(Drift(kind, f"{path}.{name}", "missing (the API server drops it)"))
        else:
            _compare(kind, f"{path}.{name}", sub, served_props[name], out)
    if isinstance(ours.get("items"), Mapping) and isinstance(served.get("items"), Mapping):
        _compare(kind, f"{path}[]", ours["items"], served["items"], out)
    if isinstance(ours.get("additionalProperties"), Mapping) \
            and isinstance(served.get("additionalProperties"), Mapping):
        _compare(kind, f"{path}{{}}", ours["additionalProperties"], served["additionalProperties"], out)


def _type_of(schema: Mapping[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    return str(schema.get("type") or "any")


def crd_drift(document: Mapping[str, Any], expected: Mapping[str, Mapping[str, Any]] | None = None, *,
              group: str = API_GROUP, version: str = API_VERSION) -> list[Drift]:
    """Every drift between this version's schemas (or `expected`) and those an OpenAPI v3 document of `group`
    serves; a kind the document does not serve at all is one drift of its own."""
    ours = expected if expected is not None else expected_schemas()
    served = served_schemas(document, group, version)
    drifts: list[Drift] = []
    for kind, schema in ours.items():
        if kind not in served:
            drifts.append(Drift(kind, ".", "not in the API server's OpenAPI document"))
        else:
            drifts.extend(schema_drift(kind, schema, served[kind]))
    return drifts


def describe(drifts: list[Drift]) -> str:
    """One line for a log or an error: the first differences, then how many more."""
    shown = "; ".join(str(d) for d in drifts[:MESSAGE_LIST_LIMIT])
    more = len(drifts) - MESSAGE_LIST_LIMIT
    return shown + (f"; and {more} more" if more > 0 else "")
