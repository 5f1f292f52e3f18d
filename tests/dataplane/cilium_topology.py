"""The simulated node the Cilium dataplane tests start the real agent in: a node namespace with eth0, an
outside namespace on its other end, a pod namespace behind the node (podnet), and a listener in the pod that
answers with the pod's name. Each test file passes its own addresses, so two files never share one.

    outside (ext0 <outside_ip>) --veth-- node (eth0 <node_ip>, pspodN) --veth-- pod (listener :<port>)
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from localcluster import podnet
from proxyshift.commands import run, stop_child
from tests.support.ps_netns import Netns

LISTENER_START_SECONDS = 30


@contextlib.contextmanager
def node_outside_pod(node_ip: str, outside_ip: str, pod_index: int) -> Iterator[tuple[Netns, Netns, str]]:
    """(node, outside, pod namespace name), all removed afterwards."""
    node, outside = Netns(), Netns()
    pod = ""
    try:
        node.run(["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "ext0", "netns", outside.name])
        node.run(["ip", "addr", "add", f"{node_ip}/24", "dev", "eth0"])
        outside.run(["ip", "addr", "add", f"{outside_ip}/24", "dev", "ext0"])
        for ns, link in ((node, "eth0"), (node, "lo"), (outside, "ext0"), (outside, "lo")):
            ns.run(["ip", "link", "set", link, "up"])
        node.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        pod = podnet.create_pod_netns(node.name, pod_index)
        yield node, outside, pod
    finally:
        if pod:
            run(["ip", "netns", "del", pod], check=False)
        node.delete()
        outside.delete()


@contextlib.contextmanager
def pod_listener(pod: str, port: int, work: Path) -> Iterator[str]:
    """A listener in the pod that answers every connection with the pod namespace's name; yields the name."""
    ready = work / "listener.ready"
    proc = subprocess.Popen([sys.executable, "-m", "localcluster.listener", "--endpoint", f"{pod}:{port}",
                             "--ready-file", str(ready)])
    try:
        deadline = time.monotonic() + LISTENER_START_SECONDS
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the listener did not start"
            time.sleep(0.1)
        yield pod
    finally:
        stop_child(proc)
