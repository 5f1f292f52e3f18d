"""The bad-manifest table against a real API server: each bad ProxyPolicy is refused with its message.

Replays tests/fixtures/bad-policies/*.yaml (tests/support/bad_policies.py; the same files the unit table
checks against the models and the CRD's rules) with a server-side dry run and
strict field validation, as `kubectl apply` does: nothing is stored, so the
cases need no cleanup and do not disturb the operator.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.bad_policies import CASES

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "proxypolicy.yaml"
GROUP, VERSION, PLURAL = "proxyshift.io", "v1alpha1", "proxypolicies"


@pytest.fixture(scope="module")
def custom_objects(kubeconfig: Path) -> Any:
    """A CustomObjectsApi on a cluster where the committed ProxyPolicy CRD is installed and Established."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    ext = client.ApiextensionsV1Api(api_client)
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    name = crd["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(crd)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        live = ext.read_custom_resource_definition(name)
        assert live.metadata is not None
        crd["metadata"]["resourceVersion"] = live.metadata.resource_version
        ext.replace_custom_resource_definition(name, crd)
    deadline = time.monotonic() + 60
    while True:
        status = ext.read_custom_resource_definition(name).status
        conditions = {c.type: c.status for c in (status.conditions or [])} if status else {}
        if conditions.get("Established") == "True":
            break
        if time.monotonic() > deadline:
            pytest.fail(f"CRD {name} not Established after 60s: {conditions}")
        time.sleep(0.5)
    return client.CustomObjectsApi(api_client)


def _dry_run_create(api: Any, body: dict[str, Any]) -> Any:
    return api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body, dry_run="All", field_validation="Strict")


def _unique(body: dict[str, Any]) -> dict[str, Any]:
    # A policy of that name may really exist (the operator's e2e applies the samples): a dry-run
    # create would then fail with AlreadyExists before telling anything about validity.
    return {**body, "metadata": {**body.get("metadata", {}), "name": f"dry-run-{uuid.uuid4().hex[:8]}"}}


@pytest.mark.parametrize(("name", "meta", "manifest"), CASES, ids=[c[0] for c in CASES])
def test_api_server_refuses_with_the_message(name: str, meta: dict[str, str], manifest: dict[str, Any],
                                             custom_objects: Any) -> None:
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as info:
        _dry_run_create(custom_objects, manifest)
    assert info.value.status in (400, 422), info.value.body
    assert info.value.body is not None
    message = json.loads(info.value.body).get("message", "")
    assert meta["apiserver"] in message, f"{name}: the API server said: {message}"
    assert meta["field"] in message, f"{name}: the API server said: {message}"


def test_empty_node_selector_is_accepted(custom_objects: Any) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyPolicy", "metadata": {"name": "every-node"},
            "spec": {"nodeSelector": {}, "mode": "nftables"}}
    created = _dry_run_create(custom_objects, _unique(body))
    # The server applied the schema's defaults, so the rules saw the effective values.
    assert created["spec"]["nodeSelector"] == {}
    assert created["spec"]["deletionPolicy"] == "Revert"


@pytest.mark.parametrize("sample", sorted((ROOT / "config" / "samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_samples_are_accepted(sample: Path, custom_objects: Any) -> None:
    _dry_run_create(custom_objects, _unique(yaml.safe_load(sample.read_text(encoding="utf-8"))))
