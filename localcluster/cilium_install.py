"""Cilium in the local cluster: its CRDs, RBAC, ConfigMap and a DaemonSet like Cilium's own.

Opt-in (`localcluster up --with-cilium`, or `install()` from a test): the agent's build takes minutes
from a cold Go cache, and every other suite must stay cheap. The DaemonSet runs on no node until a
Node carries the label `proxyshift.io/kube-proxy-replacement=cilium` (a required node affinity): that
label is the contract with the operator's `cilium-kpr` target, which sets it at the switch and
removes it when moving the node back.

On a labelled node the node simulator runs the `quay.io/cilium/cilium` image as the pinned agent
(the Go tool `cilium-agent`), confined to the node by localcluster.cilium: the node's cgroup v2
subtree and cgroup namespace, its network namespace, a private mount namespace with its own bpffs.
The pod mounts hostPath /var/run/cilium, which the simulator keeps per node
(`<state>/nodes/<node>/hostpath/run/cilium`), so the agent's API socket is at
/var/run/cilium/cilium.sock for every pod of that node that mounts the same hostPath.

The agent runs against the local API server: Cilium's CRDs (shipped in the pinned module; the agent
only waits for them, Cilium's operator would register them), `--ipam=kubernetes` on the Nodes'
spec.podCIDR (localcluster.podnet.node_pod_cidr), `--identity-allocation-mode=crd`, its
ServiceAccount's token (in-cluster config), native-routing KPR on the node's eth0.

    python -m localcluster.cilium_install [--print | --uninstall]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from localcluster import cilium, controlplane, gotools, paths
from proxyshift.commands import CommandError, run

NAMESPACE = "kube-system"
NAME = "cilium"
CONFIGMAP = "cilium-config"
VERSION = "v1.20.2"  # the module tests/tools/cilium-agent pins
IMAGE = f"quay.io/cilium/cilium:{VERSION}"
# The contract with the operator's cilium-kpr target (issue 19): the DaemonSet runs only there.
NODE_LABEL = "proxyshift.io/kube-proxy-replacement"
NODE_LABEL_VALUE = "cilium"
# Where the agent's REST API listens on a node, for the pods of that node that mount the hostPath.
SOCKET_DIR = "/var/run/cilium"
SOCKET_PATH = f"{SOCKET_DIR}/cilium.sock"
HEALTH_PORT = 9879  # the agent's /healthz on 127.0.0.1 (Cilium's probes use it)
CONFIG_DIR = "/tmp/cilium/config-map"
# The node's link to the cluster network (localcluster.network: the veth end in every node).
NODE_DEVICE = "eth0"
CRD_GROUP = "cilium.io"
CRD_SUBDIR = Path("pkg/k8s/apis/cilium.io/client/crds")
CRD_ESTABLISHED_SECONDS = 60.0
KUBECTL_TIMEOUT = 120.0
FIELD_MANAGER = "localcluster-cilium"
# Cilium's agent capabilities (its Helm chart's securityContext.capabilities.ciliumAgent), with BPF
# and PERFMON which this kernel has: the agent is no privileged container. Without SYS_RESOURCE: this
# machine's bounding set lacks it (setpriv then refuses to start the agent), and the agent wants it only
# to raise RLIMIT_MEMLOCK, which kernels from 5.11 no longer charge BPF maps to.
CAPABILITIES = ("CHOWN", "KILL", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "SYS_MODULE", "SYS_ADMIN",
                "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID", "BPF", "PERFMON")


class CiliumInstallError(RuntimeError):
    """Cilium could not be installed in the local cluster."""


def config() -> dict[str, str]:
    """cilium-config: the agent's settings, one key per flag (Cilium reads the folder with --config-dir)."""
    return {
        "kube-proxy-replacement": "true",
        "routing-mode": "native",
        "ipv4-native-routing-cidr": paths.CLUSTER_CIDR,
        "enable-ipv4": "true",
        "enable-ipv6": "false",
        "devices": NODE_DEVICE,
        "ipam": "kubernetes",
        "k8s-require-ipv4-pod-cidr": "true",
        "identity-allocation-mode": "crd",
        "enable-l7-proxy": "false",
        "enable-health-checking": "false",
        "enable-endpoint-health-checking": "false",
        "enable-hubble": "false",
        # The nodes have no CNI of Cilium's; it must not rename /etc/cni/net.d files (the host's).
        "cni-exclusive": "false",
        "agent-health-port": str(HEALTH_PORT),
        "cluster-name": "default",
        "cluster-id": "0",
    }


def _probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    # Cilium's own probe: its agent's /healthz on the node's loopback, brief.
    return {"httpGet": {"host": "127.0.0.1", "path": "/healthz", "port": HEALTH_PORT, "scheme": "HTTP",
                        "httpHeaders": [{"name": "brief", "value": "true"}]},
            "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures, "successThreshold": 1}


def daemonset() -> dict[str, Any]:
    """kube-system/cilium, shaped like Cilium's chart's agent DaemonSet, on labelled nodes only."""
    labels = {"k8s-app": NAME, "app.kubernetes.io/name": "cilium-agent", "app.kubernetes.io/part-of": "cilium"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": NODE_LABEL, "operator": "In", "values": [NODE_LABEL_VALUE]}]}]}}}
    container = {
        "name": "cilium-agent",
        "image": IMAGE,
        "command": ["cilium-agent"],
        "args": [f"--config-dir={CONFIG_DIR}"],
        # Up to 5 minutes to the first healthy answer (the first datapath compile on a busy machine).
        "startupProbe": {**_probe(2, 150), "initialDelaySeconds": 2},
        "livenessProbe": _probe(30, 10),
        "readinessProbe": _probe(5, 3),
        "env": [{"name": "K8S_NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                        "fieldPath": "spec.nodeName"}}},
                {"name": "CILIUM_K8S_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                               "fieldPath": "metadata.namespace"}}}],
        "securityContext": {"privileged": False,
                            "capabilities": {"add": list(CAPABILITIES), "drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "cilium-run", "mountPath": SOCKET_DIR},
            {"name": "lib-modules", "mountPath": "/lib/modules", "readOnly": True},
            {"name": "xtables-lock", "mountPath": "/run/xtables.lock"},
            {"name": "cilium-config-path", "mountPath": CONFIG_DIR, "readOnly": True},
        ],
    }
    # No bpf-maps (/sys/fs/bpf) nor cilium-cgroup (/run/cilium/cgroupv2) hostPath as in Cilium's chart:
    # the confined launcher gives the agent its own bpffs and the node's cgroup subtree instead.
    volumes = [
        {"name": "cilium-run", "hostPath": {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}},
        {"name": "lib-modules", "hostPath": {"path": "/lib/modules"}},
        {"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"}},
        {"name": "cilium-config-path", "configMap": {"name": CONFIGMAP}},
    ]
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": {"k8s-app": NAME}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "affinity": affinity,
                    "hostNetwork": True,
                    "serviceAccountName": NAME,
                    "automountServiceAccountToken": True,
                    "priorityClassName": "system-node-critical",
                    "restartPolicy": "Always",
                    "terminationGracePeriodSeconds": 5,
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _rule(groups: list[str], resources: list[str], verbs: list[str]) -> dict[str, list[str]]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


def cluster_role_rules() -> list[dict[str, list[str]]]:
    """Cilium's own agent ClusterRole (install/kubernetes/cilium/templates/cilium-agent/clusterrole.yaml),
    without `secrets` (read for ingress, Gateway API and clustermesh, none of which runs here)."""
    return [
        _rule(["networking.k8s.io"], ["networkpolicies"], ["get", "list", "watch"]),
        _rule(["discovery.k8s.io"], ["endpointslices"], ["get", "list", "watch"]),
        _rule([""], ["namespaces", "services", "pods", "nodes"], ["get", "list", "watch"]),
        _rule([""], ["events"], ["create", "patch"]),
        _rule([""], ["nodes/status"], ["patch"]),  # Cilium's annotations on its Node
        _rule(["coordination.k8s.io"], ["leases"], ["create", "get", "update", "list", "delete"]),
        _rule(["apiextensions.k8s.io"], ["customresourcedefinitions"], ["list", "watch", "get"]),
        _rule([CRD_GROUP], ["ciliumloadbalancerippools", "ciliumbgpnodeconfigs", "ciliumbgpadvertisements",
                            "ciliumbgppeerconfigs", "ciliumclusterwideenvoyconfigs", "ciliumclusterwidenetworkpolicies",
                            "ciliumegressgatewaypolicies", "ciliumendpoints", "ciliumendpointslices",
                            "ciliumenvoyconfigs", "ciliumidentities", "ciliumlocalredirectpolicies",
                            "ciliumnetworkpolicies", "ciliumnodes", "ciliumnodeconfigs", "ciliumcidrgroups",
                            "ciliuml2announcementpolicies", "ciliumpodippools", "ciliumdatapathplugins"],
              ["list", "watch"]),
        _rule([CRD_GROUP], ["ciliumidentities", "ciliumendpoints", "ciliumnodes"], ["create"]),
        _rule([CRD_GROUP], ["ciliumidentities"], ["update"]),
        _rule([CRD_GROUP], ["ciliumendpoints"], ["delete", "get"]),
        _rule([CRD_GROUP], ["ciliumnodes", "ciliumnodes/status"], ["get", "update"]),
        _rule([CRD_GROUP], ["ciliumendpoints/status", "ciliumendpoints", "ciliuml2announcementpolicies/status",
                            "ciliumbgpnodeconfigs/status"], ["patch"]),
        _rule(["policy.networking.k8s.io"], ["clusternetworkpolicies"], ["get", "list", "watch"]),
    ]


def manifests() -> list[dict[str, Any]]:
    """Everything but the CRDs: ServiceAccount, RBAC, ConfigMap, DaemonSet."""
    labels = {"app.kubernetes.io/part-of": "cilium"}
    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": NAMESPACE,
                                                                     "labels": labels}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": NAME, "labels": labels}, "rules": cluster_role_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": NAME, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
         "subjects": subject},
        # Its own ConfigMap, read through the API for dynamic config (Cilium's Role cilium-config-agent).
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "cilium-config-agent", "namespace": NAMESPACE, "labels": labels},
         "rules": [_rule([""], ["configmaps"], ["get", "list", "watch"])]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "cilium-config-agent", "namespace": NAMESPACE, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cilium-config-agent"},
         "subjects": subject},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE,
                                                               "labels": labels}, "data": config()},
        daemonset(),
    ]


def node_socket(state_dir: Path, node: str) -> Path:
    """Where a node's agent socket (SOCKET_PATH in its pods) is on the host: the node's hostPath folder."""
    from localcluster.nodesim.volumes import node_host_path

    path = node_host_path(paths.StateLayout(Path(state_dir)).nodes / node, Path(SOCKET_PATH))
    assert path is not None, f"{SOCKET_DIR} is a node-private hostPath (localcluster.nodesim.volumes)"
    return path


CILIUM_CHAIN_PREFIX = "CILIUM_"
HOST_LINK = "cilium_host"  # with its veth peer cilium_net


def leftover_rules(iptables_save: str) -> dict[str, list[str]]:
    """The iptables-restore --noflush lines, by table, that remove Cilium's chains from an iptables-save
    dump: each jump into a CILIUM_* chain from another chain deleted, then every CILIUM_* chain flushed,
    then deleted (flushed first: they jump to each other)."""
    table = ""
    jumps: dict[str, list[str]] = {}
    chains: dict[str, list[str]] = {}
    for line in iptables_save.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith(f":{CILIUM_CHAIN_PREFIX}"):
            chains.setdefault(table, []).append(line[1:].split()[0])
        elif line.startswith("-A "):
            words = line.split()
            target = words[words.index("-j") + 1] if "-j" in words[:-1] else ""
            if not words[1].startswith(CILIUM_CHAIN_PREFIX) and target.startswith(CILIUM_CHAIN_PREFIX):
                jumps.setdefault(table, []).append("-D" + line[2:])
    return {t: [*jumps.get(t, []), *(f"-F {c}" for c in chains.get(t, [])), *(f"-X {c}" for c in chains.get(t, []))]
            for t in sorted(set(jumps) | set(chains))}


def remove_node_leftovers(netns: str) -> None:
    """Test-bed hygiene after Cilium left a node: its cilium_host/cilium_net pair (their routes go with
    them), its CILIUM_* iptables chains, and its pins in the node's bpffs (whose links keep socket-LB
    attached at the node's cgroup), so the session's next tests meet the node as `up` made it.

    Only Cilium's own objects, one iptables-restore per table. The operator's cleanup of a node moving
    back to kube-proxy is the product's (issue 19); this is for tests that did not run it.
    """
    suffix = f"/{netns}/hostpath/sys/fs/bpf"
    for mount in cilium.bpffs_mount_points():
        if str(mount).endswith(suffix):
            cilium.unpin_cilium(mount)
    links = run(["ip", "-o", "link", "show"], netns=netns, timeout=KUBECTL_TIMEOUT).stdout
    if f" {HOST_LINK}@" in links or f" {HOST_LINK}:" in links:
        run(["ip", "link", "del", HOST_LINK], netns=netns, timeout=KUBECTL_TIMEOUT)
    for save, restore in (("iptables-save", "iptables-restore"), ("ip6tables-save", "ip6tables-restore")):
        dump = run([save], netns=netns, timeout=KUBECTL_TIMEOUT, check=False).stdout
        for table, lines in leftover_rules(dump).items():
            if lines:
                run([restore, "--noflush"], netns=netns, timeout=KUBECTL_TIMEOUT,
                    input=f"*{table}\n" + "\n".join(lines) + "\nCOMMIT\n")


def module_dir() -> Path:
    """The pinned Cilium module in the Go module cache (its bpf/ folder's parent)."""
    return cilium.bpf_sources().parent


def crd_files() -> list[Path]:
    """Cilium's CRDs as the module ships them (crds/v2, crds/v2alpha1)."""
    files = sorted((module_dir() / CRD_SUBDIR).glob("*/*.yaml"))
    if not files:
        raise CiliumInstallError(f"no CRDs under {module_dir() / CRD_SUBDIR}")
    return files


def crd_names(files: list[Path]) -> list[str]:
    return [str(yaml.safe_load(path.read_text())["metadata"]["name"]) for path in files]


def _kubectl(kubectl: Path, kubeconfig: Path, *args: str, input: str | None = None,
             timeout: float = KUBECTL_TIMEOUT) -> str:
    return run([str(kubectl), f"--kubeconfig={kubeconfig}", *args], input=input, timeout=timeout,
               env=controlplane.daemon_env()).stdout


def _established(kubectl: Path, kubeconfig: Path, names: list[str]) -> list[str]:
    """The CRDs of `names` not yet Established (one list call)."""
    listing = json.loads(_kubectl(kubectl, kubeconfig, "get", "crd", "-o", "json"))
    ready = {item["metadata"]["name"] for item in listing.get("items", [])
             if any(c.get("type") == "Established" and c.get("status") == "True"
                    for c in (item.get("status") or {}).get("conditions") or [])}
    return [name for name in names if name not in ready]


def install(kubeconfig: Path, kubectl: Path, *, build: bool = True) -> Path:
    """Install Cilium in the cluster (idempotent) and return the agent binary the nodes will run.

    `build`: build the agent when it is not built yet (minutes from a cold Go cache); else fail.
    """
    agent = gotools.built(cilium.AGENT_TOOL)
    if agent is None:
        if not build:
            raise CiliumInstallError(gotools.build_hint(cilium.AGENT_TOOL))
        print(f"[localcluster] building {cilium.AGENT_TOOL} (minutes from a cold Go cache)", flush=True)
        agent = gotools.build(cilium.AGENT_TOOL)
    if not (cilium.LLVM_BIN / "clang").is_file():
        raise CiliumInstallError(f"no clang at {cilium.LLVM_BIN}: install clang-19 (hack/install-deps.sh does)")
    files = crd_files()
    # Server-side: the CRDs are larger than client-side apply's last-applied annotation allows.
    _kubectl(kubectl, kubeconfig, "apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}",
             *[arg for path in files for arg in ("-f", str(path))])
    names = crd_names(files)
    deadline = time.monotonic() + CRD_ESTABLISHED_SECONDS
    while waiting := _established(kubectl, kubeconfig, names):
        if time.monotonic() > deadline:
            raise CiliumInstallError(f"Cilium CRDs not Established within {CRD_ESTABLISHED_SECONDS:g}s: {waiting}")
        time.sleep(0.2)
    documents = "---\n".join(yaml.safe_dump(obj, sort_keys=False) for obj in manifests())
    _kubectl(kubectl, kubeconfig, "apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}",
             "-f", "-", input=documents)
    return agent


def uninstall(kubeconfig: Path, kubectl: Path) -> None:
    """Remove the DaemonSet (waiting for its pods), ConfigMap and RBAC; the CRDs and their objects stay."""
    for obj in reversed(manifests()):
        kind = obj["kind"].lower()
        namespace = obj["metadata"].get("namespace")
        _kubectl(kubectl, kubeconfig, "delete", kind, obj["metadata"]["name"], "--ignore-not-found", "--wait=true",
                 "--timeout=120s", *(["-n", namespace] if namespace else []), timeout=150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster.cilium_install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", type=Path, default=None)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--print", action="store_true", help="print the manifests (without the CRDs)")
    action.add_argument("--uninstall", action="store_true")
    args = parser.parse_args(argv)
    if args.print:
        print("---\n".join(yaml.safe_dump(obj, sort_keys=False) for obj in manifests()), end="")
        return 0
    state_dir = args.state_dir or paths.default_state_dir()
    info = controlplane.load_info(state_dir)
    if info is None:
        print(f"no cluster in {state_dir} (run `localcluster up`)", file=sys.stderr)
        return 1
    try:
        if args.uninstall:
            uninstall(info.kubeconfig, info.bin_dir / "kubectl")
        else:
            print(install(info.kubeconfig, info.bin_dir / "kubectl"))
    except (CommandError, CiliumInstallError, cilium.CiliumError, gotools.GoToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
