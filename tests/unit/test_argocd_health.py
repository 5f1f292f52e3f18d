"""The Argo CD health check of ProxyPolicy, run by a real Lua interpreter against real statuses.

The statuses come from the planner's own `build_status` (the code that writes them on a cluster),
so a renamed phase or condition breaks this test rather than Argo CD's view of a rollout. Argo CD
evaluates health scripts with gopher-lua (Lua 5.1); we run every Lua interpreter found here
(Debian's lua5.4 from hack/install-deps.sh, and lua5.1 / luajit if present) so the script stays
inside what both dialects share, with the standard libraries Argo CD withholds from argocd-cm
scripts taken away.

Cross-checked once by hand (not here: it needs Go) with gopher-lua v1.1.1 opened as Argo CD opens
it for argocd-cm scripts (package, base, table only): every case below gave the same status.

`python tests/unit/test_argocd_health.py --write` regenerates config/argocd/argocd-cm-patch.yaml
from config/argocd/health-proxypolicy.lua.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxyshift.api.policy import NodeFailure, NodeProgress, ProxyPolicy
from proxyshift.planner.status import Summary, build_status

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LUA_FILE = ROOT / "config" / "argocd" / "health-proxypolicy.lua"
CM_PATCH = ROOT / "config" / "argocd" / "argocd-cm-patch.yaml"
CM_KEY = "resource.customizations.health.proxyshift.io_ProxyPolicy"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
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


# ---- a Lua value from a Python one, and one evaluation of the script ----


class LuaError(AssertionError):
    pass


def lua_string(text: str) -> str:
    # Decimal byte escapes are valid in Lua 5.1 through 5.4, so any text survives unchanged.
    out = []
    for byte in text.encode():
        char = chr(byte)
        out.append(char if 32 <= byte < 127 and char not in '"\\' else f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


def to_lua(value: Any) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return lua_string(value)
    if isinstance(value, list):
        return "{" + ", ".join(to_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_string(k)}] = {to_lua(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Lua form for {value!r}")


def interpreters() -> list[str]:
    return [path for name in ("lua5.4", "lua5.1", "luajit") if (path := shutil.which(name))]


def health(obj: dict[str, Any], interpreter: str, tmp_path: Path, script: Path = LUA_FILE) -> tuple[str, str]:
    """(status, message) as Argo CD would see it: `obj` a global, the script a chunk returning hs."""
    harness = tmp_path / "harness.lua"
    harness.write_text(
        f"local chunk = assert(loadfile({lua_string(str(script))}))\n"
        "local write = io.write\n"
        f"obj = {to_lua(obj)}\n"
        # argocd-cm scripts run without the standard libraries except base, package, table and a
        # safe os (argo-cd util/lua/lua.go): no string, math or io. Take away what we can.
        "string, math, io, utf8, coroutine, debug = nil, nil, nil, nil, nil, nil\n"
        "local hs = chunk()\n"
        'write(tostring(hs.status), "\\n", tostring(hs.message))\n'
    )
    proc = subprocess.run([interpreter, str(harness)], capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        raise LuaError(f"{interpreter} failed: {proc.stderr}")
    status, _, message = proc.stdout.partition("\n")
    return status, message


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


@pytest.fixture(scope="module", params=interpreters() or [None])
def interpreter(request: pytest.FixtureRequest) -> str:
    if request.param is None:
        pytest.fail("no Lua interpreter: `apt-get install -y lua5.4` (hack/install-deps.sh does it)")
    return request.param


@pytest.mark.parametrize("case", sorted(CASES))
def test_health_of_each_phase(case: str, interpreter: str, tmp_path: Path) -> None:
    obj, expected, fragment = CASES[case]
    status, message = health(obj, interpreter, tmp_path)
    assert status in ARGO_STATUSES
    assert (status, fragment in message) == (expected, True), f"{case}: {status}: {message}"


def test_sample_statuses_are_the_planners() -> None:
    # The samples would prove nothing if the phases were not the ones the operator writes.
    phases = {name: obj.get("status", {}).get("phase") for name, (obj, _, _) in CASES.items()}
    assert {"Pending", "Progressing", "Ready", "Degraded", "Paused", "Conflict", "Deleting"} <= set(phases.values())


def test_status_without_generation_still_judged(interpreter: str, tmp_path: Path) -> None:
    # An object read without metadata.generation (e.g. a hand-made manifest in a test) is judged on
    # its conditions rather than left Progressing for ever.
    obj = CASES["rolled out"][0]
    obj = obj | {"metadata": {"name": obj["metadata"]["name"]}}
    assert health(obj, interpreter, tmp_path)[0] == "Healthy"


def test_harness_is_as_bare_as_argo_cd(interpreter: str, tmp_path: Path) -> None:
    # A script calling the string library works in a stock interpreter but not in Argo CD: the
    # harness must refuse it too, or the tests above would prove less than they claim.
    script = tmp_path / "uses-string.lua"
    script.write_text('return {status = "Healthy", message = string.format("%d", 1)}\n')
    with pytest.raises(LuaError, match="string"):
        health(CASES["rolled out"][0], interpreter, tmp_path, script)

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
