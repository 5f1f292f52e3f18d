"""What every cluster-facing `proxyshift` subcommand shares: --kubeconfig/--context, -o, and its errors.

kubectl runs `kubectl proxyshift ...` as the plugin `kubectl-proxyshift` and passes none of its own
flags on, so each subcommand has to take --kubeconfig and --context itself, as kubectl spells them.
A cluster that cannot be used (no kubeconfig, an unknown context, an API server that is down or says
no) is one line and exit code 2, like any other bad input (docs/cli.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from proxyshift.kubeconfig import loading
from proxyshift.manifest import UsageError
from proxyshift.planner.reports import OUTPUT_FORMATS


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (default $KUBECONFIG, then ~/.kube/config, then in-cluster)")
    parser.add_argument("--context", default=None, help="the kubeconfig context to use (default: its current one)")


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=OUTPUT_FORMATS, default="table",
                        help="table (default), or json / yaml in the shape docs/cli.md describes")


def load_api(kubeconfig: str | None, context: str | None = None) -> kubernetes.client.CustomObjectsApi:
    """Configure the kubernetes client for the cluster named by the flags (or the environment)."""
    use_file = kubeconfig or context or os.environ.get("KUBECONFIG") or not os.environ.get("KUBERNETES_SERVICE_HOST")
    with loading(kubeconfig, context, where_default=os.environ.get("KUBECONFIG") or "~/.kube/config"):
        if use_file:
            kubernetes.config.load_kube_config(config_file=kubeconfig, context=context)
        else:
            kubernetes.config.load_incluster_config()
    return kubernetes.client.CustomObjectsApi()


@contextmanager
def cluster_errors() -> Iterator[None]:
    """Turn an API server's refusal or absence into one line (UsageError, exit code 2)."""
    try:
        yield
    except ApiException as exc:
        raise UsageError(f"the API server refused: {exc.status} {exc.reason}") from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise UsageError(f"cannot reach the API server: {' '.join(str(exc).split())[:200]}") from None
