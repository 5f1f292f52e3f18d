"""charts/proxyshift rendered by the pinned helm, and config/ built as kustomize builds it, side by side.

Shared by tests/unit/test_helm_chart.py (against a strict reading of config/'s kustomizations) and
tests/e2e/test_helm_install.py (against the real `kubectl kustomize` and a real install).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import gotools
from proxyshift.commands import run

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "proxyshift"
NAMESPACE = "proxyshift-system"
HELM_TIMEOUT_SECONDS = 120.0

# Labels every chart object carries beside config/'s own (templates/_helpers.tpl, proxyshift.chartLabels).
CHART_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")
# What config/default has and the chart, by design, does not: Helm keeps the release in its namespace,
# which must exist before `helm install` (docs/install.md: config/rbac/namespace.yaml, or
# --create-namespace without the Pod Security labels), so the chart cannot also own it.
ONLY_IN_KUSTOMIZE = {("v1", "Namespace", None, NAMESPACE)}

Key = tuple[str, str, str | None, str]


def helm() -> Path:
    """The pinned helm (`make go-tools`); a test that needs it fails with the way to build it."""
    binary = gotools.built("helm")
    if binary is None:
        pytest.fail(gotools.build_hint("helm"))
    return binary


def helm_run(*args: str, timeout: float = HELM_TIMEOUT_SECONDS, env: dict[str, str] | None = None) -> str:
    return run([str(helm()), *args], timeout=timeout, env=env).stdout


def helm_env(home: Path) -> dict[str, str]:
    """The environment with helm's cache, config and data under home, not in the caller's own."""
    return {**os.environ, **{f"HELM_{what}_HOME": str(home / what.lower()) for what in ("CACHE", "CONFIG", "DATA")}}


def render(*values: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """`helm template` with the CRDs, `--set` for each of values."""
    argv = ["template", "proxyshift", str(CHART), "--namespace", namespace, "--include-crds"]
    for value in values:
        argv += ["--set", value]
    return [doc for doc in yaml.safe_load_all(helm_run(*argv)) if doc]


# The only kustomization fields config/ uses; anything else (patches, images, namePrefix...) changes
# objects, and this reading would silently miss it, so it refuses instead.
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "components"}


def kustomize_subset(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` builds, for kustomizations that only list resources."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_FIELDS
    if unknown:
        raise AssertionError(f"{folder}/kustomization.yaml uses {sorted(unknown)}: this strict reading "
                             f"handles only {sorted(KUSTOMIZE_FIELDS)}; compare with `kubectl kustomize`")
    objects: list[dict[str, Any]] = []
    for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += kustomize_subset(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def key(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]


def without_chart_labels(obj: dict[str, Any]) -> dict[str, Any]:
    """obj as config/ writes it: the chart's own labels removed (an emptied labels map too)."""
    obj = copy.deepcopy(obj)
    labels = obj["metadata"].get("labels")
    if labels is not None:
        for label in CHART_LABELS:
            labels.pop(label, None)
        if not labels:
            del obj["metadata"]["labels"]
    return obj


def by_key(objects: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    keyed = {key(obj): obj for obj in objects}
    assert len(keyed) == len(objects), "two objects with the same apiVersion, kind, namespace and name"
    return keyed


def differences(chart: list[dict[str, Any]], kustomize: list[dict[str, Any]]) -> list[str]:
    """Every difference between the two sets of objects except the stated ones, as readable lines."""
    rendered = by_key([without_chart_labels(obj) for obj in chart])
    built = {k: v for k, v in by_key(kustomize).items() if k not in ONLY_IN_KUSTOMIZE}
    found = [f"only in the chart: {k}" for k in sorted(rendered.keys() - built.keys(), key=str)]
    found += [f"only in kustomize: {k}" for k in sorted(built.keys() - rendered.keys(), key=str)]
    for k in sorted(rendered.keys() & built.keys(), key=str):
        found += [f"{k} {line}" for line in field_differences(rendered[k], built[k])]
    return found


def field_differences(chart: Any, kustomize: Any, path: str = "") -> list[str]:
    """Each field where the two differ, by its path (a whole object printed would hide the one field)."""
    if isinstance(chart, dict) and isinstance(kustomize, dict):
        return [line for name in sorted(chart.keys() | kustomize.keys())
                for line in field_differences(chart.get(name, "<absent>"), kustomize.get(name, "<absent>"),
                                              f"{path}.{name}")]
    if isinstance(chart, list) and isinstance(kustomize, list) and len(chart) == len(kustomize):
        return [line for i, (a, b) in enumerate(zip(chart, kustomize, strict=True))
                for line in field_differences(a, b, f"{path}[{i}]")]
    return [] if chart == kustomize else [f"{path or '.'}: chart {chart!r}, kustomize {kustomize!r}"]
