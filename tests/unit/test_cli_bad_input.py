"""Bad files and settings given to the CLI: one line naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyshift.cli import main

pytestmark = pytest.mark.unit

GOOD = """apiVersion: proxyshift.io/v1alpha1
kind: ProxyPolicy
metadata: {name: blue}
spec: {nodeSelector: {matchLabels: {pool: blue}}, mode: nftables}
"""


def _write(tmp: Path, name: str, content: str | bytes) -> str:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


CASES: dict[str, tuple[object, str]] = {
    "missing-file": (None, "no such file"),
    "directory": ("DIR", "is a directory"),
    "yaml-syntax-error": ("kind: ProxyPolicy\nspec: [a, b\n", "not valid YAML: "),
    "binary-file": (b"\x7fELF\x02\x01\x01\x00\x00\x00", "a binary file"),
    "not-utf8": (b"kind: ProxyPolicy\nname: \xff\xfe\n", "not UTF-8"),
    "not-a-policy": ("apiVersion: v1\nkind: ConfigMap\n", "no ProxyPolicy in it (found ConfigMap)"),
    "two-policies": (GOOD + "---\n" + GOOD, "2 ProxyPolicy manifests"),
    "refused-spec": (GOOD.replace("nftables", "userspace"), "the API server would refuse this policy: spec.mode"),
    "empty": ("", "no ProxyPolicy in it (found nothing)"),
}


@pytest.mark.parametrize(("content", "words"), CASES.values(), ids=CASES.keys())
def test_plan_turns_a_bad_file_into_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, words: str,
) -> None:
    if content is None:
        path = str(tmp_path / "absent.yaml")
    elif content == "DIR":
        path = str(tmp_path)
    else:
        path = _write(tmp_path, "policy.yaml", content)  # type: ignore[arg-type]  # a str or bytes case here
    code = main(["plan", "-f", path, "--kubeconfig", str(tmp_path / "no-kubeconfig")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("proxyshift plan: ") and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_good_file_gets_past_reading_to_a_one_line_kubeconfig_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "-f", _write(tmp_path, "policy.yaml", GOOD), "--kubeconfig", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot load the cluster's kubeconfig" in err and err.count("\n") == 1, err
