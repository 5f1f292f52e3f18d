"""When an existing revision needs applying again, so that a plan does not apply it for nothing.

Every plan asks to keep the policy's current revision as rendered (planner EnsureRevision, existing=True).
Applying it costs two GETs of the baseline, a render and two server-side applies: about 0.1 s of API round
trips at the end of every plan, which is what the next node's step waits behind (issue 13: it was a tenth
of each node's own time in the rollout benchmark). The rendering changes only when one of its inputs does,
and each input is watched: the policy's spec (a new spec is a new revision name, applied as new), the
baseline ConfigMap's data and the baseline DaemonSet's spec (their index handlers), and the revision
DaemonSet itself, when someone else edits it (its generation moves; the revisions' mirror,
controller/fleet.py). So a revision is applied again when an input moved since its last apply, and
otherwise at most every `interval_seconds`: the revision ConfigMap is not watched, and the interval
bounds how long an edit to it stays.

Touched from both sides: the index handlers and the revisions' mirror (event loop) call `saw`, the
executor (a worker thread) calls `due` and `applied`. Each is one dict operation, atomic under the
GIL; an input that moves while the revision is being applied is applied again at the next interval at
the latest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

BASELINE = "baseline"  # the source key of every baseline input: they feed every revision


@dataclass
class RevisionKeeper:
    interval_seconds: float
    clock: Callable[[], float] = time.monotonic
    _applied_at: dict[str, float] = field(default_factory=dict)  # revision -> clock() of its last apply
    _seen: dict[str, Hashable] = field(default_factory=dict)  # input -> the version last seen

    def due(self, revision: str) -> bool:
        """Whether keeping `revision` as rendered needs an apply now."""
        at = self._applied_at.get(revision)
        return at is None or self.clock() - at >= self.interval_seconds

    def applied(self, revision: str) -> None:
        self._applied_at[revision] = self.clock()

    def saw(self, source: str, version: Hashable, revision: str | None = None) -> None:
        """An input of the rendering was seen at `version`: the baseline's (`revision` None: every revision
        depends on it) or one revision's own DaemonSet. When it moved, the revisions it feeds are due."""
        key = f"{BASELINE}/{source}" if revision is None else f"revision/{revision}/{source}"
        moved = key in self._seen and self._seen[key] != version
        self._seen[key] = version
        if not moved:
            return
        if revision is None:
            self._applied_at.clear()
        else:
            self._applied_at.pop(revision, None)
