"""`proxyshift restore-baseline`: give the baseline kube-proxy DaemonSet back its own affinity (uninstall).

The operator adds `proxyshift.io/revision DoesNotExist` to the baseline DaemonSet
once and records the exact inverse on it; it never removes it by itself, because
that would restart every baseline kube-proxy again. Run this after the last
policy is gone. It refuses while any node still carries a revision label: those
nodes would get a second kube-proxy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kubernetes

from proxyshift.controller.cliargs import add_cluster_flags, cluster_errors, load_api
from proxyshift.controller.executor import Executor
from proxyshift.controller.kube import ClusterAPI
from proxyshift.planner.world import REVISION_LABEL


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="proxyshift restore-baseline", description=__doc__.splitlines()[0])
    add_cluster_flags(parser)
    args = parser.parse_args(list(argv))
    load_api(args.kubeconfig, args.context)
    with cluster_errors():
        labelled = kubernetes.client.CoreV1Api().list_node(label_selector=REVISION_LABEL).items
        if labelled:
            # A listed Node always has metadata.name; the client's models type both Optional.
            names = ", ".join(n.metadata.name for n in labelled[:10])  # type: ignore[union-attr, misc]
            print(f"refusing: {len(labelled)} nodes still run a proxyshift revision ({names}); delete the policies "
                  "(deletionPolicy: Revert) first", file=sys.stderr)
            return 1  # not ready for it yet: the same code as any command's "not ready"
        Executor(ClusterAPI()).undo_baseline_affinity()
    print("baseline kube-proxy DaemonSet restored")
    return 0
