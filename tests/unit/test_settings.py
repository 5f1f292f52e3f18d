"""PROXYSHIFT_* settings are checked when the operator starts: a bad one is one line naming it, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxyshift.controller import settings

pytestmark = pytest.mark.unit

BAD = {
    "PROXYSHIFT_NODE_CONCURRENCY": ("eight", "is not an integer"),
    "PROXYSHIFT_NODE_CONCURRENCY ": ("0", "out of range"),
    "PROXYSHIFT_IDLE_REQUEUE_SECONDS": ("nan", "out of range"),
    "PROXYSHIFT_MIN_REQUEUE_SECONDS": ("-1", "out of range"),
    "PROXYSHIFT_METRICS_PORT": ("80800", "out of range"),
    "PROXYSHIFT_NODE_EVENTS": ("all", "use one of auto, steps, outcomes"),
}


@pytest.mark.parametrize(("name", "value", "words"), [(k.strip(), v, w) for k, (v, w) in BAD.items()],
                         ids=list(BAD))
def test_a_bad_setting_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                words: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(settings.SettingsError, match=words) as caught:
        settings.OperatorConfig()
    assert name in str(caught.value)


def test_defaults_are_valid_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BAD:
        monkeypatch.delenv(name.strip(), raising=False)
    config = settings.OperatorConfig()
    assert (config.node_concurrency, config.node_events, config.metrics_port) == (8, "auto", 8080)


def test_the_operator_command_refuses_to_start_in_one_line() -> None:
    # A fresh interpreter: the settings are read when the operator's modules are imported.
    result = subprocess.run([sys.executable, "-m", "proxyshift.cli", "operator", "--help"], capture_output=True,
                            text=True, timeout=120, env={"PROXYSHIFT_NODE_CONCURRENCY": "8x", "PATH": "/usr/bin"},
                            check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "proxyshift operator: PROXYSHIFT_NODE_CONCURRENCY='8x' is not an integer"
