"""What server-side apply cannot do for a revision object: change a field the API server keeps immutable.

A DaemonSet's `spec.selector` cannot change after creation; an apply that changes it is refused (422).
The selector is the baseline's plus the revision label, so it only moves when the baseline DaemonSet was
recreated with another selector; then the revision DaemonSet must be deleted and created again.
Everything else about bringing a live revision to its rendering is the API server's job (render/apply.py).
"""

from __future__ import annotations

from typing import Any

# Immutable after creation (JSON pointers): a change here needs delete + create.
IMMUTABLE = ("/spec/selector",)


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
