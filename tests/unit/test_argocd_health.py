"""The Argo CD health check of ProxyPolicy, run by Argo CD's own evaluator against real statuses.

The statuses come from the planner's own `build_status` (the code that writes them on a cluster),
so a renamed phase or condition breaks this test rather than Argo CD's view of a rollout.

The script runs in tests/tools/argocd-health-runner, a Go program on gopher-lua v1.1.2 (Lua 5.1)
set up as Argo CD 3.6 sets up an argocd-cm health script (util/lua/lua.go): only the package,
base and table libraries and a safe os, the object as the global `obj`, a one-second deadline,
the returned table read as {status, message}. It also applies the step the controller takes
before any script (gitops-engine/pkg/health/health.go, GetResourceHealth): an object with
metadata.deletionTimestamp is "Progressing: Pending deletion", so the script is never asked about
a policy being deleted, and a Revert that halts on a failed node is invisible in Argo CD.
`make binaries` builds the runner (cached under ~/.cache/proxyshift/tools); without it these
tests fail and say how to build it. Alone:

    make go-tools && .venv/bin/python -m pytest -q tests/unit/test_argocd_health.py

`python tests/unit/test_argocd_health.py --write` regenerates config/argocd/argocd-cm-patch.yaml
from config/argocd/health-proxypolicy.lua.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import gotools
from proxyshift.api.policy import NodeFailure, NodeProgress, ProxyPolicy
from proxyshift.planner.status import Summary, build_status

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LUA_FILE = ROOT / "config" / "argocd" / "health-proxypolicy.lua"
CM_PATCH = ROOT / "config" / "argocd" / "argocd-cm-patch.yaml"
CM_KEY = "resource.customizations.health.proxyshift.io_ProxyPolicy"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
RUNNER = "argocd-health-runner"
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def render_cm_patch(lua: str) -> str:
    """The argocd-cm patch embedding `lua` verbatim as a YAML block scalar."""
    lines = [
        "# Generated from health-proxypolicy.lua by `python tests/unit/test_argocd_health.py --write`:",
        "# edit the .lua file, then regenerate. Apply with",
        "#   kubectl -n argocd patch configmap argocd-cm --patch-file config/argocd/argocd-cm-patch.yaml",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        "  name: argocd-cm",
        "  namespace: argocd",
        "data:",
        f"  {CM_KEY}: |",
    ]
    # Empty lines stay empty: trailing spaces would be harmless to YAML but not to a diff.
    lines += [f"    {line}" if line else "" for line in lua.splitlines()]
    return "\n".join(lines) + "\n"


# ---- one evaluation of the script, by Argo CD's own evaluator ----


class LuaError(AssertionError):
    """The runner reports what Argo CD would record as an evaluation error (health Unknown)."""


@pytest.fixture(scope="module")
def runner() -> Path:
    path = gotools.built(RUNNER)
    if path is None:
        pytest.fail(gotools.build_hint(RUNNER))
    return path


def health(obj: dict[str, Any], runner: Path, tmp_path: Path, script: Path = LUA_FILE, *,
           script_only: bool = False) -> tuple[str, str]:
    """(status, message) as Argo CD shows it; script_only skips Argo CD's deletion short cut."""
    obj_file = tmp_path / "object.json"
    obj_file.write_text(json.dumps(obj))
    argv = [str(runner), *(["-script-only"] if script_only else []), str(script), str(obj_file)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode not in (0, 1):
        pytest.fail(f"{RUNNER} exited {proc.returncode}: {proc.stderr}")
    verdict = json.loads(proc.stdout)
    if proc.returncode == 1:
        raise LuaError(verdict["error"])
    return verdict["status"], verdict["message"]


# ---- ProxyPolicy objects as the API server would return them ----


def policy(generation: int = 3, paused: bool = False) -> ProxyPolicy:
    return ProxyPolicy.model_validate({
        "metadata": {"name": "blue-nftables", "generation": generation},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": "nftables",
                 "rollout": {"paused": paused}},
    })


def summary(**changes: Any) -> Summary:
    base: dict[str, Any] = {"generation": 3, "revision": "blue-nftables-5d8f", "mode": "nftables",
                            "deleting": False, "paused": False, "selected": 5}
    return Summary(**(base | changes))


def in_flight(name: str = "node-4") -> NodeProgress:
    return NodeProgress(name=name, phase="Gate", since="2026-11-30T11:59:00Z", revision="blue-nftables-5d8f",
                        message="2 of 3 rule syncs done")


def failure(name: str = "node-4", phase: str = "RolledBack") -> NodeFailure:
    return NodeFailure(name=name, phase=phase, reason="GateTimeout", message="not proven within 2m",
                       at="2026-11-30T11:58:00Z")


def live(p: ProxyPolicy, s: Summary | None) -> dict[str, Any]:
    """The object Argo CD reads: camelCase JSON; `s` None means the operator never wrote status."""
    obj = p.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    if s is not None:
        obj["status"] = build_status(p, s, NOW).model_dump(by_alias=True, exclude_none=True, mode="json")
    return obj


CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (object, expected status, a piece of the expected message)
    "no status yet": (live(policy(), None), "Progressing", "operator to report status"),
    # kopf may write its own bookkeeping into the status before the planner's first status.
    "only kopf's bookkeeping": (live(policy(), None) | {"status": {"kopf": {"progress": {}}}}, "Progressing",
                                "operator to report status"),
    "revision being created": (live(policy(), summary(revision_missing=True)), "Progressing", "0 in flight"),
    "rolling": (live(policy(), summary(updated=2, pending=2, in_flight=[in_flight()])), "Progressing",
                "1 in flight, 2 pending"),
    "rolled out": (live(policy(), summary(updated=5)), "Healthy", "all 5 selected nodes run nftables"),
    "empty pool": (live(policy(), summary(selected=0)), "Healthy", "no node to migrate: it matches no node"),
    "halted after a rollback": (
        live(policy(), summary(updated=2, pending=2, failures=[failure()], halting=[failure()])),
        "Degraded", "rollout halted: node-4 failed"),
    "rolling back": (live(policy(), summary(updated=2, pending=2, in_flight=[in_flight()], rolling_back=1)),
                     "Degraded", "rolling back"),
    "failed, then retried": (live(policy(), summary(updated=2, pending=2, failures=[failure()],
                                                    in_flight=[in_flight()])), "Progressing", "1 in flight"),
    "paused": (live(policy(paused=True), summary(updated=2, pending=3, paused=True)), "Suspended",
               "2/5 nodes updated"),
    "paused with a node in flight": (
        live(policy(paused=True), summary(updated=2, pending=2, paused=True, in_flight=[in_flight()])),
        "Suspended", "paused"),
    "paused after completion": (live(policy(paused=True), summary(updated=5, paused=True)), "Suspended",
                                "5/5"),
    "all nodes owned by an older policy": (
        live(policy(), summary(selected=0, conflicting=["node-1", "node-2"],
                               conflict_owners={"node-1": "old", "node-2": "old"})),
        "Degraded", "belong to older policies (old)"),
    "some nodes owned by an older policy": (
        live(policy(), summary(selected=3, updated=3, conflicting=["node-1"], conflict_owners={"node-1": "old"})),
        "Healthy", "all 3 selected nodes"),
    "deleting": (live(policy(), summary(deleting=True, updated=0, in_flight=[in_flight()])), "Progressing",
                 "1 in flight"),
}


def _stale(obj: dict[str, Any], generation: int) -> dict[str, Any]:
    return obj | {"metadata": obj["metadata"] | {"generation": generation}}


# The status below describes generation 3; the user has since applied generation 4.
CASES["Ready of an older generation"] = (_stale(CASES["rolled out"][0], 4), "Progressing",
                                         "observe generation 4 (status describes generation 3)")
CASES["Degraded of an older generation (the fix is applied)"] = (
    _stale(CASES["halted after a rollback"][0], 4), "Progressing", "observe generation 4")
CASES["unpaused, not yet observed"] = (_stale(CASES["paused"][0], 4) | {"spec": CASES["rolled out"][0]["spec"]},
                                       "Progressing", "observe generation 4")


# ---- a policy being deleted: Argo CD answers before the script runs ----


def deleting(s: Summary, finalizers: tuple[str, ...] = ("proxyshift.io/finalizer",)) -> dict[str, Any]:
    """A policy after `kubectl delete`: the API server set deletionTimestamp, kopf's finalizer holds it."""
    obj = live(policy(), s)
    obj["metadata"] |= {"deletionTimestamp": "2026-11-30T11:59:30Z", "finalizers": list(finalizers)}
    return obj


# name: (object, what the script alone says, a piece of its message)
DELETION_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "Revert walking nodes back": (deleting(summary(deleting=True, updated=3, pending=1, in_flight=[in_flight()])),
                                  "Progressing", "1 in flight"),
    "Revert halted on a failed node": (
        deleting(summary(deleting=True, updated=3, pending=1, failures=[failure()], halting=[failure()])),
        "Degraded", "rollout halted: node-4 failed"),
    "Revert rolling a node back": (
        deleting(summary(deleting=True, updated=3, pending=1, in_flight=[in_flight()], rolling_back=1)),
        "Degraded", "rolling back"),
    "Orphan or nothing left to revert": (deleting(summary(deleting=True, updated=0, selected=0)), "Progressing",
                                         "0 in flight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_health_of_each_phase(case: str, runner: Path, tmp_path: Path) -> None:
    obj, expected, fragment = CASES[case]
    # Argo CD's whole view, deletion short cut included: none of these objects is being deleted.
    assert "deletionTimestamp" not in obj["metadata"]
    status, message = health(obj, runner, tmp_path)
    assert status in ARGO_STATUSES
    assert (status, fragment in message) == (expected, True), f"{case}: {status}: {message}"


@pytest.mark.parametrize("case", sorted(DELETION_CASES))
def test_deleting_policy_is_pending_deletion_whatever_the_script_says(case: str, runner: Path,
                                                                      tmp_path: Path) -> None:
    # gitops-engine's GetResourceHealth returns Progressing "Pending deletion" for any object with a
    # deletionTimestamp (and without Argo CD's hook finalizer) before it looks for a health script.
    # So a Revert that halts on a failed node, which the script would call Degraded, shows in Argo CD
    # as Progressing until someone looks at the policy (docs/migration-guide.md, section 7).
    obj, script_says, fragment = DELETION_CASES[case]
    status, message = health(obj, runner, tmp_path, script_only=True)
    assert (status, fragment in message) == (script_says, True), f"{case}: {status}: {message}"
    assert health(obj, runner, tmp_path) == ("Progressing", "Pending deletion")


def test_halted_revert_is_degraded_only_to_the_script(runner: Path, tmp_path: Path) -> None:
    # The point of the deletion cases, said once: what the script knows, Argo CD never shows.
    obj = DELETION_CASES["Revert halted on a failed node"][0]
    assert obj["status"]["phase"] == "Deleting"
    assert health(obj, runner, tmp_path, script_only=True)[0] == "Degraded"
    assert health(obj, runner, tmp_path)[0] == "Progressing"


def test_hook_finalizer_lets_the_script_judge_a_deleted_object(runner: Path, tmp_path: Path) -> None:
    # The one exception Argo CD makes (its own hook finalizer): the runner must mirror it, or the
    # Pending-deletion answer above could come from the runner rather than from Argo CD's rule.
    obj = deleting(summary(deleting=True, updated=3, pending=1, failures=[failure()], halting=[failure()]),
                   finalizers=("proxyshift.io/finalizer", "argocd.argoproj.io/hook-finalizer"))
    assert health(obj, runner, tmp_path)[0] == "Degraded"


def test_sample_statuses_are_the_planners() -> None:
    # The samples would prove nothing if the phases were not the ones the operator writes.
    phases = {name: obj.get("status", {}).get("phase") for name, (obj, _, _) in CASES.items()}
    assert {"Pending", "Progressing", "Ready", "Degraded", "Paused", "Conflict", "Deleting"} <= set(phases.values())
    assert {obj["status"]["phase"] for obj, _, _ in DELETION_CASES.values()} == {"Deleting"}


def test_status_without_generation_still_judged(runner: Path, tmp_path: Path) -> None:
    # An object read without metadata.generation (e.g. a hand-made manifest in a test) is judged on
    # its conditions rather than left Progressing for ever.
    obj = CASES["rolled out"][0]
    obj = obj | {"metadata": {"name": obj["metadata"]["name"]}}
    assert health(obj, runner, tmp_path)[0] == "Healthy"


@pytest.mark.parametrize("use", ['string.format("%d", 1)', "math.floor(1.5)", '("x"):upper()', "os.time()",
                                 'io.write("x")'])
def test_runner_is_as_bare_as_argo_cd(use: str, runner: Path, tmp_path: Path) -> None:
    # Each works in a stock interpreter but not in an argocd-cm script (no useOpenLibs): the runner
    # must refuse it too, or the tests above would prove less than they claim.
    script = tmp_path / "uses-a-library.lua"
    script.write_text(f'return {{status = "Healthy", message = tostring({use})}}\n')
    with pytest.raises(LuaError):
        health(CASES["rolled out"][0], runner, tmp_path, script)


def test_runner_offers_what_argo_cd_offers(runner: Path, tmp_path: Path) -> None:
    # ... and it allows what Argo CD allows: base and table functions, the safe os through require,
    # Lua 5.1, integers in obj as numbers.
    script = tmp_path / "uses-base.lua"
    script.write_text(
        'local os = require("os")\n'
        'local parts = {_VERSION, tostring(obj.metadata.generation + 1), type(os.time()), type(table.time)}\n'
        'return {status = "Healthy", message = table.concat(parts, ",")}\n')
    assert health(CASES["rolled out"][0], runner, tmp_path, script) == ("Healthy", "Lua 5.1,4,number,nil")


def test_invalid_status_is_unknown(runner: Path, tmp_path: Path) -> None:
    script = tmp_path / "bad-status.lua"
    script.write_text('return {status = "Fine"}\n')
    assert health(CASES["rolled out"][0], runner, tmp_path, script) == (
        "Unknown", "Lua returned an invalid health status")


def test_cm_patch_embeds_the_script_exactly() -> None:
    lua = LUA_FILE.read_text()
    doc = yaml.safe_load(CM_PATCH.read_text())
    assert (doc["kind"], doc["metadata"]["name"], doc["metadata"]["namespace"]) == ("ConfigMap", "argocd-cm",
                                                                                    "argocd")
    assert doc["data"][CM_KEY] == lua
    assert render_cm_patch(lua) == CM_PATCH.read_text(), \
        "config/argocd/argocd-cm-patch.yaml is stale: run `python tests/unit/test_argocd_health.py --write`"



def test_gitops_layout_blue_before_green() -> None:
    # The staged rollout by Git: blue's policy in an earlier sync wave than green's, both valid specs.
    gitops = ROOT / "config" / "argocd" / "gitops"
    listed = yaml.safe_load((gitops / "kustomization.yaml").read_text())["resources"]
    waves = {}
    for name in listed:
        doc = yaml.safe_load((gitops / name).read_text())
        p = ProxyPolicy.model_validate(doc)
        assert p.spec.node_selector.match_labels is not None
        pool = p.spec.node_selector.match_labels["pool"]
        waves[pool] = int(doc["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"])
    assert waves == {"blue": 0, "green": 1}
    apps = {d["metadata"]["name"]: d for d in yaml.safe_load_all((ROOT / "config/argocd/application.yaml").read_text())}
    assert apps["proxyshift-pools"]["spec"]["source"]["path"] == "config/argocd/gitops"
    assert apps["proxyshift"]["spec"]["source"]["path"] == "config/default"

if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_argocd_health.py --write")
    CM_PATCH.write_text(render_cm_patch(LUA_FILE.read_text()))
    print(f"wrote {CM_PATCH.relative_to(ROOT)}")
