"""ProxyNode status is bounded: in the CRD, in the agent's writes, and in what the operator accepts."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxyshift.api.proxynode import (
    MAX_DETAILS_PROPERTIES,
    MAX_STATUS_MODULES,
    OPERATION_ID_LIMIT,
    STATUS_MESSAGE_LIMIT,
    STATUS_TEXT_LIMIT,
    NodeMigration,
    ProxyNodeStatus,
    clip_status,
)
from proxyshift.controller.fleet import proxynode_item
from proxyshift.planner.machine import op_id
from proxyshift.render.names import MAX_REVISION, revision_name

pytestmark = pytest.mark.unit


def _schema() -> dict:
    with open("crds/proxynode.yaml") as fh:
        crd = yaml.safe_load(fh)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]


def unbounded(schema: dict[str, Any], path: str = "status") -> list[str]:
    """Every place of an OpenAPI schema where an agent could write without limit: a string without maxLength
    (or enum), an array without maxItems, an object whose keys are free (additionalProperties or
    x-kubernetes-preserve-unknown-fields) without maxProperties. Walks properties, items,
    additionalProperties and anyOf/oneOf/allOf, all the way down."""
    found = []
    kind = schema.get("type")
    if kind == "string" and "maxLength" not in schema and "enum" not in schema:
        found.append(f"{path}: a string without maxLength")
    if kind == "array" and "maxItems" not in schema:
        found.append(f"{path}: an array without maxItems")
    free_keys = schema.get("additionalProperties") not in (None, False) or schema.get(
        "x-kubernetes-preserve-unknown-fields")
    if (kind == "object" or free_keys) and free_keys and "maxProperties" not in schema:
        found.append(f"{path}: an object with free keys without maxProperties")
    for name, sub in schema.get("properties", {}).items():
        found += unbounded(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found += unbounded(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += unbounded(schema["additionalProperties"], f"{path}{{}}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            found += unbounded(sub, f"{path}<{key}[{i}]>")
    return found


def test_every_string_list_and_map_of_the_status_is_bounded_in_the_crd() -> None:
    """The whole generated status schema, recursively: nothing an agent writes is without a bound."""
    assert unbounded({"type": "object", "properties": _schema()}) == []
    # and the bounds are the ones the agent clips to (clip_status), spot-checked
    status = _schema()
    assert status["kernelRelease"]["maxLength"] == STATUS_TEXT_LIMIT
    assert status["modules"]["maxItems"] == MAX_STATUS_MODULES and status["modules"]["items"]["maxLength"] == 64
    assert status["tools"]["maxProperties"] == 16
    assert status["lastOperation"]["properties"]["message"]["maxLength"] == STATUS_MESSAGE_LIMIT
    assert status["lastOperation"]["properties"]["id"]["maxLength"] == OPERATION_ID_LIMIT
    assert status["lastOperation"]["properties"]["details"]["maxProperties"] == MAX_DETAILS_PROPERTIES
    assert status["kubeProxy"]["properties"]["error"]["maxLength"] == STATUS_MESSAGE_LIMIT
    assert status["objects"]["maxItems"] == 8 and status["leftovers"]["maxItems"] == 8


@pytest.mark.parametrize(("schema", "finding"), [
    ({"type": "string"}, "status: a string without maxLength"),
    ({"type": "array", "items": {"type": "string", "maxLength": 3}}, "status: an array without maxItems"),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}},
     "status: an object with free keys without maxProperties"),
    ({"type": "object", "x-kubernetes-preserve-unknown-fields": True},
     "status: an object with free keys without maxProperties"),
    ({"type": "object", "properties": {"a": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"b": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}},
     "status.a[].b<anyOf[1]>: a string without maxLength"),
])
def test_the_walk_finds_an_unbounded_field_at_any_depth(schema: dict[str, Any], finding: str) -> None:
    assert unbounded(schema) == [finding]


def test_the_walk_accepts_bounded_and_enumerated_fields() -> None:
    assert unbounded({"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 3}, "e": {"type": "string", "enum": ["a"]},
        "l": {"type": "array", "maxItems": 1, "items": {"type": "integer"}},
        "m": {"type": "object", "maxProperties": 2, "additionalProperties": {"type": "boolean"}}}}) == []


def test_the_longest_operation_id_the_planner_makes_fits_the_bound() -> None:
    """The operation ids the operator writes (spec.operation.id, copied to status.lastOperation.id) are far
    inside OPERATION_ID_LIMIT: the longest revision name, a huge attempt count, the longest step name."""
    revision = revision_name("p" * 253, "f" * 10)
    assert len(revision) == MAX_REVISION
    m = NodeMigration(to_revision=revision, attempt=10**9, started_at="2026-12-03T14:00:00.123456Z")
    longest = max(len(op_id(m, step, 999)) for step in ("Preflight", "Hold", "Cleanup", "Probe", "RollbackCleanup"))
    assert longest <= OPERATION_ID_LIMIT // 2, longest


huge = st.text(min_size=0, max_size=6000)


@given(kernel=huge, message=huge, error=huge, modules=st.lists(st.text(max_size=80), max_size=300),
       tools=st.dictionaries(st.text(max_size=10), huge, max_size=30))
def test_an_agent_patch_clipped_to_the_bounds_always_validates(kernel: str, message: str, error: str,
                                                               modules: list[str], tools: dict[str, str]) -> None:
    patch = {"kernelRelease": kernel, "modules": modules, "tools": tools,
             "kubeProxy": {"error": error, "metricsInvalid": error, "proxyMode": kernel, "probedAt": kernel},
             "lastOperation": {"id": message, "type": kernel, "state": "Succeeded", "message": message,
                               "startedAt": kernel, "finishedAt": kernel},
             "objects": [{"mode": "iptables", "count": 1, "summary": message}] * 12,
             "leftovers": ["ipvs"] * 12}
    ProxyNodeStatus.model_validate(clip_status(patch))


def test_the_operator_ignores_a_proxynode_it_cannot_read_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    body = {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode", "metadata": {"name": "n1"},
            "spec": {}, "status": {"kernelRelease": "x" * (STATUS_TEXT_LIMIT + 1)}}
    with caplog.at_level(logging.WARNING, logger="proxyshift.operator"):
        assert proxynode_item(body) is None
    assert "ProxyNode n1 is invalid and is ignored" in caplog.text
    good = dict(body, status={"kernelRelease": "6.1.0-18-amd64"})
    found = proxynode_item(good)
    assert found is not None and found[0] == "n1"


def test_the_operator_keeps_only_the_metadata_it_reads_of_a_proxynode() -> None:
    # Server-side apply's managedFields name every field the operator and the agent wrote: kept for every
    # node of the fleet they were most of the operator's memory of it (docs/benchmarks.md, controller scale).
    managed = [{"manager": "proxyshift", "operation": "Apply", "apiVersion": "proxyshift.io/v1alpha1",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {f"f:field{i}": {} for i in range(40)}}}]
    meta = {"name": "n1", "uid": "u-1", "resourceVersion": "42", "generation": 3, "managedFields": managed,
            "labels": {"app.kubernetes.io/managed-by": "proxyshift"}, "annotations": {"note": "x" * 1000},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "node-uid"}]}
    body: dict[str, Any] = {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode", "metadata": meta,
            "spec": {"policy": "blue", "mode": "nftables"}, "status": {"observedMode": "iptables"}}
    found = proxynode_item(body)
    assert found is not None
    name, pn = found
    assert name == pn.name == "n1"
    assert pn.metadata == {"name": "n1", "uid": "u-1", "resourceVersion": "42", "generation": 3}
    assert pn.spec.policy == "blue" and pn.status.observed_mode == "iptables"
    assert body["metadata"]["managedFields"] == managed  # the watch's object is not changed
