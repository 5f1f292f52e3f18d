"""The kopf wiring (controller/handlers.py): what kopf has registered must not change across a release
(an operator upgraded in place finds its progress, indexes and finalizer under these names), the
startup handler puts the runtime where every handler finds it, and the handlers only delegate."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any

import kopf
import pytest
from fake_cluster import FakeCluster, policy
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY
from test_schema_drift import document_of

from proxyshift.api.schema_drift import expected_schemas
from proxyshift.controller import handlers
from proxyshift.controller.runtime import (
    MEMO_KEY,
    MEMO_KUBE_CONTEXT,
    MEMO_PEERING,
    OperatorRuntime,
    kube_context_of,
    peering_of,
    runtime_of,
)

pytestmark = pytest.mark.unit

# (registry, handler id, activity or cause, group/version/plural, requires a finalizer, labels, when filter)
REGISTERED = {
    ("activities", "login_via_client", "authentication", None, None, None, None),
    ("activities", "login", "authentication", None, None, None, None),
    ("activities", "configure", "startup", None, None, None, None),
    ("activities", "start_mirrors", "startup", None, None, None, None),
    ("activities", "stop_mirrors", "cleanup", None, None, None, None),
    ("indexing", "policy_index", None, "proxyshift.io/v1alpha1/proxypolicies", None, None, None),
    ("indexing", "baseline_configmap_index", None, "/v1/configmaps", None, None, "_is_baseline"),
    ("indexing", "baseline_daemonset_index", None, "apps/v1/daemonsets", None, None, "_is_baseline"),
    ("spawning", "rollout", None, "proxyshift.io/v1alpha1/proxypolicies", True, None, None),
    ("changing", "on_delete", "delete", "proxyshift.io/v1alpha1/proxypolicies", True, None, None),
}


def registered() -> set[tuple[Any, ...]]:
    registry = kopf.get_default_registry()
    found: set[tuple[Any, ...]] = set()
    for kind in ("activities", "indexing", "spawning", "changing"):
        for h in getattr(registry, f"_{kind}").get_all_handlers():
            selector = getattr(h, "selector", None)
            where = f"{selector.group or ''}/{selector.version}/{selector.any_name}" if selector else None
            labels = getattr(h, "labels", None)
            when = getattr(h, "when", None)
            found.add((kind, h.id, getattr(h, "activity", None) or getattr(h, "reason", None), where,
                       getattr(h, "requires_finalizer", None), tuple(sorted(labels.items())) if labels else None,
                       when.__name__ if when else None))
    return {(k, i, str(a.value) if hasattr(a, "value") else a, *rest) for k, i, a, *rest in found}


def test_handler_ids_indexes_and_filters_stay_what_a_running_operator_left_behind() -> None:
    assert registered() == REGISTERED
    daemon = next(h for h in kopf.get_default_registry()._spawning.get_all_handlers() if h.id == "rollout")
    assert daemon.cancellation_timeout == 10  # type: ignore[attr-defined]  # "rollout" is a daemon's handler


def test_configure_sets_kopf_up_and_puts_the_runtime_in_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    contexts: list[str | None] = []
    monkeypatch.setattr(handlers.login_to, "load_client_config", contexts.append)
    monkeypatch.setattr(handlers.ClusterAPI, "unserved_resources", lambda self, with_peering: [])
    monkeypatch.setattr(handlers.ClusterAPI, "served_openapi", lambda self: document_of(expected_schemas()))
    settings, memo = kopf.OperatorSettings(), kopf.Memo({MEMO_KUBE_CONTEXT: "staging", MEMO_PEERING: None})
    settings.peering.clusterwide = False  # what kopf.operator(namespaces=[...]) sets before the startup

    # kopf's decorator types the handler as an ActivityFn; the handler itself takes just these.
    handlers.configure(settings=settings, memo=memo)  # type: ignore[call-arg]

    assert contexts == ["staging"]
    # Served namespace only, named exactly: no Namespace or CRD list (the operator may do neither);
    # the one ClusterKopfPeering stays.
    assert settings.scanning.disabled is True
    assert settings.peering.clusterwide is True
    assert settings.persistence.finalizer == "proxyshift.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.StatusProgressStorage)
    assert isinstance(memo[MEMO_KEY], OperatorRuntime)
    # kopf hands each resource handler a shallow copy of the operator memo: the same runtime.
    assert runtime_of(copy.copy(memo)) is memo[MEMO_KEY]


@pytest.mark.parametrize(("argv", "peering"), [(["--peering", "ring"], "ring"), (["--standalone"], None)])
def test_main_hands_the_context_and_the_peering_to_the_handlers_in_the_memo(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], peering: str | None) -> None:
    """Through kopf's memo, not the process environment: nothing the handlers read is process-wide."""
    from proxyshift.controller import main as operator_main

    started: dict[str, Any] = {}

    async def operator(**kwargs: Any) -> None:
        started.update(kwargs)

    monkeypatch.setattr(operator_main.kopf, "operator", operator)
    # main loads the client configuration before kopf starts (a bad kubeconfig is one line, exit 2): no
    # cluster here, and the context's handling is what this test is about.
    loaded: list[str | None] = []
    monkeypatch.setattr(operator_main.login, "load_client_config", loaded.append)
    before = dict(os.environ)
    assert operator_main.main(["--context", "staging", "--metrics-port", "0", *argv]) == 0
    memo = started["memo"]
    assert kube_context_of(memo) == "staging" and peering_of(memo) == peering
    assert started["standalone"] is (peering is None)
    assert dict(os.environ) == before and loaded == ["staging"]


def test_configure_waits_for_the_crds_it_cannot_notice_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers.login_to, "load_client_config", lambda _: None)
    asked: list[bool] = []

    def unserved(_: Any, with_peering: bool) -> list[str]:
        asked.append(with_peering)
        return ["proxypolicies.proxyshift.io/v1alpha1"]

    monkeypatch.setattr(handlers.ClusterAPI, "unserved_resources", unserved)
    memo = kopf.Memo({MEMO_KUBE_CONTEXT: None, MEMO_PEERING: "proxyshift"})
    with pytest.raises(kopf.TemporaryError, match=r"does not serve proxypolicies\.proxyshift\.io/v1alpha1"):
        handlers.configure(settings=kopf.OperatorSettings(), memo=memo)  # type: ignore[call-arg]  # as above
    assert asked == [True]
    assert MEMO_KEY not in memo


def test_configure_waits_while_the_served_crds_would_drop_what_this_version_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Helm never upgrades a chart's crds/: the operator says which fields an old CRD lacks and how to fix it,
    and starts nothing until it can write them."""
    monkeypatch.setattr(handlers.login_to, "load_client_config", lambda _: None)
    monkeypatch.setattr(handlers.ClusterAPI, "unserved_resources", lambda self, with_peering: [])
    old = expected_schemas()
    del old["ProxyNode"]["properties"]["status"]["properties"]["hold"]
    monkeypatch.setattr(handlers.ClusterAPI, "served_openapi", lambda self: document_of(old))
    memo = kopf.Memo({MEMO_KUBE_CONTEXT: None, MEMO_PEERING: None})

    with pytest.raises(kopf.TemporaryError, match=r"older than this operator .*ProxyNode \.status\.hold: missing "
                       r".*kubectl apply --server-side -k config/crd") as raised:
        handlers.configure(settings=kopf.OperatorSettings(), memo=memo)  # type: ignore[call-arg]  # as above
    assert raised.value.delay == handlers.CRD_DRIFT_RETRY_SECONDS
    assert MEMO_KEY not in memo

    # An API server that does not let the operator read its OpenAPI document: told, not checked, started.
    monkeypatch.setattr(handlers.ClusterAPI, "served_openapi", lambda self: None)
    handlers.configure(settings=kopf.OperatorSettings(), memo=memo)  # type: ignore[call-arg]  # as above
    assert isinstance(memo[MEMO_KEY], OperatorRuntime)


def test_start_mirrors_waits_for_configure_in_one_line_and_soon() -> None:
    memo = kopf.Memo({MEMO_KUBE_CONTEXT: None, MEMO_PEERING: None})
    with pytest.raises(kopf.TemporaryError, match="waiting for the startup handler 'configure'") as raised:
        asyncio.run(handlers.start_mirrors(memo=memo))  # type: ignore[call-arg, arg-type]  # kopf types it an ActivityFn
    assert raised.value.delay == handlers.STARTUP_WAIT_SECONDS


class FakeAnswer:
    """The client's RESTResponse as Rest.call hands it over."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self) -> bytes:
        return self.data


@pytest.mark.parametrize(("answer", "expected"), [
    (FakeAnswer(b'{"components": {"schemas": {}}}'), {"components": {"schemas": {}}}),
    (ApiException(status=403, reason="Forbidden"), None),
    (ApiException(status=404, reason="Not Found"), None),
    (FakeAnswer(b"[" + b" " * (16 * 1024 * 1024) + b"]"), None),  # over the bound: not parsed
])
def test_served_openapi_reads_our_group_version_and_says_when_it_cannot(
        monkeypatch: pytest.MonkeyPatch, answer: Any, expected: Any) -> None:
    from proxyshift.controller.kube import ClusterAPI

    api = ClusterAPI()
    asked: list[str] = []

    def call(method: str, path: str, **_: Any) -> FakeAnswer:
        asked.append(f"{method} {path}")
        if isinstance(answer, ApiException):
            raise answer
        return answer

    monkeypatch.setattr(api.rest, "call", call)
    assert api.served_openapi() == expected
    assert asked == ["GET /openapi/v3/apis/proxyshift.io/v1alpha1"]


def test_served_openapi_lets_other_errors_through_for_kopf_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxyshift.controller.kube import ClusterAPI

    api = ClusterAPI()

    def call(method: str, path: str, **_: Any) -> FakeAnswer:
        raise ApiException(status=503, reason="Service Unavailable")

    monkeypatch.setattr(api.rest, "call", call)
    with pytest.raises(ApiException):
        api.served_openapi()


class FakeDiscovery:
    """CustomObjectsApi.get_api_resources as the API server answers it."""

    def __init__(self, served: dict[tuple[str, str], list[str]]) -> None:
        self.served = served

    def get_api_resources(self, group: str, version: str) -> Any:
        from kubernetes.client import V1APIResource, V1APIResourceList

        if (group, version) not in self.served:
            raise ApiException(status=404, reason="Not Found")
        return V1APIResourceList(group_version=f"{group}/{version}", resources=[
            V1APIResource(name=n, kind=n, namespaced=False, singular_name="", verbs=["get"])
            for n in self.served[(group, version)]])


def test_unserved_resources_names_each_missing_crd() -> None:
    from proxyshift.controller.kube import ClusterAPI

    api = ClusterAPI()
    api.custom = FakeDiscovery({("proxyshift.io", "v1alpha1"): ["proxypolicies", "proxypolicies/status"]})  # type: ignore[assignment]  # a fake discovery API
    assert api.unserved_resources(with_peering=False) == ["proxynodes.proxyshift.io/v1alpha1"]
    assert api.unserved_resources(with_peering=True) == ["proxynodes.proxyshift.io/v1alpha1",
                                                         "clusterkopfpeerings.kopf.dev/v1"]
    api.custom = FakeDiscovery({("proxyshift.io", "v1alpha1"): ["proxypolicies", "proxynodes"],  # type: ignore[assignment]  # a fake discovery API
                                ("kopf.dev", "v1"): ["clusterkopfpeerings"]})
    assert api.unserved_resources(with_peering=True) == []


def test_a_handler_without_the_runtime_says_the_startup_did_not_run() -> None:
    with pytest.raises(RuntimeError, match="startup"):
        runtime_of(kopf.Memo())


def reconcile_errors(policy: str, error: str) -> float:
    return REGISTRY.get_sample_value("proxyshift_reconcile_errors_total", {"policy": policy, "error": error}) or 0.0


class StopAfter:
    """kopf's `stopped` flag as the loop reads it (its truth), set after n checks."""

    def __init__(self, n: int) -> None:
        self.left = n

    def __bool__(self) -> bool:
        self.left -= 1
        return self.left < 0


def index_kwargs(cluster: FakeCluster) -> dict[str, Any]:
    indexes = cluster.indexes()
    return {"policy_index": indexes.policies,
            "baseline_configmap_index": indexes.baseline_configmap,
            "baseline_daemonset_index": indexes.baseline_daemonset}


def test_the_rollout_daemon_steps_the_policy_and_survives_an_api_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster()
    cluster.add_node("blue-1", {"pool": "blue"})
    cluster.add_policy(policy())
    cluster.fail[("patch_policy_status", "blue")] = ApiException(status=503, reason="unavailable")
    before = reconcile_errors("blue", "api503")

    async def run() -> None:
        runtime = cluster.runtime_for_test()
        monkeypatch.setattr(runtime.pacing, "pause", no_pause)
        # kopf's decorators type the handlers as returning object; these are coroutine functions.
        await handlers.rollout(name="blue", stopped=StopAfter(3), logger=logging.getLogger("test"),  # type: ignore[arg-type, misc]
                               memo=kopf.Memo({MEMO_KEY: runtime}), **index_kwargs(cluster))

    async def no_pause(*_: Any) -> None:
        await asyncio.sleep(0)

    asyncio.run(run())

    # Three iterations: the revision, then a node's preflight, each status write refused (counted, retried).
    assert reconcile_errors("blue", "api503") - before == 3
    assert cluster.proxynodes["blue-1"]["spec"]["operation"]["type"] == "Preflight"


def test_the_delete_handler_lets_the_finalizer_go_when_nothing_is_left() -> None:
    cluster = FakeCluster()
    cluster.add_node("blue-1", {"pool": "blue"})
    cluster.add_policy(policy(deleting=True))

    async def run() -> None:
        runtime = cluster.runtime_for_test()
        await handlers.on_delete(  # type: ignore[misc]  # a coroutine function, as above
            name="blue", memo=kopf.Memo({MEMO_KEY: runtime}), **index_kwargs(cluster))

    asyncio.run(run())  # returned: kopf removes the finalizer
    assert cluster.calls == []
