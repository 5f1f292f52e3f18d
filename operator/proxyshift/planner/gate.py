"""Does the new kube-proxy prove itself? Pure evaluation of the facts the agent read on the node.

The verdict is "pass", "wait" (not proven yet: look again) or "fail" (proven wrong: roll back).
Timeouts are the state machine's business, not this module's: a gate that keeps saying "wait"
is turned into a rollback by the machine, with the last verdict's message as the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from proxyshift.api.policy import GateSettings
from proxyshift.api.proxynode import KubeProxyFacts
from proxyshift.api.replacement import HOST_ENDPOINT_READY, ReplacementFacts
from proxyshift.planner.timeutil import fmt, utc

# The switch time is the operator's clock, the process start time the node's; NTP keeps them close
# but not equal. A process that started up to this long "before" the switch still counts as new.
CLOCK_SKEW_SECONDS = 5.0

Result = Literal["pass", "wait", "fail"]


@dataclass(frozen=True)
class GateVerdict:
    result: Result
    reason: str  # CamelCase, used as the Event and condition reason
    message: str  # for a person

    @property
    def passed(self) -> bool:
        return self.result == "pass"


def _bad_number(value: float | int | None) -> bool:
    return value is not None and (isinstance(value, float) and (math.isnan(value) or math.isinf(value)))


def _ts(value: float) -> str:
    try:
        return fmt(datetime.fromtimestamp(value, tz=UTC))
    except (OverflowError, OSError, ValueError):
        return repr(value)


def _connect_failures(results: Mapping[str, bool | str]) -> list[str]:
    failures = []
    for target, outcome in sorted(results.items()):
        if outcome is True or outcome == "ok" or outcome == "":
            continue
        failures.append(f"{target} ({outcome})" if isinstance(outcome, str) else target)
    return failures


def _probe_services_verdict(gate: GateSettings, connect_results: Mapping[str, bool | str] | None) -> GateVerdict | None:
    """The policy's probe Services, from the node: wait for the connects, fail on any that failed (None: go on)."""
    if not gate.probe_services:
        return None
    if connect_results is None:
        return GateVerdict("wait", "ProbePending", "the TCP connects to the probe services have not run yet")
    failed = _connect_failures(connect_results)
    if failed:
        return GateVerdict("fail", "ServiceUnreachable", "TCP connect failed from the node to " + ", ".join(failed[:5]))
    return None


def evaluate_gate(
    facts: KubeProxyFacts | None,
    gate: GateSettings,
    target_mode: str,
    switched_at: datetime,
    now: datetime,
    connect_results: Mapping[str, bool | str] | None = None,
    *,
    skew_seconds: float = CLOCK_SKEW_SECONDS,
) -> GateVerdict:
    """Judge the node's kube-proxy against the gate. `connect_results`: target -> True or an error.

    Order matters: first make sure we are looking at the new process (otherwise everything we read
    describes the old one, which is expected to be "wrong"), then look for proof of failure, and only
    then for things that are merely not there yet.
    """
    if facts is None:
        return GateVerdict("wait", "NoProbeYet", "the agent has not reported kube-proxy facts yet")
    if facts.metrics_invalid:
        # kube-proxy answered, with text that is malformed or reports impossible values. The gate runs only
        # once the new pod is Ready, so this is the new process talking nonsense: waiting would only turn
        # it into a GateTimeout that hides the cause.
        return GateVerdict("fail", "InvalidMetrics",
                           f"kube-proxy's /metrics answer is refused: {facts.metrics_invalid}")
    if facts.error:
        return GateVerdict("wait", "KubeProxyUnreachable", f"the agent could not read kube-proxy: {facts.error}")

    switch_ts = utc(switched_at).timestamp()
    start = facts.process_start_time
    if start is None:
        return GateVerdict("wait", "MetricMissing", "kube-proxy does not export process_start_time_seconds yet")
    if _bad_number(start) or start <= 0:
        return GateVerdict("fail", "InvalidMetrics", f"process_start_time_seconds is {start!r}, not a time")
    if start < switch_ts - skew_seconds:
        return GateVerdict(
            "wait",
            "OldProcess",
            f"the kube-proxy answering started at {_ts(start)}, before the switch at {fmt(switched_at)} "
            f"(allowing {skew_seconds:g}s of clock skew): the new process is not up yet",
        )
    if start > utc(now).timestamp() + 60:
        # The node's clock is ahead of ours by more than a minute: "after the switch" proves nothing.
        return GateVerdict(
            "wait", "NodeClockAhead",
            f"kube-proxy claims it started at {_ts(start)}, in the future: the node's clock is off",
        )

    mode = (facts.proxy_mode or "").strip()
    if not mode:
        return GateVerdict("wait", "ModeUnknown", "/proxyMode has not answered yet")
    if mode != target_mode:
        return GateVerdict(
            "fail", "WrongMode", f"the new kube-proxy process runs in {mode!r} mode, expected {target_mode!r}"
        )

    for name, value in (
        ("last sync timestamp", facts.last_sync_timestamp),
        ("sync count", facts.sync_count),
        ("sync failures", facts.sync_failures),
        ("sync duration p99", facts.sync_duration_p99_seconds),
    ):
        if value is None:
            continue
        if isinstance(value, float) and math.isnan(value):
            return GateVerdict("fail", "InvalidMetrics", f"kube-proxy's {name} is NaN")
        if value < 0:
            return GateVerdict("fail", "InvalidMetrics", f"kube-proxy's {name} is negative ({value!r})")

    # The process is new, so its counters started at zero: any failure counted is a failure since
    # the switch. A missing counter means neither restore/sync failure metric is exported; that is
    # not evidence of a failure, and the sync checks below still have to pass.
    failures = facts.sync_failures or 0
    if _bad_number(failures):
        return GateVerdict("fail", "InvalidMetrics", f"kube-proxy's sync failures is {failures!r}")
    if failures > 0:
        return GateVerdict(
            "fail", "SyncFailures", f"the new kube-proxy counted {failures:g} failed rule syncs since it started"
        )

    p99 = facts.sync_duration_p99_seconds
    bound = gate.max_sync_duration_seconds
    if bound is not None and p99 is not None and p99 > bound:
        shown = "above the largest histogram bucket" if math.isinf(p99) else f"{p99:.3f}s"
        return GateVerdict(
            "fail", "SyncTooSlow", f"rule sync p99 is {shown}, over the policy's bound of {bound:g}s"
        )

    last = facts.last_sync_timestamp
    # Both sides of this comparison come from the node's clock, so no skew allowance is needed.
    if last is None or last <= 0 or last < start:
        return GateVerdict("wait", "NotSynced", "the new kube-proxy has not completed a rule sync yet")
    if last < switch_ts - skew_seconds:
        return GateVerdict(
            "wait", "NotSynced", f"the last rule sync ({_ts(last)}) is older than the switch ({fmt(switched_at)})"
        )
    count = facts.sync_count
    if count is None:
        return GateVerdict("wait", "MetricMissing", "kube-proxy does not export its sync-duration histogram yet")
    if count < gate.min_syncs:
        return GateVerdict("wait", "NotEnoughSyncs", f"{count} of {gate.min_syncs} rule syncs done")
    if bound is not None and p99 is None:
        return GateVerdict("wait", "MetricMissing", "no sync-duration p99 yet to compare with the bound")

    if gate.healthz:
        if facts.healthz_status is None:
            return GateVerdict("wait", "HealthzPending", "/healthz has not answered yet")
        if facts.healthz_status != 200:
            return GateVerdict("wait", "Unhealthy", f"/healthz answers {facts.healthz_status}, not 200")

    probed = _probe_services_verdict(gate, connect_results)
    if probed is not None:
        return probed

    parts = [f"mode {mode}", f"{count} syncs since {_ts(start)}", "no sync failures"]
    if bound is not None and p99 is not None:
        parts.append(f"p99 {p99:.3f}s <= {bound:g}s")
    if gate.healthz:
        parts.append("/healthz 200")
    if gate.probe_services:
        parts.append(f"{len(connect_results or {})} service connects ok")
    return GateVerdict("pass", "GatePassed", "kube-proxy proved itself: " + ", ".join(parts))


def evaluate_replacement_gate(
    facts: ReplacementFacts | None,
    gate: GateSettings,
    agent: str,
    expected_frontends: int,
    connect_results: Mapping[str, bool | str] | None = None,
) -> GateVerdict:
    """Judge a node that runs no kube-proxy by its replacement's own account (Cilium's /v1/healthz and
    /v1/service and /v1/endpoint, read by the agent): the replacement agent answers and is Ok, it says it replaces
    kube-proxy, its Service table holds every frontend the operator asked about and at least as many ClusterIP
    frontends as the cluster's Services have, its host endpoint is ready; then the policy's probe Services answer.

    Everything short of that is "wait": an agent still starting, or one that has not read its per-node config
    yet, may come right within gate.timeout; a timeout rolls the node back to its kube-proxy.
    """
    if facts is None:
        return GateVerdict("wait", "NoProbeYet", f"the agent has not reported {agent}'s state yet")
    if facts.error and facts.agent_state is None:
        return GateVerdict("wait", "ReplacementUnreachable",
                           f"{agent}'s agent on the node does not answer (is its pod running and Ready there?): "
                           f"{facts.error}")
    if facts.agent_state != "Ok":
        said = f" ({facts.agent_message})" if facts.agent_message else ""
        return GateVerdict("wait", "ReplacementNotReady", f"{agent}'s agent reports {facts.agent_state}{said}")
    if not facts.enabled:
        return GateVerdict("wait", "ReplacementOff",
                           f"{agent} answers but its kube-proxy replacement is {facts.kube_proxy_replacement!r}: "
                           "its agent on the node has not read the revision's node config (it reads it at start)")
    # Cilium's health turns Ok and its table fills seconds before its host endpoint has loaded the datapath on
    # the node's devices (bpf_host): until then NodePorts and traffic entering the node are not served yet.
    # Judged before the table: the agent reads its endpoints first and the table (up to 32 MiB) only once the
    # host endpoint is ready. An agent older than the field reports None, and then this is not judged.
    if facts.host_endpoint is not None and facts.host_endpoint != HOST_ENDPOINT_READY:
        return GateVerdict("wait", "HostDatapathNotReady",
                           f"{agent}'s host endpoint is {facts.host_endpoint!r}, not ready: its datapath on the "
                           "node's devices is not loaded yet")
    if facts.cluster_ip_frontends is None:
        return GateVerdict("wait", "ServiceTableUnread",
                           f"{agent}'s Service table was not read: {facts.error or 'not reported'}")
    if facts.error:
        return GateVerdict("wait", "HostEndpointUnread", f"{agent}'s endpoints were not read: {facts.error}")
    if facts.missing_count:
        shown = ", ".join(facts.missing[:5]) + (f" and {facts.missing_count - 5} more" if facts.missing_count > 5
                                                 else "")
        return GateVerdict("wait", "ServicesMissing", f"{agent}'s Service table lacks {shown}")
    if facts.cluster_ip_frontends < expected_frontends:
        return GateVerdict("wait", "ServicesMissing",
                           f"{agent}'s Service table holds {facts.cluster_ip_frontends} ClusterIP frontends, the "
                           f"cluster's Services have {expected_frontends}")
    probed = _probe_services_verdict(gate, connect_results)
    if probed is not None:
        return probed
    parts = [f"{agent} Ok", f"kube-proxy replacement {facts.kube_proxy_replacement}",
             f"{facts.cluster_ip_frontends} ClusterIP frontends (the cluster has {expected_frontends})"]
    if facts.host_endpoint is not None:
        parts.append("host endpoint ready")
    if gate.probe_services:
        parts.append(f"{len(connect_results or {})} service connects ok")
    return GateVerdict("pass", "GatePassed", f"{agent}'s kube-proxy replacement proved itself: " + ", ".join(parts))
