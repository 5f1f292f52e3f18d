"""The operator against the CRDs the API server really serves (api/schema_drift.py): Helm never upgrades a
chart's crds/, and an old CRD's API server drops new fields without an error.

Read with the operator's own ServiceAccount token, as in production: the default system:discovery role must
let it read the OpenAPI document, or the check would be skipped on every cluster."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from localcluster.install import OperatorProcess
from proxyshift.api.schema_drift import Drift, crd_drift, expected_schemas
from proxyshift.controller.kube import ClusterAPI
from tests.support.operator_harness import service_account_kubeconfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
POLICY_CRD = "proxypolicies.proxyshift.io"
# A copy of the ProxyNode CRD in a group of the test's own: nothing of proxyshift's is touched.
TEST_GROUP = "drift.e2e.proxyshift.io"
PUBLISHED_WITHIN = 60.0


@pytest.fixture(scope="module")
def operator_api(cluster: Any, proxyshift_installed: Path, tmp_path_factory: pytest.TempPathFactory) -> ClusterAPI:
    """ClusterAPI as the operator makes it, logged in with a fresh token of its ServiceAccount."""
    path = service_account_kubeconfig(cluster, "proxyshift-operator",
                                      tmp_path_factory.mktemp("drift") / "operator.kubeconfig")
    return ClusterAPI(config.new_client_from_config(config_file=str(path)))


@pytest.fixture(scope="module")
def extensions(proxyshift_installed: Path) -> client.ApiextensionsV1Api:
    return client.ApiextensionsV1Api(config.new_client_from_config(config_file=str(proxyshift_installed)))


def _until(what: str, check: Callable[[], Any], timeout: float = PUBLISHED_WITHIN) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g}s")
        time.sleep(0.5)


def _without(schema: dict[str, Any], *paths: tuple[str, ...]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)
    for path in paths:
        node = schema
        for name in path[:-1]:
            node = node["properties"][name]
        del node["properties"][path[-1]]
    return schema


def crd_check(kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """`proxyshift crd-check` as a person runs it before an upgrade."""
    return subprocess.run([sys.executable, "-m", "proxyshift.cli", "crd-check", "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_operator_reads_the_served_schemas_and_the_installed_crds_hold_all_it_writes(
        operator_api: ClusterAPI, proxyshift_installed: Path) -> None:
    document = operator_api.served_openapi()

    assert document is not None, "the operator's ServiceAccount could not read /openapi/v3"
    assert crd_drift(document) == []
    checked = crd_check(proxyshift_installed)
    assert checked.returncode == 0 and "hold everything" in checked.stdout, (checked.stdout, checked.stderr)


@pytest.fixture
def old_proxynode_crd(extensions: client.ApiextensionsV1Api) -> Iterator[None]:
    """The ProxyNode CRD as an older release had it (no status.hold, no spec.migration.probeSaid), served under
    TEST_GROUP; deleted afterwards."""
    crd = yaml.safe_load((ROOT / "crds" / "proxynode.yaml").read_text(encoding="utf-8"))
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{TEST_GROUP}"
    crd["spec"]["group"] = TEST_GROUP
    version = crd["spec"]["versions"][0]
    version["schema"]["openAPIV3Schema"] = _without(version["schema"]["openAPIV3Schema"], ("status", "hold"),
                                                    ("spec", "migration", "probeSaid"))
    extensions.create_custom_resource_definition(crd)
    try:
        yield
    finally:
        extensions.delete_custom_resource_definition(crd["metadata"]["name"])


def test_an_old_crd_is_named_field_by_field(operator_api: ClusterAPI, old_proxynode_crd: None) -> None:
    ours = {"ProxyNode": expected_schemas()["ProxyNode"]}

    def drift() -> list[Drift] | None:
        document = operator_api.served_openapi(TEST_GROUP, "v1alpha1")
        found = crd_drift(document, ours, group=TEST_GROUP) if document is not None else None
        return found if found and found[0].path != "." else None  # "." : not published yet

    assert _until(f"the OpenAPI document of {TEST_GROUP}", drift) == [
        Drift("ProxyNode", ".spec.migration.probeSaid", "missing (the API server drops it)"),
        Drift("ProxyNode", ".status.hold", "missing (the API server drops it)"),
    ]


def _served_policy_drift(operator_api: ClusterAPI) -> list[Drift]:
    document = operator_api.served_openapi()
    assert document is not None
    return [d for d in crd_drift(document) if d.kind == "ProxyPolicy"]


def _restore(extensions: client.ApiextensionsV1Api, current: dict[str, Any]) -> None:
    live = client.ApiClient().sanitize_for_serialization(extensions.read_custom_resource_definition(POLICY_CRD))
    if live["spec"] != current["spec"]:
        live["spec"] = current["spec"]
        extensions.replace_custom_resource_definition(POLICY_CRD, live)


def test_the_operator_waits_for_an_old_crd_to_be_upgraded_then_starts(
        cluster: Any, proxyshift_installed: Path, operator_api: ClusterAPI,
        extensions: client.ApiextensionsV1Api, tmp_path: Path) -> None:
    """The ProxyPolicy CRD of an older release, as `helm upgrade` leaves it: the operator starts nothing and says
    which field is missing and how to upgrade; once the CRD is upgraded it starts on its own, no restart."""
    live = extensions.read_custom_resource_definition(POLICY_CRD)
    current = client.ApiClient().sanitize_for_serialization(live)
    old = copy.deepcopy(current)
    version = old["spec"]["versions"][0]
    version["schema"]["openAPIV3Schema"] = _without(version["schema"]["openAPIV3Schema"],
                                                    ("spec", "rollout", "preflightAhead"))
    extensions.replace_custom_resource_definition(POLICY_CRD, old)
    op: OperatorProcess | None = None
    try:
        _until("the old ProxyPolicy schema published", lambda: _served_policy_drift(operator_api))
        account = service_account_kubeconfig(cluster, "proxyshift-operator", tmp_path / "operator.kubeconfig")
        started = op = OperatorProcess(account, tmp_path / "operator.log", metrics_port=18180,
                                       health_port=18181).start()
        said = "ProxyPolicy .spec.rollout.preflightAhead: missing (the API server drops it)"
        _until("the operator's log naming the missing field",
               lambda: said in started.log_path.read_text(encoding="utf-8", errors="replace") and started.running)
        text = started.log_path.read_text(encoding="utf-8", errors="replace")
        assert "older than this operator" in text and "kubectl apply --server-side -k config/crd" in text
        # Nothing started: kopf serves the liveness endpoint only once every startup handler succeeded.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{started.health_port}/healthz", timeout=2)

        checked = crd_check(proxyshift_installed)
        assert checked.returncode == 1 and f"  {said}" in checked.stdout, (checked.stdout, checked.stderr)

        _restore(extensions, current)
        # The next look (CRD_DRIFT_RETRY_SECONDS) finds the upgraded CRD: healthy without a restart.
        started.wait_healthy(timeout=60)
    finally:
        if op is not None:
            op.stop()
        _restore(extensions, current)
    _until("the upgraded ProxyPolicy schema published", lambda: not _served_policy_drift(operator_api))
