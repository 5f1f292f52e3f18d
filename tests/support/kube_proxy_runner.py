"""Run the real kube-proxy binary inside a test namespace, fed by fake_apiserver.py.

Used by the real-kube-proxy dataplane tests, the vm guest tests, the benchmarks and
tests/dataplane/capture_kube_proxy.py (which records /metrics and rules as fixtures).
Processes started here are stopped by their own pids.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from localcluster import build
from localcluster.container import run_in_netns
from proxyshift.agent.probe import facts_from_probe, probe
from proxyshift.commands import stop_child
from tests.support import REPO
from tests.support.ps_netns import Netns

API_PORT = 16443


def find_kube_proxy() -> Path | None:
    """$PROXYSHIFT_KUBE_PROXY, else the local cluster build's kube-proxy for the current pins, else None.

    The build's own path function (build.bin_dir_for), not a guessed folder: a path only one machine had
    (~/.cache/proxyshift/warm/) made the benchmarks drop their kube-proxy column on every other machine, and a
    glob over the cache's hash folders could pick a build of older pins.
    """
    env = os.environ.get("PROXYSHIFT_KUBE_PROXY")
    if env:
        return Path(env) if Path(env).is_file() and os.access(env, os.X_OK) else None
    bin_dir = build.bin_dir_for()
    return bin_dir / "kube-proxy" if build.is_complete(bin_dir) else None


CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
clientConnection:
  kubeconfig: {dir}/kubeconfig
  contentType: application/json
  acceptContentTypes: application/json
hostnameOverride: {node}
bindAddress: {node_ip}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 0.0.0.0:10256
clusterCIDR: 198.18.16.0/20
conntrack:
  maxPerCore: 0
{conntrack_extra}iptables:
  minSyncPeriod: 0s
  syncPeriod: 10s
nftables:
  minSyncPeriod: 0s
  syncPeriod: 10s
ipvs:
  scheduler: {scheduler}
  minSyncPeriod: 0s
  syncPeriod: 10s
"""

# kind's (and the local cluster's) values: kube-proxy then writes no nf_conntrack sysctl, so it
# does not need nf_conntrack loaded before it starts.
CONNTRACK_OFF = "  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n"

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "http://127.0.0.1:{port}"}}
users:
- name: kube-proxy
  user: {{token: fake}}
contexts:
- name: fake
  context: {{cluster: fake, user: kube-proxy}}
current-context: fake
"""

class KubeProxy:
    """A fake API server and a real kube-proxy in `ns`, stopped by stop()."""

    def __init__(self, ns: Netns, workdir: Path, mode: str, *, services: int = 20, node: str = "ps-node-1",
                 node_ip: str = "198.18.0.11", binary: Path | None = None, udp_services: int = 0,
                 scheduler: str = "rr", conntrack_sysctls: bool = True) -> None:
        self.ns, self.dir, self.mode = ns, workdir, mode
        self.binary = binary or find_kube_proxy()
        if self.binary is None:
            raise FileNotFoundError("no kube-proxy binary (set PROXYSHIFT_KUBE_PROXY)")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "kubeconfig").write_text(KUBECONFIG.format(port=API_PORT))
        config = CONFIG.format(mode=mode, dir=workdir, node=node, node_ip=node_ip, scheduler=scheduler,
                               conntrack_extra="" if conntrack_sysctls else CONNTRACK_OFF)
        (workdir / "config.yaml").write_text(config)
        # kube-proxy wants its node IP on an interface; a dummy-less kernel still has lo.
        ns.run(["ip", "link", "set", "lo", "up"])
        ns.run(["ip", "addr", "replace", f"{node_ip}/32", "dev", "lo"])  # a second kube-proxy in ns too
        prefix = ["ip", "netns", "exec", ns.name]
        self.api_log = open(workdir / "apiserver.log", "w")  # noqa: SIM115 - closed in stop()
        self.api = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.support.fake_apiserver", "--port", str(API_PORT), "--node", node,
             "--node-ip", node_ip, "--services", str(services), "--udp-services", str(udp_services)],
            stdout=self.api_log, stderr=subprocess.STDOUT, cwd=REPO)
        time.sleep(0.5)
        self.log = open(workdir / "kube-proxy.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*prefix, str(self.binary), "--config", str(workdir / "config.yaml"),
                                      "--v=2"], stdout=self.log, stderr=subprocess.STDOUT)

    def probe(self) -> dict[str, Any]:
        """The agent's own probe, on a thread inside the namespace: no new interpreter per look
        (in the QEMU guest, starting Python and importing the agent costs 10-30 s under emulation)."""
        answer = run_in_netns(self.ns.name, probe)
        facts = facts_from_probe(answer)
        return {"facts": facts.model_dump(mode="json", by_alias=True), "metrics": answer.metrics.body}

    def wait_synced(self, syncs: int = 1, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kube-proxy exited {self.proc.returncode}; see {self.dir / 'kube-proxy.log'}")
            last = self.probe()
            facts = last["facts"]
            if (facts.get("syncCount") or 0) >= syncs and facts.get("healthzStatus") == 200:
                return last
            time.sleep(1)
        raise TimeoutError(f"kube-proxy did not sync {syncs} times in {timeout:g}s: {last.get('facts')}; "
                           f"see {self.dir / 'kube-proxy.log'}")

    def stop(self) -> None:
        for proc in (self.proc, self.api):
            stop_child(proc, grace=10)
        self.log.close()
        self.api_log.close()
