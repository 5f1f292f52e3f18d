"""`proxyshift operator`: run the kopf operator."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import secrets
import socket
from collections.abc import Sequence
from datetime import UTC, datetime

import kopf
from prometheus_client import start_http_server

from proxyshift.controller import login
from proxyshift.controller.settings import CONFIG
from proxyshift.kubeconfig import loading


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="proxyshift operator", description="Run the proxyshift operator.")
    parser.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument("--context", help="the kubeconfig context to use (default: its current one)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering (one replica only; use for the local demo)")
    parser.add_argument("--peering", default=CONFIG.peering_name, help="ClusterKopfPeering name for HA")
    parser.add_argument("--metrics-port", type=int, default=CONFIG.metrics_port,
                        help="port of /metrics (0 disables)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                        help="kopf liveness endpoint URL")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(list(argv))


def peering_identity() -> str | None:
    """The operator's peering id when kopf cannot make its own, else None (kopf's: POD_ID or user@host/...).

    kopf names the user with getpass.getuser(), which raises KeyError for a uid without a passwd
    entry: the image runs as 65532, which has none, so the operator died at start as it runs in
    production. Same shape as kopf's, with the uid."""
    if os.environ.get("POD_ID"):
        return None
    try:
        getpass.getuser()
        return None
    except (KeyError, OSError):
        started = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
        return f"uid{os.getuid()}@{socket.gethostname()}/{started}/{secrets.token_hex(3)}"


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # kopf loads the configuration inside its login handler, where an unusable kubeconfig or context is a
    # logged traceback, retried; loaded once here (the login handler loads it again), it is one line and
    # exit code 2 before anything starts.
    with loading(args.kubeconfig, args.context,
                 where_default=os.environ.get("KUBECONFIG") or "~/.kube/config or in-cluster"):
        if args.kubeconfig:
            os.environ["KUBECONFIG"] = args.kubeconfig
        login.load_client_config(args.context)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        start_http_server(args.metrics_port)
    from proxyshift.controller import handlers  # noqa: F401  (importing it registers the handlers with kopf)
    from proxyshift.controller.runtime import MEMO_KUBE_CONTEXT, MEMO_PEERING

    asyncio.run(kopf.operator(
        # The namespaced kinds kopf watches (the baseline and revision ConfigMaps and DaemonSets) live in
        # kube-proxy's namespace only, and the operator may read them only there (config/rbac: a Role);
        # the cluster-scoped kinds (ProxyPolicies) are watched cluster-wide all the same. The startup
        # handler keeps the peering cluster-wide and turns kopf's namespace scan off (handlers.configure).
        namespaces=[CONFIG.kube_proxy_namespace],
        identity=peering_identity(),  # type: ignore[arg-type]  # kopf types it as its internal Identity (a str)
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        liveness_endpoint=args.liveness or None,
        # The login and start-up handlers read the context and the peering here; the startup handler adds
        # the runtime.
        memo=kopf.Memo({MEMO_KUBE_CONTEXT: args.context, MEMO_PEERING: None if args.standalone else args.peering}),
    ))
    return 0
