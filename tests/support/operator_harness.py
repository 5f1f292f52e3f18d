"""A small driver for the operator tests: apply policies, read status, look inside nodes.

Shared by tests/e2e and tests/reliability: each conftest imports the fixtures at the bottom
(`proxyshift_installed`, `operator_process`, `harness`), so both layers drive one operator the same way.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack, cast

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from localcluster import install
from localcluster.install import OperatorProcess

GROUP, VERSION = "proxyshift.io", "v1alpha1"
REVISION_LABEL = "proxyshift.io/revision"
# A policy's deletion (with Revert: every node back to the baseline) takes seconds here; five minutes is a
# deletion that will not finish.
CLEANUP_TIMEOUT = 300.0
OPERATOR_LOG_LINES = 80

# kube-proxy's iptables-mode chains (proxyshift.modes.iptables, docs/agent.md "Flush"); none may stay on a
# node that left iptables.
IPTABLES_MODE_CHAINS = ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                        "KUBE-PROXY-CANARY", "KUBE-FORWARD", "KUBE-EXTERNAL-SERVICES", "KUBE-PROXY-FIREWALL")


def policy(name: str, mode: str, *, pool: str | None = "blue", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ProxyPolicy",
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"matchLabels": {"pool": pool}} if pool else {}, "mode": mode,
                 "gate": {"timeout": "90s", "minSyncs": 1}, **spec},
    }
    return body


@dataclass
class Harness:
    api_client: client.ApiClient
    operator: OperatorProcess
    node_exec: Callable[..., Any]
    node_http_get: Callable[..., tuple[int, str]]
    wait_for: Callable[..., Any]
    created: list[str] = field(default_factory=list)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    # ---- policies ----

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name not in self.created:
            self.created.append(name)
        try:
            # The custom-objects API returns the object as JSON: a dict.
            return cast(dict[str, Any], self.custom.create_cluster_custom_object(
                GROUP, VERSION, "proxypolicies", copy.deepcopy(body)))
        except ApiException as exc:
            if exc.status != 409:
                raise
        return self.patch(name, {"spec": body["spec"]})

    def patch(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], self.custom.patch_cluster_custom_object(
            GROUP, VERSION, "proxypolicies", name, body))

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.custom.get_cluster_custom_object(GROUP, VERSION, "proxypolicies", name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, name: str, *, wait: float = 0) -> None:
        try:
            self.custom.delete_cluster_custom_object(GROUP, VERSION, "proxypolicies", name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        if wait:
            self.wait_for(lambda: self.get(name) is None, wait, f"ProxyPolicy {name} to be gone")

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        body = self.get(name) or {}
        for cond in (body.get("status") or {}).get("conditions") or []:
            if cond.get("type") == type_:
                return cond
        return None

    def wait_condition(self, name: str, type_: str, timeout: float, status: str = "True") -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            # One read: a condition from one GET and the generations from another could pair the last
            # generation's condition with the new observedGeneration.
            body = self.get(name) or {}
            cond = next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == type_),
                        None)
            fresh = (body.get("status") or {}).get("observedGeneration") == body.get("metadata", {}).get("generation")
            return cond if cond and cond.get("status") == status and fresh else None

        try:
            return self.wait_for(check, timeout, f"{name} condition {type_}={status}", interval=1.0)
        except BaseException:
            print(self.describe(name))
            raise

    def describe(self, name: str) -> str:
        body = self.get(name)
        nodes = self.proxynodes()
        return json.dumps({"policy": (body or {}).get("status"),
                           "proxynodes": {n: {"spec": v.get("spec"), "status": {k: v.get("status", {}).get(k)
                                          for k in ("observedMode", "lastOperation", "leftovers")}}
                                          for n, v in nodes.items()}}, indent=1, default=str)[:20000]

    # ---- nodes ----

    def proxynodes(self) -> dict[str, dict[str, Any]]:
        items = cast(dict[str, Any], self.custom.list_cluster_custom_object(GROUP, VERSION, "proxynodes"))["items"]
        return {i["metadata"]["name"]: i for i in items}

    def node_labels(self, node: str) -> dict[str, str]:
        metadata = self.core.read_node(node).metadata
        assert metadata is not None
        return dict(metadata.labels or {})

    def unschedulable(self, node: str) -> bool:
        spec = self.core.read_node(node).spec
        return bool(spec is not None and spec.unschedulable)

    def proxy_mode(self, node: str) -> str:
        # kube-proxy may be restarting for a legitimate reason (the baseline DaemonSet rolls once when
        # proxyshift adds or removes its affinity): give it a few seconds to answer.
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = self.node_http_get(node, "http://127.0.0.1:10249/proxyMode")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert status == 200, f"/proxyMode on {node} answered {status}"
        return body.strip()

    def iptables_chains(self, node: str) -> set[str]:
        chains: set[str] = set()
        for tool in ("iptables-save", "ip6tables-save"):
            out = self.node_exec(node, [tool]).stdout
            chains |= {line[1:].split()[0] for line in out.splitlines() if line.startswith(":")}
        return chains

    def nft_tables(self, node: str) -> set[str]:
        out = self.node_exec(node, ["nft", "-j", "list", "tables"]).stdout
        return {f"{t['table']['family']} {t['table']['name']}" for t in json.loads(out)["nftables"]
                if "table" in t}

    def kube_proxy_running(self, node: str) -> bool:
        pods = self.core.list_namespaced_pod("kube-system", label_selector="k8s-app=kube-proxy",
                                             field_selector=f"spec.nodeName={node}").items
        return any(p.status is not None and p.status.phase == "Running"
                   and not (p.metadata is not None and p.metadata.deletion_timestamp) for p in pods)

    def migration_windows(self, nodes: list[str]) -> list[tuple[str, float, float]]:
        """(node, start, end) of each node's last migration, from the ProxyNode records: from its first change
        (touchedAt, its cordon or switch; the preflight before it may overlap another node's migration) to its
        end."""
        windows = []
        for name, pn in self.proxynodes().items():
            if name not in nodes:
                continue
            m = (pn.get("spec") or {}).get("migration") or {}
            start = m.get("touchedAt") or m.get("startedAt")
            if start and m.get("finishedAt"):
                windows.append((name, timestamp(start), timestamp(m["finishedAt"])))
        return sorted(windows, key=lambda w: w[1])

    def cleanup(self) -> None:
        """Delete the test's policies and wait until they are gone. A deletion still pending after
        CLEANUP_TIMEOUT is a failure with the evidence (the policy, its nodes, the operator's log): a policy
        the operator cannot finish deleting is a bug, and it would carry into the next test."""
        for name in reversed(self.created):
            self.delete(name)
        deadline = time.monotonic() + CLEANUP_TIMEOUT
        while time.monotonic() < deadline and any(self.get(n) for n in self.created):
            time.sleep(1)
        stuck = [n for n in self.created if self.get(n)]
        self.created.clear()
        if stuck:
            log = self.operator.log_path
            tail = log.read_text(errors="replace").splitlines()[-OPERATOR_LOG_LINES:] if log.exists() else []
            pytest.fail(f"ProxyPolicy {stuck} still not deleted {CLEANUP_TIMEOUT:g}s after the delete:\n"
                        + "\n".join(self.describe(n) for n in stuck)
                        + f"\nthe operator's log ({log}), last {len(tail)} lines:\n" + "\n".join(tail))


def timestamp(text: str) -> float:
    """An RFC 3339 time from a ProxyNode record as epoch seconds."""
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def load_yaml(path: str) -> dict[str, Any]:
    with open(path) as fh:
        return yaml.safe_load(fh)


def fail_with(h: Harness, name: str, message: str) -> None:
    pytest.fail(f"{message}\n{h.describe(name)}")


def migration(pn: dict[str, Any]) -> dict[str, Any]:
    """A ProxyNode's migration record (spec.migration), {} when it has none."""
    return (pn.get("spec") or {}).get("migration") or {}


# ---- fixtures (imported by the e2e and reliability conftests) ----


@pytest.fixture(scope="session")
def proxyshift_installed(cluster: Any, kubeconfig: Path) -> Path:
    """CRDs, RBAC, admission policies and agents applied; agents ready on every node."""
    # On an external cluster (bin_dir None) the kubectl on PATH applies the same manifests; the agent
    # image must already be loadable there (docs/kind.md).
    install.install(cluster.bin_dir, kubeconfig)
    return kubeconfig


SERVICE_ACCOUNT_NAMESPACE = "proxyshift-system"


def service_account_kubeconfig(cluster: Any, account: str, path: Path, *, pod: str | None = None) -> Path:
    """A kubeconfig holding nothing but a fresh token of `proxyshift-system/<account>` (bound to a pod when
    given: then the token carries the pod's node name, as an agent's does)."""
    from localcluster import controlplane

    info = controlplane.load_info(cluster.state_dir)
    assert info is not None, "no local cluster info"
    args = ["-n", SERVICE_ACCOUNT_NAMESPACE, "create", "token", account, "--duration=6h"]
    if pod:
        args += ["--bound-object-kind=Pod", f"--bound-object-name={pod}"]
    token = cluster.kubectl(*args).stdout.strip()
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": account,
        "clusters": [{"name": "local", "cluster": {"server": info.api_url,
                                                   "certificate-authority": str(info.ca_cert)}}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": "local", "user": account}}],
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    path.chmod(0o600)
    return path


# Module scope: the operator stops at the end of each module, so the session's last test (`down`
# leaves nothing behind) sees no process of ours. It logs in as it does in production: its own
# ServiceAccount's token, with the RBAC and admission policies config/default installs (issue 15), so
# a permission missing on a rare path (rollback, blocked eviction, node delete) fails a test.
@pytest.fixture(scope="module")
def operator_process(cluster: Any, proxyshift_installed: Path) -> Iterator[OperatorProcess]:
    with operator_as_service_account(cluster, proxyshift_installed, "operator-e2e") as op:
        yield op


class OperatorPorts(TypedDict, total=False):
    """The ports an operator_as_service_account caller may choose (OperatorProcess's defaults otherwise)."""

    metrics_port: int
    health_port: int


@contextlib.contextmanager
def operator_as_service_account(cluster: Any, admin_kubeconfig: Path, name: str,
                                **ports: Unpack[OperatorPorts]) -> Iterator[OperatorProcess]:
    """The operator as a host process, logged in with a fresh token of its ServiceAccount (on a local
    cluster; elsewhere with `admin_kubeconfig`), healthy; stopped at the end. Its log is logs/<name>.log."""
    state_dir = cluster.state_dir or Path("/tmp")
    # Outside the cluster's state folder: `down` removes only what it recorded there.
    with tempfile.TemporaryDirectory(prefix="ps-operator-token-") as work:
        kubeconfig = admin_kubeconfig
        if cluster.state_dir is not None:
            kubeconfig = service_account_kubeconfig(cluster, "proxyshift-operator",
                                                    Path(work) / f"{name}.kubeconfig")
        op = OperatorProcess(kubeconfig, state_dir / "logs" / f"{name}.log", **ports).start()
        try:
            op.wait_healthy()
            yield op
        finally:
            op.stop()


@pytest.fixture
def harness(api_client: Any, operator_process: OperatorProcess, node_exec: Callable[..., Any],
            node_http_get: Callable[..., tuple[int, str]], wait_for: Callable[..., Any]) -> Iterator[Harness]:
    h = Harness(api_client, operator_process, node_exec, node_http_get, wait_for)
    if not operator_process.running:
        operator_process.start()
    yield h
    if not operator_process.running:
        operator_process.start()
    h.cleanup()
