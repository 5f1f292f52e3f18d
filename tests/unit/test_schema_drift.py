"""The served CRD schemas against this version's (api/schema_drift.py): an old CRD's API server drops new fields
without an error, so the operator looks before it writes anything."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxyshift.api.schema_drift import (
    MESSAGE_LIST_LIMIT,
    Drift,
    crd_drift,
    describe,
    expected_schemas,
    schema_drift,
    served_schemas,
)

pytestmark = pytest.mark.unit


def document_of(schemas: dict[str, Any], group: str = "proxyshift.io", version: str = "v1alpha1") -> dict[str, Any]:
    """An OpenAPI v3 document as the API server publishes one group-version: each kind's schema under a name of
    its own, stamped with its group-version-kind, metadata as a reference to ObjectMeta."""
    published = {}
    for kind, schema in schemas.items():
        body = copy.deepcopy(schema)
        body["properties"]["metadata"] = {"allOf": [{"$ref": "#/components/schemas/ObjectMeta"}]}
        body["x-kubernetes-group-version-kind"] = [{"group": group, "kind": kind, "version": version}]
        published[f"io.proxyshift.{version}.{kind}"] = body
        published[f"io.proxyshift.{version}.{kind}List"] = {
            "type": "object", "x-kubernetes-group-version-kind": [{"group": group, "kind": f"{kind}List",
                                                                  "version": version}]}
    return {"openapi": "3.0.0", "components": {"schemas": published}}


def test_the_crds_this_version_generates_show_no_drift() -> None:
    assert crd_drift(document_of(expected_schemas())) == []


def test_a_missing_field_is_named_once_at_its_top() -> None:
    old = expected_schemas()
    migration = old["ProxyNode"]["properties"]["spec"]["properties"]["migration"]["properties"]
    del migration["probeSaid"]
    del old["ProxyNode"]["properties"]["status"]["properties"]["hold"]  # an object with fields of its own

    assert crd_drift(document_of(old)) == [
        Drift("ProxyNode", ".spec.migration.probeSaid", "missing (the API server drops it)"),
        Drift("ProxyNode", ".status.hold", "missing (the API server drops it)"),
    ]


def test_types_enums_bounds_lists_and_maps_are_compared_and_preserved_subtrees_are_not() -> None:
    ours = {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["iptables", "nftables"]},
        "limit": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "ports": {"type": "array", "items": {"type": "object", "properties": {"port": {"type": "integer"},
                                                                              "name": {"type": "string"}}}},
        "labels": {"type": "object", "additionalProperties": {"type": "object", "properties": {
            "value": {"type": "string"}, "since": {"type": "string"}}}},
        "free": {"type": "object", "properties": {"anything": {"type": "string"}}},
        "names": {"type": "array", "maxItems": 16, "items": {"type": "string", "maxLength": 64}},
        "count": {"type": "integer", "minimum": 0},
    }}
    served = {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["iptables"]},
        "limit": {"type": "integer"},
        "ports": {"type": "array", "items": {"type": "object", "properties": {"port": {"type": "integer"}}}},
        "labels": {"type": "object", "additionalProperties": {"type": "object", "properties": {
            "value": {"type": "string"}}}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "names": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 64}},
        "count": {"type": "integer", "minimum": 1},
    }}
    assert [str(d) for d in schema_drift("Thing", ours, served)] == [
        "Thing .mode: the served schema refuses 'nftables'",
        "Thing .limit: type int-or-string, served as integer",
        "Thing .ports[].name: missing (the API server drops it)",
        "Thing .labels{}.since: missing (the API server drops it)",
        "Thing .names: maxItems 8 served, 16 here",
        "Thing .count: minimum 1 served, 0 here",
    ]


def test_a_kind_the_document_does_not_serve_is_a_drift_and_other_groups_are_not_read() -> None:
    schemas = expected_schemas()
    document = document_of({"ProxyPolicy": schemas["ProxyPolicy"]})
    elsewhere = document_of({"ProxyNode": {"type": "object", "properties": {}}}, group="example.com")
    document["components"]["schemas"].update(elsewhere["components"]["schemas"])

    assert set(served_schemas(document)) == {"ProxyPolicy", "ProxyPolicyList"}
    assert crd_drift(document) == [Drift("ProxyNode", ".", "not in the API server's OpenAPI document")]


def test_the_message_lists_the_first_differences_and_counts_the_rest() -> None:
    drifts = [Drift("ProxyNode", f".status.f{i}", "missing (the API server drops it)") for i in range(11)]

    text = describe(drifts)

    assert text.count("missing") == MESSAGE_LIST_LIMIT
    assert text.startswith("ProxyNode .status.f0: missing") and text.endswith("; and 3 more")
