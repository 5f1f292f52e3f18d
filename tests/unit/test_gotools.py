"""The tests' pinned Go tools: cached by a hash of their sources, pinned by a committed go.sum."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localcluster import gotools

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _module(tmp_path: Path) -> Path:
    module = tmp_path / "tool"
    module.mkdir()
    (module / "go.mod").write_text("module example.com/tool\n\ngo 1.26.0\n")
    (module / "main.go").write_text("package main\n\nfunc main() {}\n")
    return module


def test_hash_follows_every_source_file(tmp_path: Path) -> None:
    module = _module(tmp_path)
    first = gotools.source_hash(module)
    assert gotools.source_hash(module) == first
    (module / "main.go").write_text("package main\n\nfunc main() { println() }\n")
    edited = gotools.source_hash(module)
    (module / "extra.go").write_text("package main\n")
    assert len({first, edited, gotools.source_hash(module)}) == 3


def test_folder_without_go_mod_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "main.go").write_text("package main\n")
    with pytest.raises(gotools.GoToolError, match="no Go module"):
        gotools.source_hash(tmp_path)


def test_missing_binary_is_none_with_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name = "argocd-health-runner"
    path = gotools.binary_path(name)
    assert path.is_relative_to(tmp_path / "cache" / "proxyshift" / "tools" / name)
    assert gotools.built(name) is None
    assert "make go-tools" in gotools.build_hint(name)
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    assert gotools.built(name) == path


def test_unknown_tool_is_named() -> None:
    with pytest.raises(gotools.GoToolError, match="unknown Go tool 'helmet'"):
        gotools.module_dir("helmet")


@pytest.mark.parametrize("name", sorted(gotools.TOOLS))
def test_every_requirement_is_pinned_in_go_sum(name: str) -> None:
    # With -mod=mod a requirement missing from go.sum would be fetched and written to go.sum on
    # first use rather than checked against a pin.
    module = ROOT / gotools.TOOLS[name].module
    go_mod = (module / "go.mod").read_text()
    go_sum = (module / "go.sum").read_text()
    # "// indirect" too: a module that pins an upstream command by a `tool` directive requires it so.
    required = re.findall(r"^\s*(?:require\s+)?([\w./-]+\.[\w./-]+) (v\S+)(?:\s*// indirect)?\s*$",
                          go_mod, re.M)
    assert required
    for path, version in required:
        assert f"{path} {version} h1:" in go_sum, f"{path} {version} not in {module / 'go.sum'}"


def test_health_runner_pins_argo_cds_gopher_lua() -> None:
    # Argo CD 3.6's go.mod requires gopher-lua v1.1.2: the runner must evaluate with the same one.
    go_mod = (ROOT / gotools.TOOLS["argocd-health-runner"].module / "go.mod").read_text()
    assert re.search(r"^\s*github\.com/yuin/gopher-lua v1\.1\.2$", go_mod, re.M)


def test_helm_is_the_pinned_release_built_as_a_tool() -> None:
    helm = gotools.TOOLS["helm"]
    go_mod = (ROOT / helm.module / "go.mod").read_text()
    assert re.search(r"^tool helm\.sh/helm/v3/cmd/helm$", go_mod, re.M)
    assert re.search(r"^\s*helm\.sh/helm/v3 v3\.22\.0\b", go_mod, re.M)
    assert helm.package == "helm.sh/helm/v3/cmd/helm"


def test_helm_links_the_kubernetes_version_of_its_client_go() -> None:
    # helm's Makefile derives its default cluster version from client-go (v0.N -> 1.N); ours must match
    # the go.mod, or `helm template` judges kubeVersion against the wrong release.
    helm = gotools.TOOLS["helm"]
    go_mod = (ROOT / helm.module / "go.mod").read_text()
    minor = re.search(r"^\s*k8s\.io/client-go v0\.(\d+)\.", go_mod, re.M)
    assert minor
    assert f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor.group(1)}" in helm.ldflags
    assert f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={minor.group(1)}" in helm.ldflags


def test_own_ldflags_change_the_hash_and_none_keep_it(tmp_path: Path) -> None:
    module = _module(tmp_path)
    plain = gotools.source_hash(module)
    assert gotools.source_hash(module, ()) == plain
    assert gotools.source_hash(module, ("-X main.version=1",)) != plain


def test_tags_change_the_hash_and_reach_go_build(tmp_path: Path) -> None:
    module = _module(tmp_path)
    plain = gotools.source_hash(module)
    assert gotools.source_hash(module, (), ()) == plain
    assert gotools.source_hash(module, (), ("osusergo",)) != plain
    tool = gotools.GoTool("t", "tool", "test", tags=("osusergo", "netgo"))
    args = gotools._build_args(tool)
    assert args[args.index("-tags") + 1] == "osusergo,netgo"
    assert "-tags" not in gotools._build_args(gotools.GoTool("t", "tool", "test"))


def test_cilium_agent_is_the_pinned_release_with_the_gobgp_the_proxy_serves() -> None:
    agent = gotools.TOOLS["cilium-agent"]
    go_mod = (ROOT / agent.module / "go.mod").read_text()
    assert re.search(r"^tool github\.com/cilium/cilium/daemon$", go_mod, re.M)
    assert re.search(r"^require github\.com/cilium/cilium v1\.20\.2\b", go_mod, re.M)
    # Cilium's own go.mod pins a gobgp pseudo-version the module proxy refuses.
    assert re.search(r"^require github\.com/osrg/gobgp/v4 v4\.7\.0\b", go_mod, re.M)
    assert agent.package == "github.com/cilium/cilium/daemon"
    assert agent.tags == ("osusergo",)
