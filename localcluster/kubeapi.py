"""A small raw-JSON Kubernetes API client for the test bed: dicts in, dicts out.

It talks through the kubernetes client's transport, so kubeconfig handling is
the standard one, but skips the generated models: the node simulator must
round-trip fields the models may not know, and skipping model
(de)serialisation keeps a simulated node's CPU use negligible. The workloads,
the tests and the benches use it for the same reasons.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- a small raw-JSON API client ---------------------------------------------

class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        self.body = body
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


def pooled_api_client(kubeconfig: Path | str, pool_size: int) -> Any:
    """A kubernetes ApiClient from `kubeconfig` that keeps up to `pool_size` connections.

    The size is set before the client exists: its urllib3 pool reads it once, at construction. Set on a
    made client's configuration (`new_client_from_config`, then the size: what the storm and scale benches
    did until 2026-12-05) it never reaches the pool, which keeps the default (5 per CPU), and a caller with
    more threads than that drops each surplus connection and pays a new TLS handshake for the next request.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


class Kube:
    """JSON in, JSON out, over the kubernetes client's configured transport (certs, proxies, auth)."""

    def __init__(self, kubeconfig: Path | str, pool_size: int = 4) -> None:
        self.api = pooled_api_client(kubeconfig, pool_size)
        self.configuration = self.api.configuration
        self.host = self.configuration.host.rstrip("/")

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        hook = getattr(self.configuration, "refresh_api_key_hook", None)
        if hook is not None:  # exec/OIDC kubeconfigs renew their token through this hook
            hook(self.configuration)
        token = (self.configuration.api_key or {}).get("authorization") or \
            (self.configuration.api_key or {}).get("BearerToken")
        if token:
            prefix = (self.configuration.api_key_prefix or {}).get("authorization", "")
            headers["Authorization"] = f"{prefix} {token}".strip() if prefix else token
        return headers

    def _send(self, method: str, path: str, body: Any, query: dict[str, Any] | None, content_type: str,
              timeout: float | tuple[float, float]) -> Any:
        url = self.host + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        return self.api.rest_client.request(method, url, headers=self._headers(content_type), body=body,
                                            _request_timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 30.0) -> Any:
        resp = self._send(method, path, body, query, content_type, timeout)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, method, path, data.decode(errors="replace"))
        return json.loads(data) if data else None

    def get(self, path: str, *, timeout: float = 30.0, **query: Any) -> Any:
        return self.request("GET", path, query=query or None, timeout=timeout)

    def get_or_none(self, path: str, *, timeout: float = 30.0) -> Any:
        try:
            return self.get(path, timeout=timeout)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any, *, timeout: float = 30.0) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json", timeout=timeout)

    def strategic_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: dict[str, Any], read_timeout: float) -> Iterator[dict[str, Any]]:
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._send("GET", path, None, {**query, "watch": "true"}, "application/json",
                          (10.0, read_timeout))
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, "WATCH", path, resp.read().decode(errors="replace"))
        try:
            for line in iter_resp_lines(resp.response):
                if line.strip():
                    yield json.loads(line)
        finally:
            resp.response.release_conn()


def api_client(kubeconfig: Path | str) -> Kube:
    return Kube(kubeconfig)
