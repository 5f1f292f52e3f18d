"""JSON requests through the kubernetes client's ApiClient, without its typed API classes.

The client's ApiClient carries what the operator needs of it: the configuration (server, TLS, the
token kopf's login refreshes), the connection pool, the JSON and apply-patch bodies, ApiException on
an error answer. Its typed API classes (CoreV1Api, AppsV1Api, ...) add nothing the operator uses (it
reads answers as JSON and keeps only small views of them) and cost memory: kubernetes 37's generated
client builds pydantic validators for every model an API module names when it is first imported,
measured here at +78 MB for CoreV1Api, +9 MB for AppsV1Api, for an operator whose own data at 5,000
nodes is a few tens of MB (docs/benchmarks.md, controller scale). CustomObjectsApi names no models
(+4 MB) and stays in use for the custom resources.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

JSON = "application/json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"

# The kubernetes client's keyword names for a list or watch, as the API's query parameters.
_QUERY_NAMES: Mapping[str, str] = MappingProxyType({
    "limit": "limit", "_continue": "continue", "watch": "watch", "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks", "timeout_seconds": "timeoutSeconds",
    "label_selector": "labelSelector", "field_selector": "fieldSelector",
})


class Rest:
    """One ApiClient's requests: `call` answers urllib3's response (a stream, for watches), `json` the body."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api_client = api_client or client.ApiClient()

    def call(self, method: str, path: str, *, query: Mapping[str, Any] | None = None, body: Any = None,
             content_type: str | None = None, timeout: Any = None) -> Any:
        """Send the request; raise ApiException unless the answer is 2xx. The answer is not read."""
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type or JSON
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        request = self.api_client.param_serialize(method=method, resource_path=path, query_params=params,
                                                  header_params=headers, body=body, auth_settings=["BearerToken"])
        answer = self.api_client.call_api(*request, _request_timeout=timeout)
        if not 200 <= answer.status <= 299:
            data = answer.read() or b""
            raise ApiException.from_response(http_resp=answer, body=data.decode("utf-8", "replace"), data=None)
        return answer

    def json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        answer = self.call(method, path, **kwargs)
        data = answer.read()
        return json.loads(data) if data else {}


class Collection:
    """A collection's list (and watch) in the calling convention of the client's list_* methods, so that
    controller/mirror.py lists it as it would a typed API's: `Collection(path).list(**kwargs)` with
    `limit`, `_continue`, `watch`, `resource_version`, `label_selector`, ... and `_preload_content=False`
    (the answer is urllib3's response, read as a stream); `for_client` gives the same collection over
    another ApiClient (each mirror thread has its own)."""

    def __init__(self, path: str, api_client: client.ApiClient | None = None) -> None:
        self.path = path
        self.api_client = api_client

    def for_client(self, api_client: client.ApiClient) -> Collection:
        return Collection(self.path, api_client)

    def list(self, **kwargs: Any) -> Any:
        if kwargs.pop("_preload_content", False) is not False:
            raise ValueError("a Collection answers the raw response only (_preload_content=False)")
        timeout = kwargs.pop("_request_timeout", None)
        unknown = set(kwargs) - set(_QUERY_NAMES)
        if unknown:
            raise TypeError(f"unknown list arguments: {sorted(unknown)}")
        query = {_QUERY_NAMES[k]: v for k, v in kwargs.items()}
        return Rest(self.api_client).call("GET", self.path, query=query, timeout=timeout).response
