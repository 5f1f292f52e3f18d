"""Issue 15 item 1: what the operator's ServiceAccount may write in kube-system, on the real API server.

RBAC lets it create, patch and delete any DaemonSet and ConfigMap there; the admission policy
proxyshift-operator-kube-system (config/admission) narrows that to its revision objects, with the
baseline's pod, and to the baseline's affinity. Each write here is made as the operator's ServiceAccount
(impersonated: admission sees that user) and with --dry-run=server, so admission judges it and nothing
is stored. The positive twins show that what the operator really writes still passes; a migration with
the operator's own token is test_security's test_a_migration_as_the_service_accounts_reads_no_secret.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import sec_checks as sec

from proxyshift.render.revision import render_revision

pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("proxyshift_installed")]

OPERATOR = sec.IDENTITIES["operator"]
POLICY = "confined"
REFUSED = "ValidatingAdmissionPolicy 'proxyshift-operator-kube-system'"


def _as_operator(cluster: Any, *args: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    argv = [*args, f"--as={OPERATOR}", "-n", "kube-system", "--dry-run=server"]
    if body is not None:
        argv += ["-f", "-"]
    result = cluster.kubectl(*argv, check=False, input=json.dumps(body) if body is not None else None)
    return result.returncode, result.stdout + result.stderr


def _live(cluster: Any, kind: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", kind, name, "-n", "kube-system", "-o", "json").stdout
    return json.loads(out)


def _clean(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation", "selfLink"):
        meta.pop(key, None)
    obj.pop("status", None)
    return obj


@pytest.fixture(scope="module")
def rendered(cluster: Any) -> Any:
    """What the operator would write for a policy to nftables over the live baseline."""
    from proxyshift.api.policy import ProxyPolicy

    policy = ProxyPolicy.model_validate({"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy",
                                         "metadata": {"name": POLICY},
                                         "spec": {"nodeSelector": {}, "mode": "nftables"}})
    return render_revision(policy, _live(cluster, "configmap", "kube-proxy"),
                           _live(cluster, "daemonset", "kube-proxy"))


def _refused(result: tuple[int, str], words: str) -> None:
    code, out = result
    assert code != 0 and REFUSED in out and words in out, out
    assert "Forbidden" in out, f"not a 403: {out}"


def _allowed(result: tuple[int, str]) -> None:
    code, out = result
    assert code == 0, out


def test_the_revision_objects_the_operator_renders_are_allowed(cluster: Any, rendered: Any) -> None:
    _allowed(_as_operator(cluster, "create", body=rendered.configmap))
    _allowed(_as_operator(cluster, "create", body=rendered.daemonset))
    # The operator writes them as server-side applies (controller/kube.py): judged the same way.
    for body in (rendered.configmap, rendered.daemonset):
        _allowed(_as_operator(cluster, "apply", "--server-side", "--field-manager=proxyshift", "--force-conflicts",
                              body=body))


def test_objects_that_are_not_its_revisions_are_refused(cluster: Any, rendered: Any) -> None:
    foreign = copy.deepcopy(rendered.configmap)
    foreign["metadata"] = {"name": "coredns-extra", "namespace": "kube-system"}
    _refused(_as_operator(cluster, "create", body=foreign), "only its revision objects")
    # Our labels on a name they do not give: still refused.
    renamed = copy.deepcopy(rendered.configmap)
    renamed["metadata"]["name"] = "kube-proxy-someone-else"
    _refused(_as_operator(cluster, "create", body=renamed), "only its revision objects")
    _refused(_as_operator(cluster, "delete", "configmap", "kube-proxy"), "only its revision objects")
    _refused(_as_operator(cluster, "delete", "daemonset", "kube-proxy"), "only its revision objects")


def test_a_revision_daemonset_must_run_the_baseline_s_pod(cluster: Any, rendered: Any) -> None:
    def changed(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        ds = copy.deepcopy(rendered.daemonset)
        edit(ds["spec"]["template"]["spec"])
        return ds

    def image(pod: dict[str, Any]) -> None:
        pod["containers"][0]["image"] = "registry.example/evil:1"

    def sidecar(pod: dict[str, Any]) -> None:
        pod["containers"].append({"name": "extra", "image": pod["containers"][0]["image"]})

    def account(pod: dict[str, Any]) -> None:
        pod["serviceAccountName"] = "clusterrole-aggregation-controller"

    def host_root(pod: dict[str, Any]) -> None:
        pod["volumes"].append({"name": "root", "hostPath": {"path": "/"}})

    def privileged_init(pod: dict[str, Any]) -> None:
        pod["initContainers"] = [{"name": "x", "image": pod["containers"][0]["image"],
                                  "securityContext": {"privileged": True}}]

    for edit in (image, sidecar, account, privileged_init):
        _refused(_as_operator(cluster, "create", body=changed(edit)), "must run the baseline's containers")
    _refused(_as_operator(cluster, "create", body=changed(host_root)), "only the baseline's volumes")

    # The rest of the pod: what a stolen token would reach for beyond containers and volumes.
    rest_of_pod: dict[str, Callable[[dict[str, Any]], None]] = {
        "priority": lambda pod: pod.update(priorityClassName="system-cluster-critical"),
        "runtime class": lambda pod: pod.update(runtimeClassName="unconfined"),
        "own scheduler": lambda pod: pod.update(schedulerName="my-scheduler"),
        "every taint tolerated": lambda pod: pod.update(tolerations=[*pod.get("tolerations", []),
                                                                     {"operator": "Exists"}]),
        "host aliases": lambda pod: pod.update(hostAliases=[{"ip": "198.18.0.1",
                                                              "hostnames": ["registry.k8s.io"]}]),
        "shared process namespace": lambda pod: pod.update(shareProcessNamespace=True),
    }
    for what, rest_edit in rest_of_pod.items():
        code, out = _as_operator(cluster, "create", body=changed(rest_edit))
        assert code != 0 and REFUSED in out and "Forbidden" in out, (what, out)
        assert "must be the baseline's but for its node selection" in out, (what, out)


def test_on_the_baseline_only_the_affinity_may_change(cluster: Any) -> None:
    baseline = _clean(_live(cluster, "daemonset", "kube-proxy"))
    affinity = {"spec": {"template": {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "proxyshift.io/revision", "operator": "DoesNotExist"}]}]}}}}}}}
    _allowed(_as_operator(cluster, "patch", "daemonset", "kube-proxy", "--type=merge", "-p", json.dumps(affinity)))
    container = baseline["spec"]["template"]["spec"]["containers"][0]["name"]
    evil = {"spec": {"template": {"spec": {"containers": [{"name": container,
                                                           "image": "registry.example/evil:1"}]}}}}
    _refused(_as_operator(cluster, "patch", "daemonset", "kube-proxy", "-p", json.dumps(evil)),
             "only the pod's affinity")
    volume = {"spec": {"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}}
    _refused(_as_operator(cluster, "patch", "daemonset", "kube-proxy", "-p", json.dumps(volume)),
             "only the pod's affinity")
    priority = {"spec": {"template": {"spec": {"priorityClassName": "system-cluster-critical"}}}}
    _refused(_as_operator(cluster, "patch", "daemonset", "kube-proxy", "--type=merge", "-p", json.dumps(priority)),
             "only the pod's affinity")


def test_other_users_are_not_judged_by_it(cluster: Any, rendered: Any) -> None:
    """The admin (and kubeadm, and a person) keep every right they had: the policy matches one user."""
    foreign = copy.deepcopy(rendered.configmap)
    foreign["metadata"] = {"name": "coredns-extra", "namespace": "kube-system"}
    result = cluster.kubectl("create", "-n", "kube-system", "--dry-run=server", "-f", "-", check=False,
                             input=json.dumps(foreign))
    assert result.returncode == 0, result.stderr
