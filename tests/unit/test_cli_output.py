"""CLI conventions: `-o json|yaml` parse back into the report models, exit codes, --context, the kubectl plugin.

The cluster is a fake CustomObjectsApi (status) or the plan view's readers replaced by a World built here
(plan), as tests/unit/test_controller.py and test_plan_compat.py build them.
"""

from __future__ import annotations

import json
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from proxyshift import cli
from proxyshift.api.policy import ProxyPolicy
from proxyshift.api.proxynode import ProxyNode
from proxyshift.controller import cliargs, plan_view, snapshot, status_view
from proxyshift.planner import world as w
from proxyshift.planner.preview import BASELINE_SOURCE
from proxyshift.planner.reports import PlanReport, StatusReport, status_report
from proxyshift.render.kubeproxyconfig import baseline_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "baseline"
CM = yaml.safe_load((FIXTURES / "kube-proxy-configmap.yaml").read_text())
DS = yaml.safe_load((FIXTURES / "kube-proxy-daemonset.yaml").read_text())


def policy_body(name: str, phase: str | None, mode: str = "nftables") -> dict[str, Any]:
    status: dict[str, Any] = {}
    if phase:
        status = {"phase": phase, "currentRevision": f"{name}-abc", "progress": "1/2",
                  "nodes": {"selected": 2, "updated": 1, "failed": int(phase == "Degraded")},
                  "conditions": [{"type": "Ready", "status": "True" if phase == "Ready" else "False",
                                  "reason": phase, "message": "", "lastTransitionTime": "2026-12-01T10:00:00Z"}]}
        if phase == "Degraded":
            status["failed"] = [{"name": "n2", "phase": "RolledBack", "reason": "GateTimeout",
                                 "message": "no sync", "at": "2026-12-01T10:05:00Z"}]
    return {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"pool": name}}, "mode": mode}, "status": status}


PROXYNODES: list[dict[str, Any]] = [
    {"metadata": {"name": "n1"},
     "spec": {"policy": "blue", "mode": "nftables", "revision": "blue-abc",
              "migration": {"phase": "Done", "phaseSince": "2026-12-01T10:01:00Z"}},
     "status": {"observedMode": "nftables", "leftovers": [], "leftoverObjects": 0,
                "heartbeat": "2026-12-01T10:02:00Z"}},
    {"metadata": {"name": "n2"},
     "spec": {"policy": "blue", "mode": None,
              "migration": {"phase": "RolledBack", "reason": "GateTimeout", "message": "no sync after 5m"}},
     "status": {"observedMode": "iptables", "leftovers": ["nftables"], "leftoverObjects": 1}},
    {"metadata": {"name": "g1"}, "spec": {"policy": "green"}, "status": {}},
]


class FakeCustom:
    """The CustomObjectsApi calls `proxyshift status` makes, answered from dicts."""

    def __init__(self, policies: list[dict[str, Any]], proxynodes: list[dict[str, Any]] | None = None,
                 phases: list[str] | None = None) -> None:
        self.policies = {p["metadata"]["name"]: p for p in policies}
        self.proxynodes = proxynodes if proxynodes is not None else PROXYNODES
        self.phases = list(phases or [])  # successive phases of every policy, one per get (for --watch)

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> dict[str, Any]:
        return {"items": list(self.policies.values()) if plural == "proxypolicies" else self.proxynodes}

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str) -> dict[str, Any]:
        if name not in self.policies:
            raise ApiException(status=404, reason="Not Found")
        if self.phases:
            phase = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
            return policy_body(name, phase)
        return self.policies[name]


def run_status(monkeypatch: pytest.MonkeyPatch, fake: Any, *args: str) -> int:
    monkeypatch.setattr(status_view, "load_api", lambda kubeconfig, context=None: fake)
    return cli.main(["status", *args])


# ---- status -o json|yaml ----

def test_status_json_parses_back_into_the_report_with_every_owned_node(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCustom([policy_body("blue", "Progressing")])
    assert run_status(monkeypatch, fake, "blue", "-o", "json") == 1  # not Ready yet
    out = capsys.readouterr().out
    report = StatusReport.model_validate_json(out)
    assert report == status_report([policy_body("blue", "Progressing")], PROXYNODES)
    assert json.loads(out)["kind"] == "StatusReport" and json.loads(out)["apiVersion"] == "proxyshift.io/v1alpha1"
    (blue,) = report.policies
    assert blue.phase == "Progressing" and blue.node_counts.selected == 2 and blue.revision == "blue-abc"
    assert [n.name for n in blue.nodes or []] == ["n1", "n2"]  # green's node is not blue's
    n1, n2 = blue.nodes or []
    assert (n1.phase, n1.observed_mode, n1.leftover_objects, n1.last_error) == ("Done", "nftables", 0, None)
    assert (n2.phase, n2.target_mode, n2.leftovers, n2.last_error) == ("RolledBack", None, ["nftables"],
                                                                         "no sync after 5m")
    # camelCase on the wire, as kubectl users read JSON
    assert "leftoverObjects" in json.loads(out)["policies"][0]["nodes"][0]


def test_status_yaml_parses_back_and_a_ready_policy_exits_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCustom([policy_body("blue", "Ready")])
    assert run_status(monkeypatch, fake, "blue", "-o", "yaml") == 0
    report = StatusReport.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert report.policies[0].phase == "Ready" and report.policies[0].conditions[0].status == "True"


def test_status_of_all_policies_lists_them_without_nodes_and_exits_1_unless_all_are_ready(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCustom([policy_body("green", "Ready"), policy_body("blue", "Degraded")])
    assert run_status(monkeypatch, fake, "-o", "json") == 1
    report = StatusReport.model_validate_json(capsys.readouterr().out)
    assert [p.name for p in report.policies] == ["blue", "green"]
    assert all(p.nodes is None for p in report.policies)
    assert report.policies[0].failed[0].reason == "GateTimeout"
    assert run_status(monkeypatch, FakeCustom([policy_body("green", "Ready")]), "-o", "json") == 0
    capsys.readouterr()
    assert run_status(monkeypatch, FakeCustom([]), "-o", "json") == 0  # nothing unhealthy to report
    assert StatusReport.model_validate_json(capsys.readouterr().out).policies == []


def test_status_table_stays_the_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    body = policy_body("blue", "Progressing")
    assert run_status(monkeypatch, FakeCustom([body]), "blue") == 1
    out = capsys.readouterr().out
    assert out.startswith("ProxyPolicy blue: mode nftables  phase Progressing  revision blue-abc")
    assert "NODE" in out and "LEFTOVERS" in out and "nftables" in out
    assert run_status(monkeypatch, FakeCustom([body]), "-o", "table") == 1
    assert capsys.readouterr().out.splitlines()[0].split() == ["NAME", "MODE", "PHASE", "PROGRESS", "REVISION"]


# ---- status exit codes ----

def test_an_unknown_policy_is_input_error_2_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_status(monkeypatch, FakeCustom([]), "nope", "-o", "json") == 2
    err = capsys.readouterr().err
    assert err == "proxyshift status: ProxyPolicy 'nope' not found\n"


def test_an_unknown_output_format_is_usage_error_2(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_status(monkeypatch, FakeCustom([]), "-o", "xml")
    assert exc.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err


@pytest.mark.parametrize(("phases", "code"), [(["Progressing", "Ready"], 0), (["Progressing", "Degraded"], 1)])
def test_watch_until_done_exits_0_ready_1_degraded(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str],
                                                   phases: list[str], code: int) -> None:
    fake = FakeCustom([policy_body("blue", "Progressing")], phases=phases)
    assert run_status(monkeypatch, fake, "blue", "-w", "--until-done", "--interval", "0", "-o", "json") == code
    # one JSON document per change, each a report
    docs = [json.loads(d) for d in capsys.readouterr().out.replace("}\n{", "}\x00{").split("\x00")]
    assert [d["policies"][0]["phase"] for d in docs] == phases


def test_watch_until_done_that_times_out_is_not_ready_1(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCustom([policy_body("blue", "Progressing")])
    code = run_status(monkeypatch, fake, "blue", "-w", "--until-done", "--interval", "0.01", "--timeout", "0.05")
    assert code == 1 and "timed out after 0.05s in phase Progressing" in capsys.readouterr().err


class Unreachable(FakeCustom):
    def list_cluster_custom_object(self, *args: Any) -> dict[str, Any]:
        raise urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")  # type: ignore[arg-type]  # no pool: the code reads only the reason


class Forbidden(FakeCustom):
    def list_cluster_custom_object(self, *args: Any) -> dict[str, Any]:
        raise ApiException(status=403, reason="Forbidden")


@pytest.mark.parametrize(("fake", "words"), [(Unreachable([]), "cannot reach the API server"),
                                             (Forbidden([]), "the API server refused: 403 Forbidden")])
def test_a_cluster_that_cannot_be_used_is_2_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        fake: FakeCustom, words: str) -> None:
    assert run_status(monkeypatch, fake) == 2
    err = capsys.readouterr().err
    assert err.startswith("proxyshift status: ") and words in err and err.count("\n") == 1, err


# ---- plan -o json|yaml and its exit codes ----

def plan_world(policy: ProxyPolicy, inventory: dict[str, Any] | None) -> w.World:
    """Nodes n1, n2 in pool blue with `inventory` in their ProxyNodes (None: no agent reported yet), and n3
    in the pool but owned by an older policy."""
    older = ProxyPolicy.model_validate({
        "metadata": {"name": "older", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeSelector": {"matchLabels": {"legacy": "yes"}}, "mode": "ipvs"}})
    policies = {policy.name: policy, "older": older}
    targets, errors = snapshot.current_revisions(policies, CM, DS)
    assert not errors
    nodes = {f"n{i}": w.NodeView(f"n{i}", {"pool": "blue"}) for i in (1, 2)}
    nodes["n3"] = w.NodeView("n3", {"pool": "blue", "legacy": "yes"})
    pns = {} if inventory is None else {
        n: ProxyNode.model_validate({"metadata": {"name": n}, "status": {**inventory,
                                                                        "heartbeat": "2026-12-01T10:00:00Z"}})
        for n in ("n1", "n2")}
    pns["n3"] = ProxyNode.model_validate({"metadata": {"name": "n3"}, "spec": {"policy": "older"}})
    return w.World(now=datetime.now(UTC), policies=policies, nodes=nodes, proxynodes=pns,
                   revisions={}, kube_proxy_pods={}, current_revisions=targets)


GOOD_NODE = {"kernelRelease": "6.1.0-28-amd64", "modules": ["nf_tables"], "tools": {"nft": "1.0.6", "iptables": "1.8"}}
OLD_NODE = {"kernelRelease": "5.10.0-1-amd64", "modules": [], "tools": {"nft": "0.9.8", "iptables": "1.8"}}


def run_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, inventory: dict[str, Any] | None,
             *args: str) -> int:
    manifest = tmp_path / "blue.yaml"
    manifest.write_text(yaml.safe_dump({k: v for k, v in policy_body("blue", None).items() if k != "status"}))
    monkeypatch.setattr(plan_view, "load_api", lambda kubeconfig, context=None: None)
    monkeypatch.setattr(plan_view, "read_world", lambda policy: plan_world(policy, inventory))
    monkeypatch.setattr(plan_view, "read_services", lambda: ([], []))
    monkeypatch.setattr(plan_view, "read_configs", lambda world: {BASELINE_SOURCE: baseline_config(CM)})
    return cli.main(["plan", "-f", str(manifest), *args])


def test_plan_json_parses_back_and_exits_0_when_every_node_passes_preflight(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(monkeypatch, tmp_path, GOOD_NODE, "-o", "json") == 0
    report = PlanReport.model_validate_json(capsys.readouterr().out)
    assert (report.kind, report.policy, report.mode) == ("PlanReport", "blue", "nftables")
    assert report.revision.startswith("blue-") and report.nodes_to_change == 2 and report.preflight_failures == 0
    assert [(n.name, n.preflight, n.current_revision) for n in report.stages[0].nodes] == [
        ("n1", "ok", None), ("n2", "ok", None)]
    assert report.conflicts == ["n3"] and report.conflict_count == 1
    (group,) = report.compatibility
    assert (group.source, group.from_mode, group.to_mode, group.nodes) == ("baseline", "iptables", "nftables",
                                                                           ["n1", "n2"])
    changes = {f.change: f for f in group.findings}
    assert changes["LocalhostNodePorts"].gated and not changes["NodePortFirewall"].gated


def test_plan_yaml_parses_back_and_exits_1_when_a_node_will_fail_preflight(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(monkeypatch, tmp_path, OLD_NODE, "-o", "yaml") == 1
    report = PlanReport.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert report.preflight_failures == 2
    node = report.stages[0].nodes[0]
    assert node.preflight == "fail" and any("older than 5.13" in p for p in node.problems)


def test_plan_table_is_unchanged_and_has_the_same_exit_code(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(monkeypatch, tmp_path, OLD_NODE) == 1
    out = capsys.readouterr().out
    assert out.startswith("ProxyPolicy blue: mode nftables -> revision blue-")
    assert out.count("WILL FAIL PREFLIGHT") == 2 and "owned by other policies" in out and "n3" in out
    assert "compatibility: iptables -> nftables for 2 node(s) on the baseline kube-proxy" in out


def test_plan_without_inventory_is_unknown_not_a_failure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(monkeypatch, tmp_path, None, "-o", "json") == 0
    report = PlanReport.model_validate_json(capsys.readouterr().out)
    assert {n.preflight for n in report.stages[0].nodes} == {"unknown"} and report.preflight_failures == 0


# ---- --kubeconfig and --context on every command that talks to a cluster ----

def kubeconfig(tmp_path: Path) -> Path:
    def entry(name: str) -> dict[str, Any]:
        return {"name": name, "context": {"cluster": name, "user": name}}

    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "a",
        "contexts": [entry("a"), entry("b")],
        "clusters": [{"name": n, "cluster": {"server": f"https://{n}.example:6443"}} for n in ("a", "b")],
        "users": [{"name": n, "user": {"token": f"token-{n}"}} for n in ("a", "b")],
    }))
    return path


def test_context_picks_the_cluster_of_that_context(tmp_path: Path) -> None:
    path = str(kubeconfig(tmp_path))
    cliargs.load_api(path, "b")
    assert kubernetes.client.Configuration.get_default_copy().host == "https://b.example:6443"
    cliargs.load_api(path)
    assert kubernetes.client.Configuration.get_default_copy().host == "https://a.example:6443"


CLUSTER_COMMANDS = {
    "status": ["status"],
    "plan": ["plan", "-f", str(ROOT / "config" / "samples" / "blue-nftables.yaml")],
    "diagnose": ["diagnose", "service", "default/web"],
    "restore-baseline": ["restore-baseline"],
}


@pytest.mark.parametrize("argv", CLUSTER_COMMANDS.values(), ids=CLUSTER_COMMANDS.keys())
def test_every_cluster_command_takes_context_and_an_unknown_one_is_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code = cli.main([*argv, "--kubeconfig", str(kubeconfig(tmp_path)), "--context", "nope"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"proxyshift {argv[0]}: cannot load the cluster's kubeconfig") and "context 'nope'" in err
    assert err.count("\n") == 1, err


def test_the_operator_and_the_agent_take_kubeconfig_and_context() -> None:
    from proxyshift.agent import loop
    from proxyshift.controller import main as operator_main

    args = operator_main.parse_args(["--kubeconfig", "/k", "--context", "b"])
    assert (args.kubeconfig, args.context) == ("/k", "b")
    cfg = loop.parse_args(["--node", "n1", "--kubeconfig", "/k", "--context", "b"])
    assert (cfg.kubeconfig, cfg.context) == ("/k", "b")


# ---- the kubectl plugin ----

def test_kubectl_proxyshift_is_a_console_script_of_the_same_main() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-proxyshift"] == scripts["proxyshift"] == "proxyshift.cli:main"
    module, _, function = scripts["kubectl-proxyshift"].partition(":")
    assert getattr(__import__(module, fromlist=[function]), function) is cli.main


def test_run_as_the_kubectl_plugin_usage_says_kubectl_proxyshift(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kubectl-proxyshift", "--help"])
    assert cli.main() == 0
    assert capsys.readouterr().out.startswith("usage: kubectl proxyshift <command> [args]")
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kubectl-proxyshift"])
    assert cli.main() == 2  # no command: usage error


def test_ctrl_c_ends_a_watch_with_130_and_no_traceback(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(status_view.time, "sleep", interrupted)
    assert run_status(monkeypatch, FakeCustom([policy_body("blue", "Progressing")]), "blue", "-w") == 130
    assert "Traceback" not in capsys.readouterr().err


def test_the_operator_logs_in_to_the_context_it_was_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kopf

    from proxyshift.controller import handlers, login
    from proxyshift.controller.runtime import MEMO_KUBE_CONTEXT

    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path)))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # in a pod, --context still wins
    assert not login.in_cluster("b")
    # main.py hands the context to kopf in the operator memo; the login handler reads it there.
    # kopf's decorator types the handler as an ActivityFn; the handler itself takes just these.
    info = handlers.login(settings=kopf.OperatorSettings(),  # type: ignore[call-arg]
                          logger=None, memo=kopf.Memo({MEMO_KUBE_CONTEXT: "b"}))  # type: ignore[arg-type]
    assert isinstance(info, kopf.ConnectionInfo)
    assert (info.server, info.token, info.scheme) == ("https://b.example:6443", "token-b", "Bearer")
