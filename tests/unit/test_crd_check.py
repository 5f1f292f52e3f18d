"""`proxyshift crd-check` (controller/crd_check.py): the operator's start-up comparison, for a person or a
pipeline before an upgrade; exit codes as docs/cli.md says."""

from __future__ import annotations

from typing import Any

import pytest
from test_schema_drift import document_of

from proxyshift.api.schema_drift import expected_schemas
from proxyshift.cli import main as cli_main
from proxyshift.controller import crd_check

pytestmark = pytest.mark.unit


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the cluster's API server publishes; no kubeconfig is loaded."""
    answer: dict[str, Any] = {"document": document_of(expected_schemas())}
    monkeypatch.setattr(crd_check, "load_api", lambda kubeconfig, context: None)
    monkeypatch.setattr(crd_check.ClusterAPI, "served_openapi", lambda self: answer["document"])
    return answer


def test_up_to_date_crds_exit_0(served: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["crd-check"]) == 0
    assert "hold everything proxyshift" in capsys.readouterr().out


def test_old_crds_exit_1_with_each_difference_and_the_upgrade(served: dict[str, Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    old = expected_schemas()
    del old["ProxyNode"]["properties"]["status"]["properties"]["hold"]
    old["ProxyPolicy"]["properties"]["spec"]["properties"]["mode"]["enum"] = ["iptables", "ipvs", "nftables"]
    served["document"] = document_of(old)

    assert cli_main(["crd-check"]) == 1
    out = capsys.readouterr().out
    assert "kubectl apply --server-side -k config/crd" in out
    assert "  ProxyPolicy .spec.mode: the served schema refuses 'cilium-kpr'" in out
    assert "  ProxyNode .status.hold: missing (the API server drops it)" in out


def test_an_unreadable_document_is_one_line_and_exit_2(served: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    served["document"] = None
    assert cli_main(["crd-check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("proxyshift crd-check: cannot read the API server's OpenAPI v3 document")
    assert len(err.strip().splitlines()) == 1
