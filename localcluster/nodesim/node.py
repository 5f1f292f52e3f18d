"""The simulated kubelet's Node object and its Lease: registration, status, heartbeat renewals."""

from __future__ import annotations

import platform
from typing import Any

from localcluster.kubeapi import Kube, KubeError, now_micro, now_rfc3339

READY_FILE = "simulator.ready"
KUBELET_PORT = 10250
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 60.0
NODE_CONDITION_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_status(ip: str, name: str, kubelet_version: str) -> dict[str, Any]:
    stamp = now_rfc3339()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {"type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}

    resources = {"cpu": "4", "memory": "8Gi", "pods": "110", "ephemeral-storage": "20Gi"}
    return {
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "simulated"),
            condition("Ready", "True", "KubeletReady", "proxyshift node simulator is posting ready status"),
        ],
        # No Hostname address: the apiserver prefers it for kubelet connections (kubectl logs)
        # and ps-node-<i> resolves nowhere; InternalIP is then used.
        "addresses": [{"type": "InternalIP", "address": ip}],
        "capacity": resources,
        "allocatable": resources,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
        "nodeInfo": {
            "machineID": name, "systemUUID": name, "bootID": name,
            "kernelVersion": platform.release(), "osImage": "proxyshift node simulator",
            "containerRuntimeVersion": "proxyshift-nodesim://0.1.0",
            "kubeletVersion": kubelet_version, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64",
        },
    }


def node_manifest(name: str, ip: str, pool: str, kubelet_version: str,
                  pod_cidr: str | None = None) -> dict[str, Any]:
    """The Node as the simulator registers it; `pod_cidr` is its spec.podCIDR (immutable once set)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "pool": pool, "proxyshift-test-pool": pool,
            },
            "annotations": {"proxyshift.io/simulated-node": "true"},
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]} if pod_cidr else {},
        "status": node_status(ip, name, kubelet_version),
    }


def ensure_node(kube: Kube, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create the Node or bring its labels and status back to the manifest's."""
    name = manifest["metadata"]["name"]
    try:
        node = kube.post("/api/v1/nodes", manifest)
    except KubeError as exc:
        if exc.status != 409:
            raise
        node = kube.strategic_patch(f"/api/v1/nodes/{name}",
                                    {"metadata": {"labels": manifest["metadata"]["labels"]}})
        pod_cidr = manifest["spec"].get("podCIDR")
        if pod_cidr and not (node.get("spec") or {}).get("podCIDR"):
            # A Node registered before it had one: spec.podCIDR may be set once, from empty.
            node = kube.strategic_patch(f"/api/v1/nodes/{name}", {"spec": {k: manifest["spec"][k]
                                                                          for k in ("podCIDR", "podCIDRs")}})
    kube.strategic_patch(f"/api/v1/nodes/{name}/status", {"status": manifest["status"]})
    # The TaintNodesByCondition admission plugin gives every new Node a not-ready taint that the
    # node-lifecycle controller lifts once the node is Ready. That controller is off here (it
    # would evict simulated nodes), so the simulator lifts it, as it is the one that knows.
    taints = (node.get("spec") or {}).get("taints") or []
    kept = [t for t in taints if t.get("key") not in NODE_CONDITION_TAINTS]
    if kept != taints:
        node = kube.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": kept or None}})
    return node


def renew_lease(kube: Kube, node: str, node_uid: str | None = None) -> None:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{node}"
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_DURATION_SECONDS, "renewTime": now_micro()}
    try:
        kube.merge_patch(path, {"spec": spec})
    except KubeError as exc:
        if exc.status != 404:
            raise
        if node_uid is None:
            node_uid = kube.get(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
        kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                  {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                   "metadata": {"name": node, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                   "spec": spec})
