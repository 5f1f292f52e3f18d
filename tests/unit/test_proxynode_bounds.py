"""ProxyNode status is bounded: in the CRD, in the agent's writes, and in what the operator accepts."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxyshift.api.proxynode import (
    MAX_STATUS_MODULES,
    STATUS_MESSAGE_LIMIT,
    STATUS_TEXT_LIMIT,
    ProxyNodeStatus,
    clip_status,
)
from proxyshift.controller.fleet import proxynode_item

pytestmark = pytest.mark.unit


def _schema() -> dict:
    with open("crds/proxynode.yaml") as fh:
        crd = yaml.safe_load(fh)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]


def test_every_agent_written_string_and_list_is_bounded_in_the_crd() -> None:
    status = _schema()
    assert status["kernelRelease"]["maxLength"] == STATUS_TEXT_LIMIT
    assert status["modules"]["maxItems"] == MAX_STATUS_MODULES and status["modules"]["items"]["maxLength"] == 64
    assert status["tools"]["maxProperties"] == 16
    assert status["lastOperation"]["properties"]["message"]["maxLength"] == STATUS_MESSAGE_LIMIT
    assert status["kubeProxy"]["properties"]["error"]["maxLength"] == STATUS_MESSAGE_LIMIT
    assert status["objects"]["maxItems"] == 8 and status["leftovers"]["maxItems"] == 8


huge = st.text(min_size=0, max_size=6000)


@given(kernel=huge, message=huge, error=huge, modules=st.lists(st.text(max_size=80), max_size=300),
       tools=st.dictionaries(st.text(max_size=10), huge, max_size=30))
def test_an_agent_patch_clipped_to_the_bounds_always_validates(kernel: str, message: str, error: str,
                                                               modules: list[str], tools: dict[str, str]) -> None:
    patch = {"kernelRelease": kernel, "modules": modules, "tools": tools,
             "kubeProxy": {"error": error},
             "lastOperation": {"id": "x", "type": "Probe", "state": "Succeeded", "message": message},
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
