"""Bad input on the local cluster (issue 8, item 2): refused where it can be, harmless where it cannot.

- every bad ProxyPolicy of the core table (tests/fixtures/bad-policies as tests/support/bad_policies.py reads
  them, the same files the unit table and tests/e2e/test_bad_policies_apiserver.py read), applied for real
  with `kubectl apply` while the operator runs: refused with its message, nothing stored, nothing done. The
  e2e test proves each refusal with a server-side dry run through the client library; this one is the user's
  path (kubectl, strict field validation by default, a real write attempt) and adds "the operator did nothing";
- a policy selecting no node, and one matching only a control-plane node: Ready/NoNodesSelected with the
  reason in the message, no node touched;
- a policy edited every second during a rollout: one revision per distinct spec, nodes do not chase edits,
  the rollout ends on the last spec;
- a ProxyNode status forged with an agent's token for another node (and the other ways to forge one):
  refused by the admission policies, the object unchanged.

Hostile kube-proxy metrics are judged by pure code: tests/unit/test_gate_hostile_metrics.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from input_harness import (  # noqa: F401 - the *_fixture names are fixtures, used by their names
    agent_pod,
    operator_process_fixture,
    scratch_dir,
)

from tests.support.bad_policies import CASES  # the one table, read from its files
from tests.support.operator_harness import GROUP, VERSION, policy, service_account_kubeconfig

pytestmark = pytest.mark.reliability

CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
BLUE = ("ps-node-1", "ps-node-2")


def _revision_objects(cluster: Any, policy: str | None = None) -> set[str]:
    """proxyshift's DaemonSets and ConfigMaps in kube-system: every policy's, or only `policy`'s."""
    selector = "proxyshift.io/managed-by" + (f",proxyshift.io/policy={policy}" if policy else "")
    out = cluster.kubectl("-n", "kube-system", "get", "daemonsets,configmaps", "-l", selector,
                          "-o", "name").stdout
    return set(out.split())


def _node_facts(cluster: Any) -> dict[str, tuple[str | None, bool]]:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return {n["metadata"]["name"]: ((n["metadata"].get("labels") or {}).get("proxyshift.io/revision"),
                                    bool(n["spec"].get("unschedulable"))) for n in nodes}


# ================================================================ the core table, through kubectl apply


@pytest.fixture(scope="module")
def before_bad_policies(cluster: Any, operator_process: Any) -> dict[str, Any]:
    """What exists before the bad manifests are applied (the operator runs throughout)."""
    return {"revisions": _revision_objects(cluster), "nodes": _node_facts(cluster)}


@pytest.mark.parametrize(("name", "meta", "manifest"), CASES, ids=[c[0] for c in CASES])
def test_kubectl_apply_of_a_bad_policy_is_refused_with_its_message(cluster: Any, before_bad_policies: Any,
                                                                   name: str, meta: dict[str, str],
                                                                   manifest: dict[str, Any]) -> None:
    body = {**manifest, "metadata": {**manifest.get("metadata", {}), "name": f"bad-{name}"}}
    path = scratch_dir() / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    result = cluster.kubectl("apply", "-f", str(path), check=False)
    assert result.returncode != 0, f"{name}: kubectl apply accepted it: {result.stdout}"
    assert meta["apiserver"] in result.stderr and meta["field"] in result.stderr, f"{name}: {result.stderr}"
    stored = cluster.kubectl("get", "proxypolicy", f"bad-{name}", check=False)
    assert stored.returncode != 0 and "NotFound" in stored.stderr, f"{name} was stored: {stored.stdout}"


def test_the_operator_did_nothing_about_the_bad_policies(cluster: Any, before_bad_policies: Any) -> None:
    time.sleep(3)  # a reconcile of a stored object would have happened by now; none was stored
    assert _revision_objects(cluster) == before_bad_policies["revisions"]
    assert _node_facts(cluster) == before_bad_policies["nodes"]


# ================================================================ selections that take no node


def test_a_policy_selecting_no_node_says_so_and_touches_nothing(cluster: Any, harness: Any) -> None:
    before = _node_facts(cluster)
    harness.apply(policy("input-no-node", "nftables", pool="no-such-pool"))
    cond = harness.wait_condition("input-no-node", "Ready", 120)
    assert cond["reason"] == "NoNodesSelected" and "matches no node" in cond["message"], cond
    body = harness.get("input-no-node")
    assert body["status"]["phase"] == "Ready" and body["status"]["nodes"]["selected"] == 0, body["status"]
    progressing = harness.condition("input-no-node", "Progressing")
    assert progressing is not None and progressing["status"] == "False", progressing
    time.sleep(5)  # and it stays that way
    assert _node_facts(cluster) == before
    assert all(pn["spec"].get("policy") != "input-no-node" for pn in harness.proxynodes().values())
    assert all(harness.proxy_mode(n) == "iptables" for n in cluster.nodes)


@pytest.fixture
def control_plane_node(cluster: Any) -> Iterator[str]:
    """ps-node-3 (pool green) labelled as a control-plane node for the test."""
    node = "ps-node-3"
    cluster.kubectl("label", "node", node, f"{CONTROL_PLANE}=", "--overwrite")
    yield node
    cluster.kubectl("label", "node", node, f"{CONTROL_PLANE}-")


def test_a_control_plane_node_is_skipped_unless_the_policy_includes_it(cluster: Any, harness: Any,
                                                                        control_plane_node: str) -> None:
    before = _node_facts(cluster)
    harness.apply(policy("input-cp-skip", "nftables", pool="green"))
    cond = harness.wait_condition("input-cp-skip", "Ready", 120)
    assert cond["reason"] == "NoNodesSelected" and "control-plane" in cond["message"], cond
    skipped = harness.wait_condition("input-cp-skip", "ControlPlaneSkipped", 30)
    assert skipped["reason"] == "ControlPlaneNodesSkipped" and control_plane_node in skipped["message"], skipped
    assert "controlPlaneNodes: Include" in skipped["message"]
    status = harness.get("input-cp-skip")["status"]
    assert (status["nodes"]["selected"], status["nodes"]["skippedControlPlane"]) == (0, 1), status
    time.sleep(5)
    assert _node_facts(cluster)[control_plane_node] == before[control_plane_node]
    assert harness.proxy_mode(control_plane_node) == "iptables"
    harness.delete("input-cp-skip", wait=120)

    # Opting in makes it an ordinary member of the pool (paused here: selection is what is under test).
    harness.apply(policy("input-cp-include", "nftables", pool="green", controlPlaneNodes="Include",
                         rollout={"paused": True}))
    paused = harness.wait_condition("input-cp-include", "Paused", 120)
    assert paused["status"] == "True"
    status = harness.get("input-cp-include")["status"]
    assert (status["nodes"]["selected"], status["nodes"]["skippedControlPlane"]) == (1, 0), status
    assert harness.condition("input-cp-include", "ControlPlaneSkipped")["status"] == "False"


def test_an_unknown_control_plane_option_is_refused(cluster: Any) -> None:
    body = policy("input-cp-bad", "nftables", controlPlaneNodes="Sometimes")
    path = scratch_dir() / "cp-bad.yaml"
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    result = cluster.kubectl("apply", "-f", str(path), check=False)
    assert result.returncode != 0 and 'supported values: "Skip", "Include"' in result.stderr, result.stderr


# ================================================================ edited every second during a rollout


class RevisionRecorder:
    """Polls, every 0.2 s, the policy's revision ConfigMaps (name -> nftables.syncPeriod) and the blue
    nodes' revision labels, recording every value seen and every change."""

    def __init__(self, cluster: Any, policy_name: str) -> None:
        self.cluster, self.policy = cluster, policy_name
        self.spec_of: dict[str, set[str]] = defaultdict(set)  # revision -> syncPeriods seen in its ConfigMap
        self.appeared: Counter[str] = Counter()  # revision -> times it appeared (created, or re-created)
        self.labels: dict[str, list[str | None]] = {n: [] for n in BLUE}
        self._present: set[str] = set()
        self._stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _poll(self) -> None:
        cms = json.loads(self.cluster.kubectl("-n", "kube-system", "get", "configmaps", "-l",
                                              f"proxyshift.io/policy={self.policy}", "-o", "json").stdout)["items"]
        present = set()
        for cm in cms:
            rev = cm["metadata"]["labels"]["proxyshift.io/revision"]
            present.add(rev)
            config = yaml.safe_load(cm["data"]["config.conf"])
            self.spec_of[rev].add(str((config.get("nftables") or {}).get("syncPeriod")))
        for rev in present - self._present:
            self.appeared[rev] += 1
        self._present = present
        facts = _node_facts(self.cluster)
        for node in BLUE:
            label = facts[node][0]
            if not self.labels[node] or self.labels[node][-1] != label:
                self.labels[node].append(label)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception as exc:  # a kubectl hiccup must not end the recording silently
                self.errors.append(repr(exc))
            time.sleep(0.2)

    def __enter__(self) -> RevisionRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(timeout=30)


def test_a_policy_edited_every_second_during_a_rollout(cluster: Any, harness: Any) -> None:
    name = "input-edit-storm"
    # Three distinct specs, cycled once per second for 15 s, ending on the third: every edit changes the
    # rendered kube-proxy config, so every edit is a different revision than the one before it.
    periods = ["31s", "32s", "33s"]
    edits = [periods[i % 3] for i in range(15)]
    body = policy(name, "nftables", nftables={"syncPeriod": periods[0]}, rollout={"cordon": True})
    with RevisionRecorder(cluster, name) as rec:
        harness.apply(body)
        harness.wait_for(lambda: any(rec.labels[n] and rec.labels[n][-1] is not None for n in BLUE), 120,
                         "a first switch")
        generations = []
        for period in edits:
            started = time.monotonic()
            generations.append(harness.patch(name, {"spec": {"nftables": {"syncPeriod": period}}})
                               ["metadata"]["generation"])
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        cond = harness.wait_condition(name, "Ready", 600)
        time.sleep(3)  # let the last DeleteRevision land
    status = harness.get(name)["status"]
    print(f"\nedit storm: revisions seen {dict(rec.spec_of)}; appeared {dict(rec.appeared)}; "
          f"node labels {rec.labels}")
    assert rec.errors == [], rec.errors
    assert len(set(generations)) == len(edits), "every patch was a new generation"
    assert cond["reason"] == "RolloutComplete" and status["observedGeneration"] == generations[-1], status

    # One revision per distinct spec: each revision name carries one spec, each spec has one name.
    assert all(len(specs) == 1 for specs in rec.spec_of.values()), rec.spec_of
    names_of = defaultdict(set)
    for rev, specs in rec.spec_of.items():
        names_of[next(iter(specs))].add(rev)
    assert all(len(names) == 1 for names in names_of.values()), names_of
    assert set(names_of) <= set(periods), names_of
    # ... and each created once: while the spec settles the operator keeps unused revisions rather than
    # deleting and re-creating one per edit.
    assert all(count == 1 for count in rec.appeared.values()), rec.appeared
    final = next(iter(names_of[periods[-1]]))
    assert status["currentRevision"] == final

    # The end state: every blue node on the last spec's revision, uncordoned, kube-proxy running in
    # nftables mode; no failure recorded; only the last revision's objects remain.
    facts = _node_facts(cluster)
    for node in BLUE:
        assert facts[node] == (final, False), (node, facts[node])
        assert harness.proxy_mode(node) == "nftables" and harness.kube_proxy_running(node)
    assert status["failed"] == [] and status["nodes"]["failed"] == 0, status
    # Only this policy's objects: a revision an earlier test's policy has not yet had deleted is not this
    # test's finding (the test that made it checks its own end state).
    final_objects = {f"daemonset.apps/kube-proxy-{final}", f"configmap/kube-proxy-{final}"}
    try:
        harness.wait_for(lambda: _revision_objects(cluster, name) == final_objects, 60,
                         "only the final revision's objects")
    except pytest.fail.Exception:
        pytest.fail(f"{name}'s revision objects after 60 s: {sorted(_revision_objects(cluster, name))} "
                    f"(all of proxyshift's: {sorted(_revision_objects(cluster))}); policy status "
                    f"{harness.get(name).get('status')}")

    # Nodes do not chase edits: once the spec changes, no node starts until it has been unchanged for
    # 10 s (planner.SETTLE_SECONDS); a node already past its switch finishes. So each node switches at most
    # twice: the migration it was in when the storm began, and the final spec. (Before the settle rule one
    # node switched 4 times here, back to a revision it had left.)
    for node, labels in rec.labels.items():
        switches = len(labels) - 1
        assert 1 <= switches <= 2, f"{node} switched {switches} times for {len(edits)} edits: {labels}"


# ================================================================ forged ProxyNode status

OWN_NODE_MESSAGE = "may write only the ProxyNode of its own node"


def _kubectl_as(cluster: Any, kubeconfig: Path, *args: str) -> Any:
    return cluster.kubectl("--kubeconfig", str(kubeconfig), *args, check=False)


def _forged_success(node: str, pn: dict[str, Any]) -> dict[str, Any]:
    """The status a lying agent would write: the operator's pending operation done, target mode observed."""
    op = (pn.get("spec") or {}).get("operation") or {}
    return {"status": {"observedMode": "nftables", "agentVersion": "forged", "leftovers": [],
                       "lastOperation": {"id": op.get("id") or "forged.0", "type": op.get("type") or "Probe",
                                         "state": "Succeeded", "message": f"forged for {node}"}}}


def test_a_proxynode_status_forged_for_another_node_is_refused(cluster: Any, harness: Any) -> None:
    """Beyond tests/e2e/test_install.py (one merge patch of another node's status): a full forged success,
    by merge patch, JSON patch and PUT; creating and deleting ProxyNodes; a token without the node claim;
    the operator's token on status. Every attempt refused, the objects unchanged."""
    harness.wait_for(lambda: set(cluster.nodes) <= set(harness.proxynodes()), 120, "a ProxyNode per node")
    work = scratch_dir()
    own = service_account_kubeconfig(cluster, "proxyshift-agent", work / "agent-1.kubeconfig",
                                     pod=agent_pod(cluster, "ps-node-1"))
    unbound = service_account_kubeconfig(cluster, "proxyshift-agent", work / "agent-unbound.kubeconfig")
    operator = service_account_kubeconfig(cluster, "proxyshift-operator", work / "operator.kubeconfig")
    victim = "ps-node-2"
    before = harness.proxynodes()[victim]
    forged = _forged_success(victim, before)
    put_body = {**before, "status": {**(before.get("status") or {}), **forged["status"]}}
    put_path = work / "put.json"
    put_path.write_text(json.dumps(put_body), encoding="utf-8")
    json_patch = json.dumps([{"op": "replace", "path": "/status/observedMode", "value": "nftables"}])

    attempts = {
        "merge patch of another node's status": (own, ["patch", "proxynode", victim, "--subresource=status",
                                                       "--type=merge", "-p", json.dumps(forged)], OWN_NODE_MESSAGE),
        "JSON patch of another node's status": (own, ["patch", "proxynode", victim, "--subresource=status",
                                                      "--type=json", "-p", json_patch], OWN_NODE_MESSAGE),
        # RBAC refuses it first now: the agent never PUTs, so it has no update verb.
        "PUT of another node's status": (own, ["replace", "--subresource=status", "-f", str(put_path)],
                                         'cannot update resource "proxynodes/status"'),
        "delete of another node's ProxyNode": (own, ["delete", "proxynode", victim, "--wait=false"], "forbidden"),
        "create of a ProxyNode for a made-up node": (own, ["create", "-f", "-"], "forbidden"),
        "status patch with a token bound to no pod": (unbound, ["patch", "proxynode", victim,
                                                                "--subresource=status", "--type=merge", "-p",
                                                                json.dumps(forged)], OWN_NODE_MESSAGE),
        # RBAC already refuses it (the operator has no verb on proxynodes/status); the admission policy
        # proxyshift-operator-spec-only would refuse it next.
        "status patch by the operator": (operator, ["patch", "proxynode", victim, "--subresource=status",
                                                    "--type=merge", "-p", json.dumps(forged)],
                                         'cannot get resource "proxynodes/status"'),
    }
    made_up = work / "fake.json"
    made_up.write_text(json.dumps({"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyNode",
                                   "metadata": {"name": "ps-fake"}, "spec": {}}), encoding="utf-8")
    for what, (kubeconfig, args, words) in attempts.items():
        result = _kubectl_as(cluster, kubeconfig, *[str(made_up) if a == "-" else a for a in args])
        assert result.returncode != 0, f"{what}: accepted: {result.stdout}"
        assert words in result.stderr, f"{what}: {result.stderr}"
    after = harness.proxynodes()
    assert "ps-fake" not in after
    # The victim's status is still its own agent's account (which keeps writing heartbeats meanwhile).
    status = after[victim].get("status") or {}
    assert status.get("agentVersion") != "forged" and status.get("observedMode") == (
        before.get("status") or {}).get("observedMode"), status
    assert "forged" not in ((status.get("lastOperation") or {}).get("message") or ""), status
    # Positive control: the same token may write its own node's status.
    mine = _kubectl_as(cluster, own, "patch", "proxynode", "ps-node-1", "--subresource=status", "--type=merge",
                       "-p", json.dumps({"status": {"agentVersion": (harness.proxynodes()["ps-node-1"].get(
                           "status") or {}).get("agentVersion") or "0.1.0"}}))
    assert mine.returncode == 0, mine.stderr

