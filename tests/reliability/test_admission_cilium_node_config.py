"""Issue 19: what the operator's ServiceAccount may write of Cilium's CiliumNodeConfigs, on the real API server.

A CiliumNodeConfig sets Cilium agent options on the nodes it selects; the admission policy
proxyshift-operator-cilium-node-config (config/admission) narrows the operator to the ones
render/replacement.py renders. Cilium's CRDs are installed from the pinned module (they stay: nothing
else here writes CiliumNodeConfigs), and every write is made as the operator's ServiceAccount
(impersonated) with --dry-run=server, so admission judges it and nothing is stored. The policy's CEL
is compiled by this API server when `proxyshift install` applies it; a rule it cannot type-check
stops every install (it did once: a map literal mixing string and dyn values).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import sec_checks as sec

from localcluster import cilium_install
from proxyshift.render.revision import render_revision

pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("proxyshift_installed")]

OPERATOR = sec.IDENTITIES["operator"]
REFUSED = "ValidatingAdmissionPolicy 'proxyshift-operator-cilium-node-config'"


def _as_operator(cluster: Any, body: dict[str, Any]) -> tuple[int, str]:
    result = cluster.kubectl("create", f"--as={OPERATOR}", "-n", "kube-system", "--dry-run=server", "-f", "-",
                             check=False, input=json.dumps(body))
    return result.returncode, result.stdout + result.stderr


def _live(cluster: Any, kind: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", kind, name, "-n", "kube-system", "-o", "json").stdout)


@pytest.fixture(scope="module")
def node_config(cluster: Any) -> dict[str, Any]:
    """The CiliumNodeConfig the operator renders for a policy to cilium-kpr, with Cilium's CRDs served."""
    files = cilium_install.crd_files()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=proxyshift-tests",
                    *[arg for path in files for arg in ("-f", str(path))])
    cluster.kubectl("wait", "--for=condition=Established", "crd/ciliumnodeconfigs.cilium.io", "--timeout=60s")
    from proxyshift.api.policy import ProxyPolicy

    policy = ProxyPolicy.model_validate({
        "apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "kpr"},
        "spec": {"nodeSelector": {}, "mode": "cilium-kpr",
                 "cilium": {"loadBalancerAlgorithm": "maglev", "hostNamespaceOnly": True}}})
    rendered = render_revision(policy, _live(cluster, "configmap", "kube-proxy"),
                               _live(cluster, "daemonset", "kube-proxy"))
    assert rendered.node_config is not None
    return rendered.node_config


def test_the_node_config_the_operator_renders_is_allowed(cluster: Any, node_config: dict[str, Any]) -> None:
    code, out = _as_operator(cluster, node_config)
    assert code == 0, out


def _changed(node_config: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = copy.deepcopy(node_config)
    edit(obj)
    return obj


@pytest.mark.parametrize(("edit", "words"), [
    (lambda o: o["metadata"].update(name="cilium-everywhere"), "only its own CiliumNodeConfigs"),
    (lambda o: o["metadata"]["labels"].pop("proxyshift.io/managed-by"), "only its own CiliumNodeConfigs"),
    (lambda o: o["spec"]["nodeSelector"].update(matchLabels={}), "selects exactly its revision's Cilium nodes"),
    (lambda o: o["spec"]["nodeSelector"]["matchLabels"].update({"pool": "blue"}),
     "selects exactly its revision's Cilium nodes"),
    (lambda o: o["spec"]["defaults"].update({"enable-policy": "never"}), "sets only kube-proxy-replacement"),
    (lambda o: o["spec"]["defaults"].update({"kube-proxy-replacement": "false"}), "sets only kube-proxy-replacement"),
])
def test_a_node_config_it_does_not_render_is_refused(cluster: Any, node_config: dict[str, Any],
                                                     edit: Callable[[dict[str, Any]], None], words: str) -> None:
    code, out = _as_operator(cluster, _changed(node_config, edit))
    assert code != 0 and REFUSED in out and words in out, out
    assert "Forbidden" in out, f"not a 403: {out}"
