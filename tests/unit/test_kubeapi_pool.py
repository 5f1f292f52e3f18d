"""localcluster/kubeapi.py pooled_api_client: the pool size a caller asks for is the pool its client keeps."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest

from localcluster.kubeapi import Kube, pooled_api_client

pytestmark = pytest.mark.unit

KUBECONFIG = """apiVersion: v1
kind: Config
current-context: c
clusters: [{name: k, cluster: {server: 'https://198.18.0.1:6443', insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: k, user: u}}]
"""


def pool_size(client: kubernetes.client.ApiClient) -> int:
    return int(client.rest_client.pool_manager.connection_pool_kw["maxsize"])


def test_the_pool_keeps_the_size_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    assert pool_size(pooled_api_client(path, 32)) == 32


def test_a_size_set_on_a_made_client_never_reaches_its_pool(tmp_path: Path) -> None:
    """What the storm and scale benches did until 2026-12-05, and why pooled_api_client exists."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    made = kubernetes.config.new_client_from_config(str(path))
    made.configuration.connection_pool_maxsize = 32
    assert pool_size(made) != 32


def test_the_raw_json_client_keeps_its_pool_size(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    kube = Kube(path, pool_size=16)
    assert pool_size(kube.api) == 16 and kube.host == "https://198.18.0.1:6443"
