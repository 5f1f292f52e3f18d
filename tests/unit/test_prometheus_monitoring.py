"""The alerts (config/prometheus/alerts) and the Grafana dashboard (config/prometheus/dashboard.json).

promtool checks the rules and runs tests/unit/promtool/alerts_test.yaml (series that fire and
series that do not, for every alert); every dashboard expression is wrapped in a recording rule
and checked the same way. Both may name only metrics proxyshift exports. promtool is a unit-layer
dependency: absent, these tests fail and say how to install it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RULE = ROOT / "config" / "prometheus" / "alerts" / "prometheusrule.yaml"
RULE_TESTS = ROOT / "tests" / "unit" / "promtool" / "alerts_test.yaml"
DASHBOARD = ROOT / "config" / "prometheus" / "dashboard.json"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
RUNBOOKS = "https://github.com/proxyshift/proxyshift/blob/main/docs/troubleshooting.md#"
# The modules whose prometheus_client metrics make up what proxyshift exports (the agent's, once it
# has its own, under the name it will have).
METRIC_MODULES = ("proxyshift.controller.metrics", "proxyshift.agent.metrics")
# Prometheus' own series an alert may use besides ours: the scrape health of the operator.
PROMETHEUS_SERIES = {"up"}
ALERTS = {"ProxyshiftPolicyDegraded", "ProxyshiftRolloutStalled", "ProxyshiftGateFailuresRepeating",
          "ProxyshiftNodeRolledBack", "ProxyshiftReconcileErrors", "ProxyshiftHeartbeatStale",
          "ProxyshiftNodeModeMismatch", "ProxyshiftRevertHalted", "ProxyshiftOperatorAbsent"}
INSTALL_HINT = ("promtool not found on PATH. It is in Debian's prometheus package (promtool 2.42 on Debian 12): "
                "apt-get install -y --no-install-recommends prometheus (hack/install-deps.sh installs it; the "
                "prometheus service need not run)")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(INSTALL_HINT)
    return path


def run_promtool(promtool: str, *args: str, cwd: Path) -> None:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def rule_groups() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULE.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


# ---- what proxyshift exports ----


def sample_names(metric: MetricWrapperBase) -> set[str]:
    """The series names one prometheus_client metric exposes, by its type."""
    (family,) = metric.describe()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",),
                "stateset": ("",), "enum": ("",)}[family.type]
    return {family.name + s for s in suffixes}


def exported_metrics() -> set[str]:
    names: set[str] = set()
    for module_name in METRIC_MODULES:
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                names |= sample_names(value)
    return names


# ---- metric names in PromQL ----

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers left after strings, label matchers, label lists,
    ranges, durations and function calls are taken out (enough for the expressions kept here)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end():].lstrip()
        word = match.group(0)
        if rest.startswith("(") or word.lower() in KEYWORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the exponent or unit of a number
        names.add(word)
    return names


def test_metric_names_finds_series_and_skips_the_rest() -> None:
    expr = ('time() - max by (policy) (proxyshift_a{condition=~"Paused|x"}) > 1800 and on (policy) '
            'sum(rate(proxyshift_b_total[5m] offset 1h)) unless absent(up{job="j"} == 1) or 1e3')
    assert metric_names(expr) == {"proxyshift_a", "proxyshift_b_total", "up"}


def test_exported_metrics_cover_every_type() -> None:
    names = exported_metrics()
    assert {"proxyshift_nodes", "proxyshift_rollbacks_total", "proxyshift_node_migration_duration_seconds_bucket",
            "proxyshift_policy_last_progress_timestamp_seconds"} <= names
    assert "proxyshift_rollbacks" not in names


# ---- the alerts ----


def test_the_alerts_are_an_optional_component_that_config_prometheus_includes() -> None:
    prometheus = ROOT / "config" / "prometheus"
    component = yaml.safe_load((prometheus / "alerts" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and component["resources"] == [RULE.name]
    monitoring = yaml.safe_load((prometheus / "kustomization.yaml").read_text())
    assert "alerts" in monitoring["components"] and (prometheus / monitoring["resources"][0]).exists()
    default = yaml.safe_load((ROOT / "config" / "default" / "kustomization.yaml").read_text())
    assert "components" not in default, "config/default must stay installable without the Prometheus Operator"


def test_rules_pass_promtool_check(promtool: str, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    run_promtool(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)


def test_alerts_fire_on_their_series_and_on_no_others(promtool: str, tmp_path: Path) -> None:
    groups = rule_groups()
    for group in groups:
        for rule in group["rules"]:
            rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    run_promtool(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)


def test_every_alert_is_tested_firing_and_quiet() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names == ALERTS
    assert fired == names and quiet == names


def github_anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for line in markdown.splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            text = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_every_alert_has_a_severity_summary_description_and_a_runbook_that_exists() -> None:
    anchors = github_anchors(TROUBLESHOOTING.read_text())
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), name
        notes = alert["annotations"]
        assert notes["summary"] and len(notes["description"]) > 80, name
        url = notes["runbook_url"]
        assert url.startswith(RUNBOOKS), name
        anchor = url.removeprefix(RUNBOOKS)
        assert anchor == name.lower() and anchor in anchors, f"{name}: no section #{anchor} in {TROUBLESHOOTING}"


def test_alerts_name_only_metrics_proxyshift_exports() -> None:
    exported = exported_metrics() | PROMETHEUS_SERIES
    for alert in alerts():
        used = metric_names(alert["expr"])
        assert used, alert["alert"]
        assert used <= exported, f"{alert['alert']} names {sorted(used - exported)}, not exported"


# ---- the dashboard ----

# Grafana's own variables, given values promtool accepts.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def dashboard_targets() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found.append((f"{panel['title']} ({target.get('refId', '?')})", target["expr"]))
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text or "")
        if match:
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_dashboard_has_the_panels_operators_look_for() -> None:
    board = json.loads(DASHBOARD.read_text())
    text = json.dumps(board["panels"])
    for metric in ("proxyshift_nodes", "proxyshift_node_migration_duration_seconds_bucket",
                   "proxyshift_gate_failures_total", "proxyshift_rollbacks_total",
                   "proxyshift_reconcile_errors_total", "proxyshift_policy_ready"):
        assert metric in text, f"no panel shows {metric}"
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_dashboard_expressions_parse(promtool: str, tmp_path: Path) -> None:
    targets = dashboard_targets()
    assert targets
    rules = [{"record": f"dashboard:expr_{i}", "expr": promql(expr)} for i, (_, expr) in enumerate(targets)]
    (tmp_path / "dashboard-rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard",
                                                                                 "rules": rules}]}))
    run_promtool(promtool, "check", "rules", "dashboard-rules.yaml", cwd=tmp_path)


def test_dashboard_names_only_metrics_proxyshift_exports() -> None:
    exported = exported_metrics()
    for where, expr in dashboard_targets():
        used = metric_names(promql(expr))
        assert used, where
        assert used <= exported, f"{where} names {sorted(used - exported)}, not exported"
