"""The benches' kubernetes clients, with the connection pool they ask for.

`kubernetes.config.new_client_from_config` builds the ApiClient at once, and its urllib3 pool reads
`connection_pool_maxsize` only then: setting it on the client's configuration afterwards (what the storm and
scale benches did until 2026-12-05) left the pool at the default (5 per CPU), and a bench with more threads
than that dropped each surplus connection after its request and paid a new TLS handshake for the next.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes


def pooled_client(kubeconfig: Path | str, pool_size: int) -> kubernetes.client.ApiClient:
    """A client from `kubeconfig` that keeps up to `pool_size` connections."""
    conf = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=conf)
    conf.connection_pool_maxsize = pool_size
    return kubernetes.client.ApiClient(conf)
