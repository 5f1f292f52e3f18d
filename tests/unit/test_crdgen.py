"""The generated CRDs: committed files match the models, schemas are structural and documented."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxyshift.api import crdgen
from proxyshift.api.policy import ProxyPolicy

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _crds() -> dict[str, dict[str, Any]]:
    return {r.kind: crdgen.crd(r) for r in crdgen.RESOURCES}


def _schema(kind: str) -> dict[str, Any]:
    return _crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path, depth first."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def test_committed_files_match_the_models() -> None:
    diffs = crdgen.check(ROOT, crdgen.generate())
    assert not diffs, "run `proxyshift crds`:\n" + "\n".join(diffs)


def test_generation_is_deterministic() -> None:
    assert crdgen.generate() == crdgen.generate()


@pytest.mark.parametrize("kind", ["ProxyPolicy", "ProxyNode"])
def test_every_property_has_a_description(kind: str) -> None:
    # Except the top-level metadata: the API server refuses a CRD that describes it.
    assert _schema(kind)["properties"]["metadata"] == {"type": "object"}
    missing = [
        f"{path}.{name}"
        for path, node in _nodes(_schema(kind))
        for name, sub in node.get("properties", {}).items()
        if not sub.get("description", "").strip() and f"{path}.{name}" != ".metadata"
    ]
    assert not missing, f"properties without description (kubectl explain would be empty): {missing}"


@pytest.mark.parametrize("kind", ["ProxyPolicy", "ProxyNode"])
def test_schema_is_structural(kind: str) -> None:
    for path, node in _nodes(_schema(kind)):
        assert "$ref" not in node and "$defs" not in node, path
        assert "title" not in node, path
        assert "nullable" not in node, path  # optional fields are absent, never null
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        if node.get("type") == "object":
            assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


@pytest.mark.parametrize("kind", ["ProxyPolicy", "ProxyNode"])
def test_required_fields_exist(kind: str) -> None:
    for path, node in _nodes(_schema(kind)):
        for name in node.get("required", []):
            assert name in node.get("properties", {}), f"{path} requires unknown {name}"


def test_resource_names_columns_and_subresources() -> None:
    crds = _crds()
    policy, node = crds["ProxyPolicy"], crds["ProxyNode"]
    for obj in (policy, node):
        assert obj["apiVersion"] == "apiextensions.k8s.io/v1"
        assert obj["spec"]["group"] == "proxyshift.io"
        assert obj["spec"]["scope"] == "Cluster"
        assert obj["spec"]["names"]["categories"] == ["proxyshift"]
        version = obj["spec"]["versions"][0]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
    assert policy["metadata"]["name"] == "proxypolicies.proxyshift.io"
    assert policy["spec"]["names"]["shortNames"] == ["ppol"]
    assert node["spec"]["names"]["shortNames"] == ["pnode"]

    def columns(obj: dict[str, Any]) -> dict[str, str]:
        return {c["name"]: c["jsonPath"] for c in obj["spec"]["versions"][0]["additionalPrinterColumns"]}

    assert columns(policy) == {
        "Mode": ".spec.mode", "Phase": ".status.phase", "Progress": ".status.progress",
        "Revision": ".status.currentRevision", "Age": ".metadata.creationTimestamp",
    }
    assert columns(node) == {
        "Mode": ".status.observedMode", "Target": ".spec.mode", "Phase": ".spec.migration.phase",
        "Policy": ".spec.policy", "Leftovers": ".status.leftoverObjects", "Heartbeat": ".status.heartbeat",
        "Age": ".metadata.creationTimestamp", "Leftover Modes": ".status.leftovers", "Revision": ".spec.revision",
        "Reason": ".spec.migration.reason", "Healthz": ".status.kubeProxy.healthzStatus",
        "Kernel": ".status.kernelRelease", "Agent": ".status.agentVersion",
    }


def test_proxynode_wide_columns_add_something_and_leftovers_is_a_count() -> None:
    columns = _crds()["ProxyNode"]["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"] for c in columns if not c.get("priority")]
    wide = [c["name"] for c in columns if c.get("priority") == 1]
    assert default == ["Mode", "Target", "Phase", "Policy", "Leftovers", "Heartbeat", "Age"]
    assert wide and not set(wide) & set(default)
    leftovers = next(c for c in columns if c["name"] == "Leftovers")
    assert leftovers["type"] == "integer"
    status = _schema("ProxyNode")["properties"]["status"]["properties"]
    assert status["leftoverObjects"]["type"] == "integer" and status["leftoverObjects"]["minimum"] == 0


def _printer_paths_exist(kind: str) -> None:
    schema = _schema(kind)
    crd = _crds()[kind]
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata"):
            continue
        node = schema
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]


@pytest.mark.parametrize("kind", ["ProxyPolicy", "ProxyNode"])
def test_printer_columns_point_at_real_fields(kind: str) -> None:
    _printer_paths_exist(kind)


def _rules(node: Any) -> list[dict[str, str]]:
    found: list[dict[str, str]] = []
    if isinstance(node, dict):
        found += node.get("x-kubernetes-validations", [])
        for value in node.values():
            found += _rules(value)
    elif isinstance(node, list):
        for value in node:
            found += _rules(value)
    return found


def test_cel_rules_are_carried_over_unchanged() -> None:
    from_models = _rules(ProxyPolicy.model_json_schema(by_alias=True))
    in_crd = _rules(_schema("ProxyPolicy"))
    key = lambda r: (r["rule"], r["message"], r.get("fieldPath", ""))  # noqa: E731
    assert sorted(map(key, in_crd)) == sorted(map(key, from_models))
    assert len(in_crd) >= 6


def test_rules_sit_under_bounded_lists() -> None:
    # The API server multiplies a rule's cost by how many times it can run: every list
    # above a rule needs maxItems, or the estimated cost may exceed the per-CRD budget.
    def walk(node: dict[str, Any], path: str, bounded: bool) -> Iterator[str]:
        if node.get("x-kubernetes-validations") and not bounded:
            yield path
        for name, sub in node.get("properties", {}).items():
            yield from walk(sub, f"{path}.{name}", bounded)
        if "items" in node:
            yield from walk(node["items"], f"{path}[]", bounded and "maxItems" in node)

    assert list(walk(_schema("ProxyPolicy"), "", True)) == []


def test_spec_lists_and_rule_strings_are_bounded() -> None:
    spec = _schema("ProxyPolicy")["properties"]["spec"]
    for path, node in _nodes(spec, ".spec"):
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list"
    stages = spec["properties"]["rollout"]["properties"]["stages"]
    assert stages["maxItems"] == 10
    gate_timeout = spec["properties"]["gate"]["properties"]["timeout"]
    assert gate_timeout["maxLength"] == 32


def test_defaults_are_the_models_defaults() -> None:
    spec = _schema("ProxyPolicy")["properties"]["spec"]["properties"]
    model = ProxyPolicy.model_validate({"spec": {"nodeSelector": {}, "mode": "ipvs", "ipvs": {}}}).spec
    assert spec["rollout"]["properties"]["maxUnavailable"]["default"] == model.rollout.max_unavailable
    assert spec["gate"]["properties"]["timeout"]["default"] == model.gate.timeout
    assert spec["gate"]["properties"]["minSyncs"]["default"] == model.gate.min_syncs
    assert model.ipvs is not None
    assert spec["ipvs"]["properties"]["scheduler"]["default"] == model.ipvs.scheduler
    assert spec["deletionPolicy"]["default"] == model.deletion_policy
    status = _schema("ProxyPolicy")["properties"]["status"]
    assert all("default" not in node for _, node in _nodes(status))


def test_status_conditions_are_a_map_keyed_by_type() -> None:
    conditions = _schema("ProxyPolicy")["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_yaml_files_parse_back_to_the_generated_objects() -> None:
    files = crdgen.generate()
    for resource in crdgen.RESOURCES:
        assert yaml.safe_load(files[f"crds/{resource.filename}"]) == crdgen.crd(resource)


def test_reference_page_lists_every_spec_field() -> None:
    page = crdgen.generate()["docs/crd-reference.md"]
    for path, _ in _nodes(_schema("ProxyPolicy")["properties"]["spec"], ".spec"):
        # list items and map values are described by their list/map row (and their own fields)
        if not path.endswith(("{}", "[]")):
            assert f"`{path}`" in page
    assert "stages must not be empty and the last stage must be percent: 100" in page


def test_check_passes_then_fails_with_a_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0
    target = tmp_path / "crds" / "proxypolicy.yaml"
    target.write_text(target.read_text().replace("ppol", "pp"))
    capsys.readouterr()
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "-    - pp" in out and "+    - ppol" in out


def test_check_fails_when_a_file_is_missing(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1  # docs/crd-reference.md absent
