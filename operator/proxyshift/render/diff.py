"""The JSON patch that brings a live revision object (ConfigMap or DaemonSet) to its rendered form.

The live object has more than we rendered: server-owned metadata, status, and
the fields the API server defaults (imagePullPolicy, terminationMessagePath,
defaultMode, ...). A plain document diff would remove those every time and the
server would put them back: an endless update loop. So the comparison is
"desired is a subset of live": a key we render must have our value, a key we
do not render is left alone. Maps we own completely (ConfigMap data, pod
labels, the node selector) are compared exactly, so a key dropped from the
rendering is dropped live too. A list is compared item by item when the
lengths agree and replaced whole when they do not.
"""

from __future__ import annotations

from typing import Any

import jsonpatch

# Paths (JSON pointer) whose value is ours alone and must equal the rendering exactly.
EXACT = {
    "/data",
    "/binaryData",
    "/spec/template/metadata/labels",
    "/spec/template/spec/nodeSelector",
}
# Immutable after creation: a change here needs delete + create, see needs_recreate.
IMMUTABLE = {"/spec/selector"}
METADATA_COMPARED = ("labels", "annotations")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _walk(live: Any, desired: Any, path: str, ops: list[dict[str, Any]]) -> None:
    if path in IMMUTABLE:
        return
    if path in EXACT:
        if live != desired:
            ops.append({"op": "replace", "path": path, "value": desired})
        return
    if isinstance(desired, dict) and isinstance(live, dict):
        for key, value in desired.items():
            sub = f"{path}/{_escape(key)}"
            if key not in live:
                ops.append({"op": "add", "path": sub, "value": value})
            else:
                _walk(live[key], value, sub, ops)
        return
    if isinstance(desired, list) and isinstance(live, list) and len(desired) == len(live):
        for index, (live_item, desired_item) in enumerate(zip(live, desired, strict=True)):
            _walk(live_item, desired_item, f"{path}/{index}", ops)
        return
    if live != desired:
        ops.append({"op": "replace", "path": path, "value": desired})


def diff(live: dict[str, Any], desired: dict[str, Any]) -> jsonpatch.JsonPatch:
    """Patch for live -> desired on the fields the rendering owns. Empty patch: nothing to do."""
    ops: list[dict[str, Any]] = []
    live_meta = live.get("metadata") or {}
    for key in METADATA_COMPARED:
        if key in (desired.get("metadata") or {}):
            want = desired["metadata"][key]
            if key not in live_meta or live_meta[key] is None:
                ops.append({"op": "add", "path": f"/metadata/{key}", "value": want})
            else:
                _walk(live_meta[key], want, f"/metadata/{key}", ops)
    for key, value in desired.items():
        if key in ("apiVersion", "kind", "metadata", "status"):
            continue
        if key not in live:
            ops.append({"op": "add", "path": f"/{_escape(key)}", "value": value})
        else:
            _walk(live[key], value, f"/{_escape(key)}", ops)
    return jsonpatch.JsonPatch(ops)


def needs_recreate(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when an immutable field differs: the object must be deleted and created again."""
    return any(
        _get(live, path) != _get(desired, path) for path in IMMUTABLE if _get(desired, path) is not None
    )


def _get(doc: Any, pointer: str) -> Any:
    for part in pointer.strip("/").split("/"):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc
