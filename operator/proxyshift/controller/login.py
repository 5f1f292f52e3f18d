"""How the operator logs in: the kubernetes client (our writes) and kopf (its watches) the same way.

The kubeconfig context (`proxyshift operator --context`) is passed in, not kept here: main.py puts it in
kopf's operator memo, where the login and startup handlers read it.
"""

from __future__ import annotations

import os
from typing import Any

import kopf
import kubernetes


def in_cluster(context: str | None) -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG") and not context


def load_client_config(context: str | None) -> None:
    """Configure the kubernetes client (our writes) the same way kopf logs in (its watches)."""
    if in_cluster(context):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), context=context)


def login_with_context(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """kopf's own kubeconfig login reads only the current context; with --context, log in as the client does.

    The fields are those kopf.login_via_client takes from the client's configuration, which we loaded for
    the named context (login_via_client itself would load the current one again).
    """
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None,
        scheme=scheme or None, token=token or None,
        certificate_path=config.cert_file, private_key_path=config.key_file,
        trust_env=settings.networking.trust_env,
    )


def connection_info(context: str | None, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """A kubeconfig when one is given, else the pod's service account.

    In a pod, the address comes from KUBERNETES_SERVICE_HOST/PORT (as the official client does), not
    from the name kubernetes.default.svc: it needs no cluster DNS. kopf logs in again on a 401, which
    picks up the rotated projected token.
    """
    load_client_config(context)
    if in_cluster(context):
        return kopf.login_via_client(**kwargs)
    if context:
        return login_with_context(kwargs["settings"])
    return kopf.login_with_kubeconfig(**kwargs)
