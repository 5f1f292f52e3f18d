"""`localcluster` argument handling (the parts that need no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcluster import cli

pytestmark = pytest.mark.unit


def test_pools_parse_in_order() -> None:
    assert list(cli.parse_pools("blue=2,green=1").items()) == [("blue", 2), ("green", 1)]


@pytest.mark.parametrize("bad", ["blue", "blue=x", "=2", "blue=1,blue=2"])
def test_bad_pools_are_refused(bad: str) -> None:
    with pytest.raises(cli.UsageError):
        cli.parse_pools(bad)


def test_nodes_and_pools_must_agree() -> None:
    assert cli.pools_for(None, None) == {"default": 3}
    assert cli.pools_for(0, None) == {"default": 0}
    assert cli.pools_for(3, "blue=2,green=1") == {"blue": 2, "green": 1}
    with pytest.raises(cli.UsageError):
        cli.pools_for(2, "blue=2,green=1")


def test_kubeconfig_without_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--state-dir", str(tmp_path / "none"), "kubeconfig"]) == 1
    assert "no cluster" in capsys.readouterr().err
