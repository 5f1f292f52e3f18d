"""The operator's thin layer without a cluster: snapshot parsing, the executor, the views."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import NodeMigration, Operation
from proxyshift.controller import executor as ex
from proxyshift.controller import plan_view, snapshot, status_view
from proxyshift.controller.revision_keeper import RevisionKeeper
from proxyshift.controller.settings import CONFIG
from proxyshift.manifest import UsageError
from proxyshift.planner import world as w
from proxyshift.render import ANNOTATION_MODE, ANNOTATION_POLICY, render_revision

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).parent.parent / "fixtures" / "baseline"


def baseline() -> tuple[dict[str, Any], dict[str, Any]]:
    cm = yaml.safe_load((FIXTURES / "kube-proxy-configmap.yaml").read_text())
    ds = yaml.safe_load((FIXTURES / "kube-proxy-daemonset.yaml").read_text())
    return cm, ds


def policy(name: str = "blue", mode: str = "nftables", **spec: Any) -> ProxyPolicy:
    return ProxyPolicy.model_validate({
        "metadata": {"name": name, "uid": "u-1", "generation": 1, "creationTimestamp": "2026-11-30T10:00:00Z"},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": mode, **spec},
    })


class FakeAPI:
    """Records every call the executor makes; returns increasing resourceVersions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.events: list[dict[str, Any]] = []
        self.rv = 100
        self.cm, self.ds = baseline()
        self.evictions: tuple[int, list[str]] = (0, [])

    def _next(self) -> str:
        self.rv += 1
        return str(self.rv)

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            if name == "emit_event":
                self.events.append(kwargs)
            if name in ("set_node_label", "set_unschedulable", "ensure_proxynode", "patch_proxynode_spec"):
                return self._next()
            if name == "read_configmap":
                return self.cm
            if name == "read_daemonset":
                return self.ds
            if name == "evict_pods":
                return self.evictions
            return None

        return record


def test_revision_view_reads_full_policy_name_and_mode_from_annotations() -> None:
    cm, ds = baseline()
    long_name = "a" * 120
    rendered = render_revision(policy(long_name), cm, ds)
    view = snapshot.revision_view(rendered.daemonset)
    assert view is not None
    assert view.policy == long_name and view.mode == "nftables" and view.name == rendered.name
    assert rendered.daemonset["metadata"]["annotations"][ANNOTATION_POLICY] == long_name
    assert rendered.configmap["metadata"]["annotations"][ANNOTATION_MODE] == "nftables"


def test_kube_proxy_pod_view_from_a_pod_body() -> None:
    pod = {
        "metadata": {"name": "kube-proxy-x", "ownerReferences": [{"kind": "DaemonSet", "name": "kube-proxy-blue-1"}]},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"restartCount": 2,
                                          "state": {"running": {"startedAt": "2026-11-30T12:00:00Z"}}}]},
    }
    view = snapshot.kube_proxy_pod_view(pod)
    assert view is not None
    assert (view.node, view.daemonset, view.ready, view.restarts) == ("n1", "kube-proxy-blue-1", True, 2)
    assert view.started_at == datetime(2026, 11, 30, 12, tzinfo=UTC)
    assert snapshot.kube_proxy_pod_view({"metadata": {}, "spec": {}, "status": {}}) is None


@pytest.mark.parametrize(("seen", "written", "expected"), [
    ("105", "104", True), ("104", "104", True), ("103", "104", False), ("", "1", False), ("abc", "abc", True),
])
def test_observed_compares_resource_versions(seen: str, written: str, expected: bool) -> None:
    assert snapshot.observed(seen, written) is expected


def test_current_revisions_renders_each_policy_and_reports_a_missing_baseline() -> None:
    cm, ds = baseline()
    targets, errors = snapshot.current_revisions({"blue": policy()}, cm, ds)
    assert not errors and targets["blue"].mode == "nftables" and targets["blue"].name.startswith("blue-")
    targets, errors = snapshot.current_revisions({"blue": policy()}, None, ds)
    assert not targets and "baseline" in errors["blue"]


def test_executor_ensure_revision_patches_baseline_once_and_records_the_undo() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    p = policy()
    name = render_revision(p, api.cm, api.ds).name
    executor.perform(w.EnsureRevision(policy="blue", revision=name), {"blue": p})
    kinds = [c[0] for c in api.calls]
    assert kinds.count("json_patch_daemonset") == 1
    assert "apply_configmap" in kinds and "apply_daemonset" in kinds
    patch = next(c[1][1] for c in api.calls if c[0] == "json_patch_daemonset")
    undo_op = next(op for op in patch.patch if op["path"].endswith("baseline-affinity-undo"))
    assert json.loads(undo_op["value"]), "the exact inverse patch is recorded on the baseline"


class RefusingAPI(FakeAPI):
    """Every apply of a revision object fails as an API server error would."""

    def apply_daemonset(self, desired: dict[str, Any]) -> str:
        self.calls.append(("apply_daemonset", (desired,)))
        raise ApiException(status=500, reason="etcd timeout")


def test_a_failed_apply_stops_a_new_revision_but_not_an_existing_one() -> None:
    api = RefusingAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    p = policy()
    name = render_revision(p, api.cm, api.ds).name
    with pytest.raises(ApiException):
        executor.perform(w.EnsureRevision(policy="blue", revision=name), {"blue": p})
    # Keeping an existing revision as rendered: counted and logged; the nodes run it as it is.
    executor.perform(w.EnsureRevision(policy="blue", revision=name, existing=True), {"blue": p})
    assert [c[0] for c in api.calls].count("apply_daemonset") == 2


def test_executor_refuses_a_revision_that_no_longer_matches_the_spec() -> None:
    executor = ex.Executor(FakeAPI())  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    with pytest.raises(ex.StepBlocked, match="no longer matches"):
        executor.perform(w.EnsureRevision(policy="blue", revision="blue-stale"), {"blue": policy()})


def test_executor_set_migration_writes_none_to_clear_and_returns_the_version_to_wait_for() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    action = w.SetMigration(node="n1", policy="blue", revision="blue-1", mode="nftables", scheduler=None,
                            migration=NodeMigration(phase="Preflight"),
                            operation=Operation(id="blue-1.1.Preflight.1", type="Preflight"))
    written = executor.perform(action, {})
    assert written == ex.Written("proxynode_index", "n1", "101")
    (name, args), = api.calls
    assert name == "ensure_proxynode"
    spec = args[2]
    assert spec["scheduler"] is None and spec["migration"]["phase"] == "Preflight"
    assert spec["operation"] == {"id": "blue-1.1.Preflight.1", "type": "Preflight", "params": {}}


def test_drain_blocks_until_evictions_went_through() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    api.evictions = (1, ["default/web-0: disruption budget"])
    with pytest.raises(ex.StepBlocked, match="disruption budget"):
        executor.perform(w.Drain(node="n1"), {})
    api.evictions = (2, [])
    with pytest.raises(ex.StepBlocked, match="still terminating"):
        executor.perform(w.Drain(node="n1"), {})
    api.evictions = (0, [])
    assert executor.perform(w.Drain(node="n1"), {}) is None


def test_status_view_shows_progress_conditions_and_nodes() -> None:
    body = {"metadata": {"name": "blue"}, "spec": {"mode": "nftables"},
            "status": {"phase": "Progressing", "currentRevision": "blue-abc", "nodes": {"selected": 4, "updated": 1},
                       "conditions": [{"type": "Progressing", "status": "True", "reason": "NodesMigrating",
                                       "message": "1/4"}]}}
    migration = {"phase": "Gate", "phaseSince": "2026-11-30T12:00:00Z"}
    nodes: list[dict[str, Any]] = [{"metadata": {"name": "n1"}, "spec": {"policy": "blue", "mode": "nftables",
                                                                           "migration": migration},
              "status": {"observedMode": "nftables", "leftovers": ["iptables"]}},
             {"metadata": {"name": "other"}, "spec": {"policy": "green"}}]
    text = status_view.render_policy(body, nodes, datetime(2026, 11, 30, 12, 0, 30, tzinfo=UTC))
    assert "1/4" in text and "Progressing=True (NodesMigrating)" in text
    assert "n1" in text and "Gate" in text and "30s" in text and "iptables" in text
    assert "other" not in text


def test_plan_view_refuses_an_invalid_manifest_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy",
                                   "metadata": {"name": "x"}, "spec": {"nodeSelector": {}, "mode": "iptables",
                                                                        "ipvs": {"scheduler": "rr"}}}))
    with pytest.raises(UsageError, match="ipvs settings are only allowed with mode: ipvs"):
        plan_view.read_policy(str(bad))


def test_plan_view_lists_stages_and_predicted_preflight_failures() -> None:
    from proxyshift.api.proxynode import ProxyNode

    cm, ds = baseline()
    p = policy("blue", "ipvs", ipvs={"scheduler": "mh"},
               rollout={"stages": [{"nodes": 1, "pause": "10m"}, {"percent": 100}]})
    targets, _ = snapshot.current_revisions({"blue": p}, cm, ds)
    nodes = {f"n{i}": w.NodeView(f"n{i}", {"pool": "blue"}) for i in (1, 2, 3)}
    pns = {n: ProxyNode.model_validate({"metadata": {"name": n}, "status": {
        "kernelRelease": "6.1.0", "modules": ["ip_vs", "nf_conntrack"], "tools": {"ipset": "7.17"},
        "heartbeat": "2026-11-30T12:00:00Z"}}) for n in nodes}
    world = w.World(now=datetime.now(UTC), policies={"blue": p}, nodes=nodes, proxynodes=pns, revisions={},
                    kube_proxy_pods={}, current_revisions=targets)
    text = plan_view.render_preview(p, world)
    assert "stage 1: up to 1 nodes updated, then pause 10m" in text
    assert text.count("WILL FAIL PREFLIGHT") == 3 and "ip_vs_mh" in text


def test_metrics_count_rollbacks_and_migration_durations() -> None:
    from prometheus_client import REGISTRY

    from proxyshift.api.proxynode import ProxyNode
    from proxyshift.controller import metrics

    before = REGISTRY.get_sample_value("proxyshift_rollbacks_total", {"policy": "m"}) or 0
    pn = ProxyNode.model_validate({"metadata": {"name": "n1"}, "spec": {"policy": "m", "migration": {"phase": "Gate"}}})
    world = w.World(now=datetime.now(UTC), policies={}, nodes={}, proxynodes={"n1": pn}, revisions={},
                    kube_proxy_pods={})
    rollback = w.SetMigration(node="n1", policy="m", revision=None, mode=None, scheduler=None, operation=None,
                              migration=NodeMigration(phase="RollingBack", reason="GateTimeout"))
    metrics.record_plan("m", world, [rollback])
    assert REGISTRY.get_sample_value("proxyshift_rollbacks_total", {"policy": "m"}) == before + 1
    assert REGISTRY.get_sample_value("proxyshift_nodes", {"policy": "m", "phase": "Gate"}) == 1
    done = w.SetMigration(node="n1", policy="m", revision="r", mode="nftables", scheduler=None, operation=None,
                          migration=NodeMigration(phase="Done", from_mode="iptables", to_mode="nftables",
                                                  started_at="2026-11-30T12:00:00Z",
                                                  finished_at="2026-11-30T12:00:42Z"))
    # The registry is process-wide: other tests' migrations (test_reconcile's) observe the same labels.
    labels = {"from_mode": "iptables", "to_mode": "nftables", "result": "succeeded"}
    sum_before = REGISTRY.get_sample_value("proxyshift_node_migration_duration_seconds_sum", labels) or 0
    metrics.record_plan("m", world, [done])
    assert REGISTRY.get_sample_value("proxyshift_node_migration_duration_seconds_sum", labels) == sum_before + 42


def test_every_api_step_with_a_reason_leaves_an_event_on_what_it_touched() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    executor.perform(w.SetRevisionLabel(node="n1", revision="blue-1", reason="Switched", message="to blue-1"),
                     {"blue": policy()})
    events = [c for c in api.calls if c[0] == "emit_event"]
    assert len(events) == 1  # a label move without a policy: the node only
    executor.perform(w.SetMigration(node="n1", policy="blue", revision=None, mode=None, scheduler=None,
                                    migration=None, operation=None, reason="Released"), {"blue": policy()})
    assert len([c for c in api.calls if c[0] == "emit_event"]) == 1, "intent records are not announced twice"


def test_a_step_the_plan_already_announces_gets_no_second_event() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    actions: list[w.Action] = [
        w.SetRevisionLabel(node="n1", revision="blue-1", reason="Switching"),
        w.Event(policy="blue", node="n1", type="Normal", reason="Switching", message="moving n1 to blue-1"),
    ]
    told = ex.announced_elsewhere(actions)
    for action in actions:
        key = (getattr(action, "node", None), action.reason)
        executor.perform(action, {"blue": policy()}, announce=key not in told)
    events = [c for c in api.calls if c[0] == "emit_event"]
    # One step, told once: on the node and on its policy.
    assert len(events) == 2 and sorted(e["kind"] for e in api.events) == ["Node", "ProxyPolicy"], api.events
    on_policy = next(e for e in api.events if e["kind"] == "ProxyPolicy")
    assert on_policy["name"] == "blue" and on_policy["message"].startswith("n1: ")


def test_outcomes_setting_keeps_warnings_and_endings_on_nodes_only() -> None:
    api = FakeAPI()
    executor = ex.Executor(api, config=dataclasses.replace(CONFIG, node_events="outcomes"))  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    for type_, reason in (("Normal", "Switching"), ("Normal", "GatePassed"), ("Warning", "GateTimeout"),
                          ("Normal", "Migrated")):
        executor.perform(w.Event(policy="blue", node="n1", type=type_, reason=reason, message=reason),
                         {"blue": policy()})
    executor.perform(w.Event(policy="blue", node=None, type="Normal", reason="Paused", message="policy step"),
                     {"blue": policy()})
    emitted = [c for c in api.calls if c[0] == "emit_event"]
    assert len(emitted) == 3, emitted  # GateTimeout, Migrated on the node; the policy's own Event


def test_auto_tells_every_step_for_a_small_policy_and_only_outcomes_for_a_fleet() -> None:
    def emitted(fleet: int) -> list[tuple[str, str]]:
        api = FakeAPI()
        auto = dataclasses.replace(CONFIG, node_events="auto", step_events_max_nodes=100)
        executor = ex.Executor(api, config=auto)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
        executor.fleet["blue"] = fleet
        for type_, reason in (("Normal", "Switching"), ("Warning", "GateTimeout"), ("Normal", "Migrated")):
            executor.perform(w.Event(policy="blue", node="n1", type=type_, reason=reason, message=reason),
                             {"blue": policy()})
        return [(e["kind"], e["reason"]) for e in api.events]

    every_step = [("Node", "Switching"), ("ProxyPolicy", "Switching"), ("Node", "GateTimeout"),
                  ("ProxyPolicy", "GateTimeout"), ("Node", "Migrated"), ("ProxyPolicy", "Migrated")]
    assert emitted(100) == every_step
    assert emitted(101) == [("Node", "GateTimeout"), ("Node", "Migrated")]


def test_a_plan_runs_node_by_node_in_order_and_the_policy_own_steps_last() -> None:
    label = w.SetRevisionLabel(node="n1", revision="blue-1", reason="Switching")
    said = w.Event(policy="blue", node="n1", type="Normal", reason="Switching", message="moving n1")
    other = w.Uncordon(node="n2", reason="Uncordoned")
    stage = w.Event(policy="blue", node=None, type="Normal", reason="StageCompleted", message="stage 1")
    later = w.Cordon(node="n1", reason="Cordoned")
    groups, rest = ex.by_node([label, stage, other, said, later])
    assert groups == [[label, said, later], [other]]
    assert rest == [stage]



def test_a_late_granted_node_runs_in_the_second_wave() -> None:
    done = w.Uncordon(node="n1", reason="Uncordoned")
    switch = w.SetRevisionLabel(node="n2", revision="blue-1", reason="Switching")
    other = w.Cordon(node="n3", reason="Cordoned")
    status = w.Event(policy="blue", node=None, type="Normal", reason="StageCompleted", message="stage 1")
    waves, rest = ex.in_waves([switch, done, status, other], frozenset({"n2"}))
    assert waves == [[[done], [other]], [[switch]]]
    assert rest == [status]
    assert ex.in_waves([switch, done], frozenset())[0] == [[[switch], [done]], []]


def test_plan_view_does_not_predict_a_failure_without_inventory() -> None:
    cm, ds = baseline()
    p = policy("blue", "nftables")
    targets, _ = snapshot.current_revisions({"blue": p}, cm, ds)
    world = w.World(now=datetime.now(UTC), policies={"blue": p}, nodes={"n1": w.NodeView("n1", {"pool": "blue"})},
                    proxynodes={}, revisions={}, kube_proxy_pods={}, current_revisions=targets)
    text = plan_view.render_preview(p, world)
    assert "preflight unknown: no inventory yet" in text and "WILL FAIL" not in text


def test_restore_applies_the_recorded_exact_inverse() -> None:
    import copy

    import jsonpatch

    api = FakeAPI()
    original = copy.deepcopy(api.ds)
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    executor.ensure_baseline_affinity(api.ds)
    forward = next(c[1][1] for c in api.calls if c[0] == "json_patch_daemonset")
    api.ds = jsonpatch.apply_patch(api.ds, forward.patch)
    assert api.ds["spec"]["template"]["spec"].get("affinity")
    executor.undo_baseline_affinity()
    undo = [c[1][1] for c in api.calls if c[0] == "json_patch_daemonset"][-1]
    restored = jsonpatch.apply_patch(api.ds, undo.patch)
    assert restored["spec"] == original["spec"]
    assert not restored["metadata"].get("annotations"), "the record is removed (an empty map may remain)"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_existing_revision_is_applied_again_only_when_an_input_moved_or_the_interval_passed() -> None:
    api = FakeAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    clock = Clock()
    executor.kept = RevisionKeeper(30.0, clock=clock)
    p = policy()
    name = render_revision(p, api.cm, api.ds).name

    def applies() -> int:
        return [c[0] for c in api.calls].count("apply_daemonset")

    executor.perform(w.EnsureRevision(policy="blue", revision=name), {"blue": p})
    assert applies() == 1
    keep = w.EnsureRevision(policy="blue", revision=name, existing=True)
    executor.perform(keep, {"blue": p})
    assert applies() == 1, "nothing moved since the apply: no second one"
    # Someone edits the revision DaemonSet: its generation moves, the next plan applies it back.
    executor.kept.saw("daemonset", 1, name)
    executor.kept.saw("daemonset", 2, name)
    executor.perform(keep, {"blue": p})
    assert applies() == 2
    # Its pods' status changes do not move the generation: no apply.
    executor.kept.saw("daemonset", 2, name)
    executor.perform(keep, {"blue": p})
    assert applies() == 2
    # The baseline's spec moves (a new image): every revision is due.
    executor.kept.saw("daemonset", 7)
    executor.kept.saw("daemonset", 8)
    executor.perform(keep, {"blue": p})
    assert applies() == 3
    # Nothing watched moved, but the interval passed (the revision ConfigMap is not watched).
    clock.now += 29.0
    executor.perform(keep, {"blue": p})
    assert applies() == 3
    clock.now += 1.0
    executor.perform(keep, {"blue": p})
    assert applies() == 4


def test_a_failed_apply_of_an_existing_revision_is_tried_again_at_the_next_plan() -> None:
    api = RefusingAPI()
    executor = ex.Executor(api)  # type: ignore[arg-type]  # FakeAPI has the calls the executor makes
    p = policy()
    name = render_revision(p, api.cm, api.ds).name
    keep = w.EnsureRevision(policy="blue", revision=name, existing=True)
    executor.perform(keep, {"blue": p})
    executor.perform(keep, {"blue": p})
    assert [c[0] for c in api.calls].count("apply_daemonset") == 2
