"""The kubeadm-like kube-proxy baseline: ConfigMap, DaemonSet, ServiceAccount and RBAC.

Shaped as `kubeadm init` makes them (kubeadm's addon/proxy manifests), so the
operator meets on the local cluster the same objects it meets on a real one.
Two deliberate differences, both for network namespaces: the conntrack
settings are kind's (zero = "leave the host-wide sysctl alone", which a
namespace cannot set anyway), and the API address is our bridge.

`fixture_documents()` is the same objects as YAML text; tests/fixtures/baseline/
holds them for the render tests, and a unit test checks the files are current
(`python -m localcluster.baseline --write-fixtures` regenerates them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from localcluster import paths
from proxyshift.commands import run

NAMESPACE = "kube-system"
NAME = "kube-proxy"
IMAGE_REPOSITORY = "registry.k8s.io/kube-proxy"
DEFAULT_KUBERNETES_VERSION = "v1.37.2"
CONFIG_MOUNT = "/var/lib/kube-proxy"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
FIXTURE_FILES = {
    "kube-proxy-configmap.yaml": "configmap",
    "kube-proxy-daemonset.yaml": "daemonset",
}


def kube_proxy_configuration(mode: str = "iptables") -> dict[str, Any]:
    """config.conf: a KubeProxyConfiguration with kubeadm's fields and kind's conntrack values."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "bindAddress": "0.0.0.0",
        "bindAddressHardFail": False,
        "clientConnection": {
            "acceptContentTypes": "",
            "burst": 0,
            "contentType": "",
            "kubeconfig": f"{CONFIG_MOUNT}/kubeconfig.conf",
            "qps": 0,
        },
        "clusterCIDR": paths.KUBE_PROXY_CLUSTER_CIDR,
        "configSyncPeriod": "0s",
        # 0 / 0s mean "do not touch": nf_conntrack_max and the TCP timeouts are
        # host-wide (or read-only) inside a network namespace, so kube-proxy must
        # not try to write them (kind ships the same values for the same reason).
        "conntrack": {
            "maxPerCore": 0,
            "min": None,
            "tcpBeLiberal": False,
            "tcpCloseWaitTimeout": "0s",
            "tcpEstablishedTimeout": "0s",
            "udpStreamTimeout": "0s",
            "udpTimeout": "0s",
        },
        "detectLocal": {"bridgeInterface": "", "interfaceNamePrefix": ""},
        "detectLocalMode": "",
        "enableProfiling": False,
        "healthzBindAddress": "",
        "hostnameOverride": "",
        "iptables": {
            "localhostNodePorts": None,
            "masqueradeAll": False,
            "masqueradeBit": None,
            "minSyncPeriod": "0s",
            "syncPeriod": "0s",
        },
        "ipvs": {
            "excludeCIDRs": None,
            "minSyncPeriod": "0s",
            "scheduler": "",
            "strictARP": False,
            "syncPeriod": "0s",
            "tcpFinTimeout": "0s",
            "tcpTimeout": "0s",
            "udpTimeout": "0s",
        },
        "logging": {"flushFrequency": 0, "options": {"json": {"infoBufferSize": "0"},
                                                     "text": {"infoBufferSize": "0"}},
                    "verbosity": 0},
        # Reachable from the node's namespace and from the host, so the agent's
        # gate and the tests can both read /metrics and /proxyMode.
        "metricsBindAddress": "0.0.0.0:10249",
        "mode": mode,
        "nftables": {"masqueradeAll": False, "masqueradeBit": None, "minSyncPeriod": "0s",
                     "syncPeriod": "0s"},
        "nodePortAddresses": None,
        "oomScoreAdj": None,
        "portRange": "",
        "showHiddenMetricsForVersion": "",
        "winkernel": {"enableDSR": False, "forwardHealthCheckVip": False, "networkName": "",
                      "rootHnsEndpointName": "", "sourceVip": ""},
    }


def kube_proxy_kubeconfig(server: str = f"https://{paths.BRIDGE_ADDRESS}:{paths.APISERVER_PORT}") -> dict[str, Any]:
    """kubeconfig.conf: the pod's own ServiceAccount token and CA, as kubeadm writes it."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"cluster": {"certificate-authority": f"{SA_DIR}/ca.crt", "server": server},
                      "name": "default"}],
        "contexts": [{"context": {"cluster": "default", "namespace": "default", "user": "default"},
                      "name": "default"}],
        "current-context": "default",
        "users": [{"name": "default", "user": {"tokenFile": f"{SA_DIR}/token"}}],
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded config.conf) as literal blocks, readable as kubeadm's are."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def _dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def configmap(mode: str = "iptables") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": {"app": NAME}},
        "data": {
            "config.conf": _dump(kube_proxy_configuration(mode)),
            "kubeconfig.conf": _dump(kube_proxy_kubeconfig()),
        },
    }


def daemonset(version: str = DEFAULT_KUBERNETES_VERSION) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": {"k8s-app": NAME}},
        "spec": {
            "selector": {"matchLabels": {"k8s-app": NAME}},
            "template": {
                "metadata": {"labels": {"k8s-app": NAME}},
                "spec": {
                    "containers": [{
                        "name": NAME,
                        "image": f"{IMAGE_REPOSITORY}:{version}",
                        "imagePullPolicy": "IfNotPresent",
                        "command": [
                            "/usr/local/bin/kube-proxy",
                            f"--config={CONFIG_MOUNT}/config.conf",
                            "--hostname-override=$(NODE_NAME)",
                        ],
                        "env": [{"name": "NODE_NAME",
                                 "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                        "securityContext": {"privileged": True},
                        "volumeMounts": [
                            {"mountPath": CONFIG_MOUNT, "name": NAME},
                            {"mountPath": "/run/xtables.lock", "name": "xtables-lock"},
                            {"mountPath": "/lib/modules", "name": "lib-modules", "readOnly": True},
                        ],
                    }],
                    "hostNetwork": True,
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "priorityClassName": "system-node-critical",
                    "serviceAccountName": NAME,
                    "tolerations": [{"operator": "Exists"}],
                    "volumes": [
                        {"name": NAME, "configMap": {"name": NAME}},
                        {"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock",
                                                              "type": "FileOrCreate"}},
                        {"name": "lib-modules", "hostPath": {"path": "/lib/modules"}},
                    ],
                },
            },
            "updateStrategy": {"type": "RollingUpdate",
                               "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
        },
    }


def rbac() -> list[dict[str, Any]]:
    """ServiceAccount, the node-proxier binding, and the Role that lets joining nodes read the ConfigMap."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": NAMESPACE}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node-proxier"},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [NAME],
                       "verbs": ["get"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            "subjects": [{"kind": "Group", "name": "system:bootstrappers:kubeadm:default-node-token"}],
        },
    ]


def manifests(mode: str = "iptables", version: str = DEFAULT_KUBERNETES_VERSION) -> list[dict[str, Any]]:
    """Every baseline object, in apply order (identity and config before the DaemonSet)."""
    return [*rbac(), configmap(mode), daemonset(version)]


def fixture_documents() -> dict[str, str]:
    """file name -> YAML text, for tests/fixtures/baseline/."""
    objects = {"configmap": configmap(), "daemonset": daemonset()}
    return {name: _dump(objects[kind]) for name, kind in FIXTURE_FILES.items()}


def fixtures_dir() -> Path:
    return paths.repo_root() / "tests" / "fixtures" / "baseline"


def write_fixtures(directory: Path | None = None) -> list[Path]:
    directory = directory or fixtures_dir()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in fixture_documents().items():
        (directory / name).write_text(text)
        written.append(directory / name)
    return written


def install(kubeconfig: Path, kubectl: Path, *, mode: str = "iptables",
            version: str = DEFAULT_KUBERNETES_VERSION, env: dict[str, str] | None = None) -> None:
    """Apply the baseline (idempotent: kubectl apply)."""
    documents = "---\n".join(_dump(obj) for obj in manifests(mode, version))
    run([str(kubectl), f"--kubeconfig={kubeconfig}", "apply", "-f", "-"], input=documents,
        timeout=60, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster.baseline")
    parser.add_argument("--write-fixtures", action="store_true", help="regenerate tests/fixtures/baseline")
    args = parser.parse_args(argv)
    if args.write_fixtures:
        for path in write_fixtures():
            print(path)
    else:
        print("---\n".join(_dump(obj) for obj in manifests()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
