"""Bad files and settings given to the CLI: one line naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from collections.abc import Callable
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


def _case_path(tmp_path: Path, name: str, content: object) -> str:
    """The file a case names: None absent, "DIR" a directory, else `name` holding the content."""
    if content is None:
        return str(tmp_path / f"absent-{name}")
    if content == "DIR":
        return str(tmp_path)
    return _write(tmp_path, name, content)  # type: ignore[arg-type]  # a str or bytes case here


@pytest.mark.parametrize(("content", "words"), CASES.values(), ids=CASES.keys())
def test_plan_turns_a_bad_file_into_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, words: str,
) -> None:
    path = _case_path(tmp_path, "policy.yaml", content)
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


# Every command that takes --kubeconfig, with the rest of a valid command line ({policy}: a good policy file).
KUBECONFIG_COMMANDS: dict[str, list[str]] = {
    "status": ["status", "blue"],
    "plan": ["plan", "-f", "{policy}"],
    "diagnose": ["diagnose", "service", "default/web"],
    "restore-baseline": ["restore-baseline"],
    "operator": ["operator", "--metrics-port", "0", "--standalone"],
    "agent": ["agent", "--node", "node-1", "--listen", ""],
}
KUBECONFIG_CASES: dict[str, tuple[object, str]] = {
    "missing-file": (None, "no such file"),
    "directory": ("DIR", "is a directory; give a kubeconfig file (--kubeconfig FILE)"),
    "yaml-syntax-error": ("apiVersion: v1\nclusters: [a, b\n", "not valid YAML: "),
    "yaml-unsafe-tag": ("clusters: !!python/object/apply:os.system [true]\n", "not valid YAML: "),
    "binary-file": (b"\x7fELF\x02\x01\x01\x00\x00\x00", "a binary file, not a kubeconfig"),
    "not-utf8": (b"apiVersion: v1\nkind: Config\nname: \xff\xfe\n", "not UTF-8"),
    "empty": ("", "empty; not a kubeconfig"),
    "only-comments": ("# nothing here\n", "empty; not a kubeconfig"),
    "two-documents": ("kind: Config\nclusters: []\ncontexts: []\n---\nkind: Config\n", "more than one YAML document"),
    "a-yaml-list": ("- a\n- b\n", "a YAML list, not a kubeconfig"),
    "a-yaml-string": ("just some words\n", "a YAML str, not a kubeconfig"),
    "another-kind": ("apiVersion: v1\nkind: ConfigMap\ndata: {}\n", "a ConfigMap, not a kubeconfig"),
    "no-clusters": ("apiVersion: v1\nkind: Config\ncontexts: []\n", "'clusters' is not a list"),
    "clusters-not-entries": ("kind: Config\nclusters: 5\ncontexts: []\n", "'clusters' is not a list"),
    "contexts-not-entries": ("kind: Config\nclusters: []\ncontexts: [a, b]\n", "'contexts' is not a list"),
    # Of the right shape, and still unusable: the client's own refusal, as one line.
    "unknown-current-context": ("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n"
                                "current-context: nowhere\n", "cannot load the cluster's kubeconfig"),
}


@pytest.mark.parametrize("command", KUBECONFIG_COMMANDS.values(), ids=KUBECONFIG_COMMANDS.keys())
@pytest.mark.parametrize(("content", "words"), KUBECONFIG_CASES.values(), ids=KUBECONFIG_CASES.keys())
def test_every_command_turns_a_bad_kubeconfig_into_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    command: list[str], content: object, words: str,
) -> None:
    # Set, then deleted: monkeypatch restores only what it changed, and `operator` sets $KUBECONFIG to the
    # file it is given (kopf's login reads it from there), which must not outlive this test.
    monkeypatch.setenv("KUBECONFIG", "")
    monkeypatch.delenv("KUBECONFIG")
    path = _case_path(tmp_path, "kubeconfig", content)
    policy = _write(tmp_path, "policy.yaml", GOOD)
    argv = [arg.replace("{policy}", policy) for arg in command] + ["--kubeconfig", path]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"proxyshift {command[0]}: cannot load the cluster's kubeconfig") and words in err, err
    assert path in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("content", ["- a\n- b\n", "clusters: [a, b\n", "kind: Config\nclusters: 5\ncontexts: 3\n"],
                         ids=["a-yaml-list", "yaml-syntax-error", "clusters-not-entries"])
def test_a_bad_kubeconfig_from_the_environment_is_one_line_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, content: str,
) -> None:
    # $KUBECONFIG is the client's to read (it may list several files); its errors are caught all the same.
    monkeypatch.setenv("KUBECONFIG", _write(tmp_path, "kubeconfig", content))
    code = main(["status"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("proxyshift status: cannot load the cluster's kubeconfig"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(("make", "words"), [
    (lambda tmp: tmp / "absent", "no such directory"),
    (lambda tmp: Path(_write(tmp, "a-file", "x")), "not a directory"),
], ids=["missing", "a-file"])
@pytest.mark.parametrize("check", [[], ["--check"]], ids=["write", "check"])
def test_crds_turns_a_bad_root_into_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], Path], words: str,
    check: list[str],
) -> None:
    root = make(tmp_path)
    code = main(["crds", "--root", str(root), *check])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err == f"proxyshift crds: --root {root}: {words}\n" and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"a-file"} & {root.name})  # nothing written
