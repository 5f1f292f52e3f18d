"""The table of bad ProxyPolicy manifests, each with the message its author gets.

The table is data (tests/fixtures/bad-policies/*.yaml, expectations in the
header comments) so tests/e2e/test_bad_policies_apiserver.py replays the same
files against a real API server. Here every case is checked twice:

- against the pydantic models (what `proxyshift plan` and the operator see);
- against the generated CRD: its structural schema, applied the way the API
  server applies it (defaults first, then OpenAPI validation with the API
  server's message formats), and its CEL rules evaluated with cel-python
  (cel-python implements the CEL spec; it lacks Kubernetes' extension
  libraries and cost estimation, which our rules do not need and
  test_crdgen.py bounds).

Where a CEL rule refuses a manifest, the model must say the very same words.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from pydantic import ValidationError

from proxyshift.api import crdgen
from proxyshift.api.policy import ProxyPolicy

pytestmark = pytest.mark.unit

CASES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "bad-policies"
SAMPLES_DIR = Path(__file__).resolve().parents[2] / "config" / "samples"
_HEADER = re.compile(r"^# (field|refused-by|apiserver|model): (.*)$")


@dataclass(frozen=True)
class Case:
    name: str
    field: str
    refused_by: str  # schema | cel | strict (unknown field, with kubectl's strict field validation)
    apiserver: str
    model: str
    manifest: dict[str, Any]


def load_case(path: Path) -> Case:
    text = path.read_text(encoding="utf-8")
    meta = {m.group(1): m.group(2) for line in text.splitlines() if (m := _HEADER.match(line))}
    return Case(path.stem, meta["field"], meta["refused-by"], meta["apiserver"], meta["model"], yaml.safe_load(text))


CASES = [load_case(p) for p in sorted(CASES_DIR.glob("*.yaml"))]


# ---- a small stand-in for the API server's CRD validation ------------------------------------


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _type_ok(schema: dict[str, Any], value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
    expected = schema.get("type")
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        None: True,
    }[expected]


class ApiServerSim:
    """Defaulting, structural validation and CEL rules of one CRD version, with the API server's wording."""

    def __init__(self, crd: dict[str, Any]) -> None:
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self.cel = celpy.Environment()

    def default(self, schema: dict[str, Any], value: Any) -> Any:
        if isinstance(value, dict) and schema.get("type") == "object":
            # Nulls of non-nullable fields are pruned before defaulting: null means unset.
            for name in [k for k, v in value.items() if v is None and not schema.get("properties", {}).get(
                    k, {}).get("nullable")]:
                del value[name]
            for name, sub in schema.get("properties", {}).items():
                if name not in value and "default" in sub:
                    value[name] = copy.deepcopy(sub["default"])
                if name in value:
                    value[name] = self.default(sub, value[name])
            if isinstance(schema.get("additionalProperties"), dict):
                for key in value:
                    value[key] = self.default(schema["additionalProperties"], value[key])
        elif isinstance(value, list) and "items" in schema:
            return [self.default(schema["items"], item) for item in value]
        return value

    def validate(self, obj: dict[str, Any], strict: bool = True) -> list[str]:
        obj = self.default(self.schema, copy.deepcopy(obj))
        errors: list[str] = []
        self._check(self.schema, obj, "", errors, strict)
        return errors

    def _check(self, schema: dict[str, Any], value: Any, path: str, errors: list[str], strict: bool) -> None:
        shown = path.lstrip(".")
        if not _type_ok(schema, value):
            errors.append(f"{shown}: Invalid value: {_json(value)}: {shown} in body must be of type {schema['type']}")
            return
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(_json(v) for v in schema["enum"])
            errors.append(f"{shown}: Unsupported value: {_json(value)}: supported values: {allowed}")
        if isinstance(value, str):
            if "pattern" in schema and not re.search(schema["pattern"], value):
                errors.append(f"{shown}: Invalid value: {_json(value)}: {shown} in body should match "
                              f"'{schema['pattern']}'")
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                errors.append(f"{shown}: Too long: may not be more than {schema['maxLength']} bytes")
        if isinstance(value, int | float) and not isinstance(value, bool) and not schema.get(
                "x-kubernetes-int-or-string"):
            if "minimum" in schema:
                if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
                    errors.append(f"{shown}: Invalid value: {value}: {shown} in body should be greater than "
                                  f"{schema['minimum']}")
                elif value < schema["minimum"]:
                    errors.append(f"{shown}: Invalid value: {value}: {shown} in body should be greater than or "
                                  f"equal to {schema['minimum']}")
            if "maximum" in schema and value > schema["maximum"]:
                errors.append(f"{shown}: Invalid value: {value}: {shown} in body should be less than or equal to "
                              f"{schema['maximum']}")
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                errors.append(f"{shown}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
            for index, item in enumerate(value):
                self._check(schema["items"], item, f"{path}[{index}]", errors, strict)
        if isinstance(value, dict):
            props = schema.get("properties", {})
            for name in schema.get("required", []):
                if name not in value:
                    errors.append(f"{shown + '.' if shown else ''}{name}: Required value")
            for name, item in value.items():
                if name in props:
                    self._check(props[name], item, f"{path}.{name}", errors, strict)
                elif isinstance(schema.get("additionalProperties"), dict):
                    self._check(schema["additionalProperties"], item, f"{path}.{name}", errors, strict)
                elif strict and not schema.get("x-kubernetes-preserve-unknown-fields") and path != ".metadata":
                    errors.append(f'unknown field "{shown + "." if shown else ""}{name}"')
        for rule in schema.get("x-kubernetes-validations", []):
            if not self.rule_holds(rule["rule"], value):
                where = shown + rule.get("fieldPath", "")
                errors.append(f"{where}: Invalid value: {_json(schema.get('type', ''))}: {rule['message']}")

    def rule_holds(self, rule: str, value: Any) -> bool:
        program = self.cel.program(self.cel.compile(rule))
        try:
            return bool(program.evaluate({"self": celpy.json_to_cel(value)}))
        except celpy.CELEvalError:
            return False  # the API server reports an evaluation error as a refusal too


@pytest.fixture(scope="module")
def apiserver() -> ApiServerSim:
    return ApiServerSim(crdgen.crd(next(r for r in crdgen.RESOURCES if r.kind == "ProxyPolicy")))


# ---- the table --------------------------------------------------------------------------------


def test_the_table_is_big_enough_and_covers_the_issue() -> None:
    assert len(CASES) >= 15
    names = {c.name.split("-", 1)[1] for c in CASES}
    for required_case in ("unknown-mode", "scheduler-without-ipvs", "bad-scheduler", "max-unavailable-zero",
                          "max-unavailable-zero-percent", "max-unavailable-101-percent", "empty-stages",
                          "stages-not-ending-at-100", "bad-duration-words", "missing-node-selector"):
        assert required_case in names


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_model_refuses_with_the_message(case: Case) -> None:
    with pytest.raises(ValidationError) as info:
        ProxyPolicy.model_validate(case.manifest)
    errors = info.value.errors()
    messages = [e["msg"].removeprefix("Value error, ") for e in errors]
    assert any(case.model == m for m in messages), messages
    # The model points at the same field, or (for rules across fields) at the object holding it.
    locations = [".".join(str(p) for p in e["loc"]) for e in errors]
    field = re.sub(r"\[(\d+)\]", r".\1", case.field)
    assert any(field == loc or field.startswith(loc + ".") for loc in locations), (locations, field)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crd_refuses_with_the_message(case: Case, apiserver: ApiServerSim) -> None:
    errors = apiserver.validate(case.manifest)
    assert any(case.apiserver in e and case.field in e for e in errors), errors
    if case.refused_by == "strict":
        # Without strict field validation the API server prunes the unknown field instead.
        assert apiserver.validate(case.manifest, strict=False) == []


@pytest.mark.parametrize("case", [c for c in CASES if c.refused_by == "cel"], ids=lambda c: c.name)
def test_cel_refusals_say_what_the_model_says(case: Case, apiserver: ApiServerSim) -> None:
    assert case.apiserver == case.model
    # Only the CEL rule refuses it: the schema alone would let it through.
    errors = apiserver.validate(case.manifest)
    assert all(case.apiserver in e for e in errors), errors


def _valid_manifests() -> list[tuple[str, dict[str, Any]]]:
    minimal = {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "all"},
               "spec": {"nodeSelector": {}, "mode": "nftables"}}
    full: dict[str, Any] = copy.deepcopy(minimal)
    full["spec"] = {
        "nodeSelector": {"matchLabels": {"pool": "green"},
                         "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                              {"key": "edge", "operator": "DoesNotExist"}]},
        "mode": "ipvs",
        "ipvs": {"scheduler": "mh", "strictARP": True, "syncPeriod": "1m30s", "minSyncPeriod": "500ms",
                 "tcpTimeout": "0s", "excludeCIDRs": ["10.0.0.0/8"]},
        "rollout": {"maxUnavailable": "100%", "stages": [{"nodes": 1, "pause": "1h"}, {"percent": 100}],
                    "pauseBetweenNodes": "5s", "cordon": True, "drain": True, "paused": True},
        "preflight": {"loadModules": True, "extraModules": ["nf_conntrack_netlink"]},
        "gate": {"timeout": "2m", "minSyncs": 3, "maxSyncDurationSeconds": 0.5, "healthz": False,
                 "probeServices": [{"namespace": "default", "name": "kubernetes", "port": 443}]},
        "cleanup": {"staleRules": False},
        "deletionPolicy": "Orphan",
        "nodePortAddresses": ["primary", "198.18.0.0/15", "fd00::/8"],
        "conntrack": {"tcpBeLiberal": True},
    }
    full["spec"]["gate"]["behaviour"] = {"enabled": True, "samplePerKind": 8, "budgetSeconds": 2.5,
                                         "allowChanges": ["LocalhostNodePorts", "NodePortAddresses"]}
    localhost: dict[str, Any] = copy.deepcopy(minimal)
    localhost["spec"] |= {"nodePortAddresses": ["primary", "localhost"], "nftables": {"localhostNodePorts": True}}
    found = [("nodeSelector-empty", minimal), ("every-field", full), ("nftables-localhost", localhost)]
    found += [(p.stem, yaml.safe_load(p.read_text())) for p in sorted(SAMPLES_DIR.glob("*.yaml"))]
    return found


@pytest.mark.parametrize(("name", "manifest"), _valid_manifests(), ids=lambda v: v if isinstance(v, str) else "")
def test_valid_policies_pass_both(name: str, manifest: dict[str, Any], apiserver: ApiServerSim) -> None:
    ProxyPolicy.model_validate(manifest)
    assert apiserver.validate(manifest) == []


def test_empty_selector_means_every_node() -> None:
    spec = ProxyPolicy.model_validate(_valid_manifests()[0][1]).spec
    assert spec.node_selector.matches({}) and spec.node_selector.matches({"pool": "blue"})


def test_defaults_are_applied_before_the_rules(apiserver: ApiServerSim) -> None:
    # The rollout rules read drain/cordon/maxUnavailable; the API server has defaulted them by then.
    obj = apiserver.default(apiserver.schema, {"spec": {"nodeSelector": {}, "mode": "ipvs", "rollout": {},
                                                        "ipvs": {}}})
    assert obj["spec"]["rollout"] == {"maxUnavailable": 1, "cordon": False, "drain": False, "drainTimeout": "10m",
                                      "holdRules": True, "conntrackCleanup": True,
                                      "paused": False, "preflightAhead": True}
    assert obj["spec"]["ipvs"]["scheduler"] == "rr"


@pytest.mark.parametrize("value", [1, 7, "1%", "9%", "10%", "99%", "100%"])
def test_max_unavailable_accepted_by_both(value: int | str, apiserver: ApiServerSim) -> None:
    manifest = {"spec": {"nodeSelector": {}, "mode": "iptables", "rollout": {"maxUnavailable": value}}}
    ProxyPolicy.model_validate(manifest)
    assert apiserver.validate(manifest) == []


@pytest.mark.parametrize("value", [0, -1, "0%", "00%", "050%", "101%", "1000%", "%", "5", "abc", "1.5%"])
def test_max_unavailable_refused_by_both(value: int | str, apiserver: ApiServerSim) -> None:
    manifest = {"spec": {"nodeSelector": {}, "mode": "iptables", "rollout": {"maxUnavailable": value}}}
    with pytest.raises(ValidationError):
        ProxyPolicy.model_validate(manifest)
    assert apiserver.validate(manifest) != []


def test_null_means_unset_in_both(apiserver: ApiServerSim) -> None:
    # Verified on kube-apiserver 1.37: nulls are pruned, then defaults applied, then rules run.
    manifest = {"spec": {"nodeSelector": {}, "mode": "nftables", "ipvs": None,
                         "rollout": {"stages": None, "maxUnavailable": None}}}
    assert apiserver.validate(manifest) == []
    spec = ProxyPolicy.model_validate(manifest).spec
    assert spec.ipvs is None and spec.rollout.stages is None and spec.rollout.max_unavailable == 1
    required_null: dict[str, Any] = {"spec": {"nodeSelector": {}, "mode": None}}
    assert any("spec.mode: Required value" in e for e in apiserver.validate(required_null))
    with pytest.raises(ValidationError):
        ProxyPolicy.model_validate(required_null)
