"""The write floor of bench_controller_scale.py: the operator's writes, replayed as fast as the API server takes them.

Not the product. After the rollout converged, the audit log holds every write the operator made
(level Request: verb, request URI with its query, request body, answer code). `plan()` turns those
events into a replay plan, a pure function; `replay()` sends the plan with a minimal client (urllib3,
no model classes, the answer read only for its resourceVersion) and times it. Converge / floor says how
much of the rollout's time is more than the API server's own cost of its writes.

What "the same writes" means here, per audited write:

- patch: the same URI (resource, subresource, fieldManager/force query) and the same body, with one
  annotation `bench.proxyshift.io/write-floor: <n>` added (a dict body) so that the replay is a real
  write: the objects are in their final state, and a replayed patch that changes nothing would be
  answered without an etcd write, cheaper than the operator's. The content type is not in the audit
  log; it is the one the kubernetes client picked: a list body is a JSON patch, a full object with
  apiVersion and kind a server-side apply (the operator's only writes with fieldManager), a dict on a
  built-in group a strategic merge patch, on a custom resource a merge patch. A status subresource
  ignores the annotation; its patches are replayed in their original order per object, so each one
  changes the status as it did in the rollout (`Floor.noops` counts any that did not).
- an apply that created its object (answer 201): the same apply to a new name (`bench-floor-<n>-...`),
  so it is a create again.
- a patch with the same body as the previous write to its object (a revision DaemonSet applied again
  unchanged) changed nothing in the rollout: it is replayed as it was, without the annotation, and
  changes nothing again.
- a JSON patch (kopf's finalizer, the baseline's affinity): its ops without a `test` of the
  resourceVersion (that one has moved on), plus an `add` of the annotation when the patch already
  writes under /metadata/annotations/ (elsewhere the annotations map may be missing).
- create: the same body; a fixed name is renamed as above, generateName (Events) kept as it is.
- update (PUT): the same body without its resourceVersion, with the annotation.
- delete: only of an object this replay created (renamed likewise); any other delete is left out and
  counted in `Plan.skipped`, as are writes that failed in the operator's run (code >= 400).

Writes to one object (its status included) form a chain, sent in their original order one at a time,
as the operator sends a node's steps; chains run `concurrency` at a time.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

FLOOR_ANNOTATION = "bench.proxyshift.io/write-floor"
FLOOR_PREFIX = "bench-floor-"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
METHODS = {"create": "POST", "update": "PUT", "patch": "PATCH", "delete": "DELETE"}
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
JSON = "application/json"
RETRY_CODES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Write:
    """One HTTP request of the replay."""

    method: str
    uri: str                  # path and query, as the operator sent it (or renamed)
    content_type: str | None
    body: bytes | None
    kind: str                 # "patch proxynodes/status": the audit's verb and resource, for the tables
    chain: str                # the object: writes of one chain go in order, one at a time
    repeat: bool = False      # the same body as the chain's previous write: a no-op then, and now


@dataclass
class Plan:
    writes: list[Write] = field(default_factory=list)
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)  # "why: kind" -> count
    original_body_bytes: int = 0

    def chains(self) -> list[list[Write]]:
        """The chains in the order of their first write."""
        by: dict[str, list[Write]] = {}
        for w in self.writes:
            by.setdefault(w.chain, []).append(w)
        return list(by.values())

    def kinds(self) -> collections.Counter[str]:
        return collections.Counter(w.kind for w in self.writes)

    def body_bytes(self) -> int:
        return sum(len(w.body or b"") for w in self.writes)


def kind_of(verb: str, ref: dict[str, Any]) -> str:
    """The audit key bench_controller_scale.audit_counts uses: "patch proxynodes/status"."""
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{verb} {ref.get('resource', '?')}{sub}"


def builtin_group(group: str) -> bool:
    # Built-in APIs are the core group ("") and groups without a dot or under k8s.io; a CRD's group has
    # a dot and is not under k8s.io (that needs an approval annotation nobody here has).
    return "." not in group or group.endswith(".k8s.io")


def patch_type(body: Any, ref: dict[str, Any]) -> str:
    """The content type the kubernetes client sent (see the module docstring): not in the audit log."""
    if isinstance(body, list):
        return JSON_PATCH
    if isinstance(body, dict) and "apiVersion" in body and "kind" in body:
        return APPLY_PATCH
    return STRATEGIC_PATCH if builtin_group(ref.get("apiGroup") or "") else MERGE_PATCH


def _annotated(body: dict[str, Any], seq: int) -> dict[str, Any]:
    meta = dict(body.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}), FLOOR_ANNOTATION: str(seq)}
    return {**body, "metadata": meta}


def _renamed(name: str, seq: int) -> str:
    return f"{FLOOR_PREFIX}{seq}-{name}"[:253]


def _with_last_segment(uri: str, name: str) -> str:
    parts = urlsplit(uri)
    path = parts.path.rsplit("/", 1)[0] + "/" + name
    return urlunsplit(("", "", path, parts.query, ""))


def _object_path(uri: str, ref: dict[str, Any]) -> str:
    """The object's own path (the chain key): the URI without query and without its subresource."""
    path = urlsplit(uri).path
    if ref.get("subresource") and path.endswith("/" + ref["subresource"]):
        path = path[: -len(ref["subresource"]) - 1]
    return path


def _dump(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def plan(events: Iterable[dict[str, Any]], user: str) -> Plan:
    """The replay of `user`'s successful writes among audit `events` (decoded JSON lines, any order of
    stages; only ResponseComplete counts)."""
    out = Plan()
    renamed: dict[str, str] = {}  # object path in the operator's run -> path of the replay's copy
    last_body: dict[str, bytes] = {}  # chain -> the original body of its previous write
    seq = 0
    for ev in events:
        if ev.get("stage") != "ResponseComplete" or (ev.get("user") or {}).get("username") != user:
            continue
        verb = ev.get("verb", "")
        if verb not in WRITE_VERBS:
            continue
        ref = ev.get("objectRef") or {}
        kind = kind_of(verb, ref)
        code = int((ev.get("responseStatus") or {}).get("code") or 0)
        if code >= 400 or code == 0:
            out.skipped[f"failed in the rollout: {kind}"] += 1
            continue
        if verb not in METHODS:
            out.skipped[f"not replayed: {kind}"] += 1
            continue
        uri: str = ev["requestURI"]
        body = ev.get("requestObject")
        if body is not None:
            out.original_body_bytes += len(_dump(body))
        seq += 1
        chain = _object_path(uri, ref)
        original = _dump(body)
        repeat = last_body.get(chain) == original
        last_body[chain] = original
        ctype: str | None = JSON
        if verb == "delete":
            target = renamed.get(chain)
            if target is None:
                out.skipped[f"delete of an object the replay did not create: {kind}"] += 1
                continue
            out.writes.append(Write("DELETE", target, JSON if body is not None else None,
                                    _dump(body) if body is not None else None, kind, target))
            continue
        if not isinstance(body, dict | list):
            out.skipped[f"no request body in the audit log: {kind}"] += 1
            continue
        if verb == "patch":
            ctype = patch_type(body, ref)
            if code == 201 and isinstance(body, dict):
                # An apply that created the object: create a copy under a new name instead.
                new_name = _renamed(ref.get("name") or "x", seq)
                body = {**body, "metadata": {**(body.get("metadata") or {}), "name": new_name}}
                uri = _with_last_segment(uri, new_name)
                renamed[chain] = urlsplit(uri).path
                chain = renamed[chain]
        elif verb == "create" and isinstance(body, dict):
            meta = body.get("metadata") or {}
            if meta.get("name"):
                new_name = _renamed(meta["name"], seq)
                body = {**body, "metadata": {**meta, "name": new_name}}
                created = urlsplit(uri).path.rstrip("/") + "/" + new_name
                renamed[urlsplit(uri).path.rstrip("/") + "/" + meta["name"]] = created
                chain = created
            else:
                chain = f"create #{seq}"  # generateName: every create is its own object
        elif verb == "update" and isinstance(body, dict):
            body = {**body, "metadata": {k: v for k, v in (body.get("metadata") or {}).items()
                                         if k != "resourceVersion"}}
        if isinstance(body, list):
            body = [op for op in body if not (op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion")]
            if not repeat and any(str(op.get("path", "")).startswith("/metadata/annotations/") for op in body):
                body.append({"op": "add", "path": "/metadata/annotations/" + FLOOR_ANNOTATION.replace("/", "~1"),
                             "value": str(seq)})
        elif not repeat:
            body = _annotated(body, seq)
        out.writes.append(Write(METHODS[verb], uri, ctype, _dump(body), kind, chain, repeat))
    return out


def read_audit(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The audit log's events from byte `offset` on (one JSON object per line)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Floor:
    seconds: float = 0.0
    sent: int = 0
    concurrency: int = 0
    codes: collections.Counter[int] = field(default_factory=collections.Counter)
    retries: int = 0
    noops: int = 0            # a write whose answer kept the chain's previous resourceVersion
    repeats: int = 0          # of which writes planned as no-ops (Write.repeat)
    errors: list[str] = field(default_factory=list)


def replay(writes_plan: Plan, server: str, *, ca: Path, cert: Path, key: Path, concurrency: int,
           timeout: float = 60.0) -> Floor:
    """Send the plan to `server` (https://host:port) as the client certificate `cert`; returns the time."""
    import urllib3  # here, not at import: importing this module does no I/O and pulls no HTTP stack

    http = urllib3.PoolManager(num_pools=1, maxsize=concurrency, block=True, cert_reqs="CERT_REQUIRED",
                               ca_certs=str(ca), cert_file=str(cert), key_file=str(key),
                               retries=False, timeout=urllib3.Timeout(total=timeout))
    chains = writes_plan.chains()
    result = Floor(concurrency=concurrency)
    lock = threading.Lock()
    next_chain = [0]

    def send(w: Write) -> tuple[int, bytes]:
        headers = {"Accept": JSON}
        if w.content_type:
            headers["Content-Type"] = w.content_type
        for attempt in range(4):
            resp = http.request(w.method, server + w.uri, body=w.body, headers=headers, preload_content=True)
            if resp.status not in RETRY_CODES or attempt == 3:
                return resp.status, resp.data
            with lock:
                result.retries += 1
            time.sleep(0.1 * (attempt + 1))  # the server asked to slow down: back off briefly, then again
        raise AssertionError("unreachable")

    def worker() -> None:
        while True:
            with lock:
                if next_chain[0] >= len(chains):
                    return
                chain = chains[next_chain[0]]
                next_chain[0] += 1
            last_rv: str | None = None
            for w in chain:
                try:
                    status, data = send(w)
                except Exception as exc:  # report and go on: a floor with holes must say so, not stop
                    with lock:
                        result.errors.append(f"{w.kind} {w.uri}: {exc!r}")
                    continue
                rv = None
                if status < 300 and w.method in ("PATCH", "PUT"):
                    rv = (json.loads(data).get("metadata") or {}).get("resourceVersion")
                with lock:
                    result.sent += 1
                    result.codes[status] += 1
                    if status >= 300 and len(result.errors) < 20:
                        result.errors.append(f"{w.kind} {w.uri}: {status} {data[:200]!r}")
                    if rv is not None and rv == last_rv:
                        result.noops += 1
                        result.repeats += w.repeat
                last_rv = rv if rv is not None else last_rv

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - start
    http.clear()
    return result
