"""`proxyshift diagnose`: bad input is one line and exit 2; the request/answer round trip; what is printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxyshift.api.diagnostics import DiagnoseRequest, EndpointCounters, NodeDiagnostics, ServiceCounters
from proxyshift.cli import main
from proxyshift.controller import diagnose_view
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView

pytestmark = pytest.mark.unit

BAD = {
    "no-target": (["service"], "the following arguments are required: target"),
    "not-namespaced": (["service", "web"], "give the Service as NAMESPACE/NAME"),
    "too-many-slashes": (["service", "a/b/c"], "give the Service as NAMESPACE/NAME"),
    "unknown-kind": (["pod", "a/b"], "only 'service NAMESPACE/NAME' is known"),
    "zero-timeout": (["service", "a/b", "--timeout", "0"], "--timeout 0: give seconds"),
    "nan-timeout": (["service", "a/b", "--timeout", "nan"], "--timeout nan: give seconds"),
    "word-timeout": (["service", "a/b", "--timeout", "soon"], "invalid float value"),
    "unknown-flag": (["service", "a/b", "--bogus"], "unrecognized arguments: --bogus"),
}


@pytest.mark.parametrize(("args", "words"), BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               args: list[str], words: str) -> None:
    code = main(["diagnose", *args, "--kubeconfig", str(tmp_path / "none")] if args != ["service"]
                else ["diagnose", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("proxyshift diagnose: ") and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_missing_kubeconfig_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["diagnose", "service", "a/b", "--kubeconfig", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "cannot load the cluster's kubeconfig" in err and err.count("\n") == 1


class FakeCustom:
    """ProxyNodes as the API server holds them; `agent` answers a request when it is called."""

    def __init__(self, nodes: list[str], *, drop_first_request: bool = False) -> None:
        self.objs: dict[str, dict[str, Any]] = {n: {"metadata": {"name": n}, "spec": {}, "status": {}} for n in nodes}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.drop = drop_first_request

    def patch_cluster_custom_object(self, group: str, version: str, plural: str, name: str,
                                    body: dict[str, Any]) -> dict[str, Any]:
        self.patches.append((name, body))
        if self.drop:
            self.drop = False  # the operator replaced the spec right after: the request is gone
            return self.objs[name]
        self.objs[name]["spec"] = {**self.objs[name]["spec"], **body["spec"]}
        return self.objs[name]

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str) -> dict[str, Any]:
        obj = self.objs[name]
        request = obj["spec"].get("diagnose")
        if request and name != "ps-node-dead":  # the node's agent answers what it finds
            obj["status"]["diagnostics"] = NodeDiagnostics(id=request["id"], mode="iptables").to_k8s()
        return obj


def test_ask_nodes_collects_answers_and_waits_only_until_the_deadline() -> None:
    custom = FakeCustom(["ps-node-1", "ps-node-dead"])
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    answers = diagnose_view.ask_nodes(custom, ["ps-node-1", "ps-node-dead"], DiagnoseRequest(id="d1"), 2.0,
                                      clock=lambda: now[0], sleep=sleep)
    assert answers["ps-node-1"] is not None and answers["ps-node-1"].id == "d1"
    assert answers["ps-node-dead"] is None
    assert 2.0 <= now[0] < 2.0 + 2 * diagnose_view.POLL_SECONDS


def test_a_request_the_operator_overwrote_is_written_again() -> None:
    custom = FakeCustom(["ps-node-1"], drop_first_request=True)
    answers = diagnose_view.ask_nodes(custom, ["ps-node-1"], DiagnoseRequest(id="d2"), 5.0, sleep=lambda _: None)
    assert answers["ps-node-1"] is not None
    assert len(custom.patches) == 2


def test_render_names_mode_rules_shares_readiness_and_both_causes() -> None:
    service = ServiceView(namespace="ps-behaviour", name="affinity", cluster_ips=("198.19.0.30",),
                          ports=(ServicePortView(name="http", protocol="TCP", port=80),),
                          session_affinity="ClientIP", affinity_timeout_seconds=600)
    endpoints = [EndpointView(service="ps-behaviour/affinity", address=f"198.18.1.{i}", ready=i != 3,
                              node_name="ps-node-2") for i in (1, 2, 3)]
    counters = ServiceCounters(service="ps-behaviour/affinity", source="iptables",
                               rules=["KUBE-SVC-X (4 rules)", "KUBE-SEP-A (2 rules)"],
                               endpoints=[EndpointCounters(address="198.18.1.1", flows=50),
                                          EndpointCounters(address="198.18.1.2", flows=0),
                                          EndpointCounters(address="198.18.1.3", flows=0)])
    answers = {"ps-node-1": NodeDiagnostics(id="d", mode="iptables", duration_seconds=0.05, services=[counters]),
               "ps-node-2": NodeDiagnostics(id="d", mode="iptables", services=[counters]),
               "ps-node-3": None}
    text = diagnose_view.render(service, endpoints, answers, 15)
    assert "node ps-node-1: mode iptables, counters from iptables (read in 0.05s)" in text
    assert "rules: KUBE-SVC-X (4 rules)" in text
    assert "EndpointSlices: 2/3 endpoints ready" in text
    assert "node ps-node-3: no answer within 15s" in text
    assert text.count("verdict: uneven") == 3  # two nodes and all nodes together
    assert "cause ClientIPAffinity" in text and "cause EndpointNotReady" in text
    assert "all nodes (2 nodes):" in text and "100 new flows" in text
