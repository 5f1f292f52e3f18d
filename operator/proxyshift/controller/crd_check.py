"""`proxyshift crd-check`: whether a cluster's CRDs hold everything this version of proxyshift writes.

The operator makes the same comparison at its start and waits while the served CRDs are older
(api/schema_drift.py); run this before `helm upgrade`, which never upgrades a chart's crds/, or in a
pipeline. Exit 0: the served CRDs hold it all; 1: they do not, each difference on a line; 2: the cluster
cannot be read.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from proxyshift import __version__
from proxyshift.api.schema_drift import UPGRADE_COMMAND, crd_drift
from proxyshift.controller.cliargs import add_cluster_flags, cluster_errors, load_api
from proxyshift.controller.kube import ClusterAPI
from proxyshift.manifest import UsageError


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="proxyshift crd-check", description=__doc__.splitlines()[0])
    add_cluster_flags(parser)
    args = parser.parse_args(list(argv))
    load_api(args.kubeconfig, args.context)
    with cluster_errors():
        document = ClusterAPI().served_openapi()
    if document is None:
        raise UsageError("cannot read the API server's OpenAPI v3 document of the proxyshift CRDs")
    drifts = crd_drift(document)
    if not drifts:
        print(f"the served proxyshift CRDs hold everything proxyshift {__version__} writes")
        return 0
    print(f"the served proxyshift CRDs are older than proxyshift {__version__}; upgrade them with `{UPGRADE_COMMAND}`:")
    for drift in drifts:
        print(f"  {drift}")
    return 1
