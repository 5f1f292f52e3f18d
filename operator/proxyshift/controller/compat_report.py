"""Each policy's compatibility report (planner.compat), for its BehaviourChanges condition.

The report answers "what does the target mode change for this cluster's Services", so it is taken
when a policy's revision is first seen and again when the cluster's Services change, never on every
plan: the plan runs on every ProxyNode write, and the report walks every Service.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.planner.preview import BASELINE_SOURCE, CompatGroup, compat_preview
from proxyshift.planner.world import ServiceSide, World
from proxyshift.render.kubeproxyconfig import baseline_config, render_config

REFRESH_SECONDS = 300.0  # a report older than this is taken again even if nothing it counts changed


@dataclass
class CompatCache:
    """policy -> (what the report was taken for, the report)."""

    reports: dict[str, tuple[tuple[Any, ...], float, list[CompatGroup]]] = field(default_factory=dict)

    def report(self, world: World, policy: str, baseline_cm: Mapping[str, Any] | None,
               now: float | None = None) -> list[CompatGroup] | None:
        target = world.current_revisions.get(policy)
        spec = world.policies[policy].spec if policy in world.policies else None
        if target is None or spec is None or baseline_cm is None:
            return None
        side: ServiceSide = world.services
        key = (target.name, len(side.services), len(side.endpoints), tuple(sorted(world.revisions)))
        now = time.monotonic() if now is None else now
        cached = self.reports.get(policy)
        if cached is not None and cached[0] == key and now - cached[1] < REFRESH_SECONDS:
            return cached[2]
        try:
            baseline = baseline_config(dict(baseline_cm))
        except (ValueError, KeyError):
            return None  # the policy is Degraded with BaselineUnreadable already
        # Revision sources: their mode is known, their config is assumed kube-proxy's defaults for it.
        configs: dict[str, KubeProxyConfiguration | None] = {BASELINE_SOURCE: baseline}
        groups = compat_preview(world, policy, configs, render_config(spec, baseline),
                                side.services.values(), side.endpoints)
        self.reports[policy] = (key, now, groups)
        return groups

    def forget(self, policy: str) -> None:
        self.reports.pop(policy, None)
