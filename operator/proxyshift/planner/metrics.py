"""Pure parsing of kube-proxy's /metrics text into the facts the gate judges.

The text is parsed with prometheus_client's own parser (never regexes). Metric
names are kube-proxy's (pkg/proxy/metrics, 1.33-1.37). Since 1.33 most of them
carry an `ip_family` label; on a dual-stack node the facts are combined so that
they hold for every family: the oldest last-sync time, the smallest sync
count, the sum of failures, and the p99 of both families' histograms merged.

Anything that is not a sane number (NaN, infinite, negative, beyond 2^53 for a
counter, a timestamp after the year 2200, buckets that are not cumulative) is a
MetricsError with a message naming the metric: a kube-proxy that reports
nonsense must not pass a gate by accident.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from proxyshift.api.proxynode import KubeProxyFacts

PROCESS_START = "process_start_time_seconds"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
SYNC_DURATION = "kubeproxy_sync_proxy_rules_duration_seconds"
# Counted as "sync failures": a failed iptables-restore (iptables and ipvs modes) and a failed
# nft transaction (nftables mode). Partial-restore failures are retried as a full sync and
# counted there if that fails too, so they are not added.
FAILURE_COUNTERS = (
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
)

MAX_TEXT_BYTES = 8 * 1024 * 1024
# Every bound below exists so that the parse of the 8 MiB the agent may read stays linear and small
# whatever answers on the metrics port. prometheus_client's parser is quadratic in a line's labels
# (2.6 s for one 200 KB line here, hours for 8 MiB) and reads 8 MiB of ordinary text in over a second,
# and even a Python loop over 8 million empty lines costs seconds, so:
#
# - the text's lines are counted (str.count, C speed) before any per-line Python work: kube-proxy
#   v1.37.2 exports about 1,100 lines (tests/fixtures/metrics), none of them per Service or Endpoint,
#   so 50,000 is 45 times that and still a loop of milliseconds;
# - a line is at most MAX_LINE_BYTES: kube-proxy's longest is under 600 bytes (a handful of labels);
# - only the lines of the metrics the gate reads (with their TYPE/HELP) reach the parser, at most
#   MAX_SELECTED_LINES of them (kube-proxy: 41 samples and 12 comments, dual-stack), each with at most
#   MAX_LABELS labels (kube-proxy's carry two: ip_family and le).
#
# The result for text past any bound is a MetricsError naming the bound, which the gate turns into
# InvalidMetrics. bench/bench_metrics_parse.py times the worst cases (docs/benchmarks.md).
MAX_LINES = 50_000
MAX_LINE_BYTES = 2048
MAX_SELECTED_LINES = 512
MAX_LABELS = 8
MAX_COUNTER = float(2**53)           # beyond this a float no longer counts exactly
MAX_TIMESTAMP = 7258118400.0         # 2200-01-01: later is not a clock, it is garbage


class MetricsError(ValueError):
    """The /metrics text is malformed or reports impossible values."""


WANTED = frozenset({PROCESS_START, LAST_SYNC, *FAILURE_COUNTERS,
                    *(SYNC_DURATION + suffix for suffix in ("_bucket", "_count", "_sum"))})
WANTED_FAMILIES = frozenset({PROCESS_START, LAST_SYNC, SYNC_DURATION, *FAILURE_COUNTERS})


def _metric_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        found = line.find(stop)
        if found != -1:
            end = min(end, found)
    return line[:end]


def select_lines(text: str) -> tuple[str, bool]:
    """The lines of the metrics proxyshift reads (with their TYPE/HELP), and whether any kube-proxy metric
    appeared at all. Linear in the text, at most MAX_LINES loop turns; everything else kube-proxy exports
    is never parsed. MetricsError when the text is past one of the bounds above."""
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines > MAX_LINES:
        raise MetricsError(f"{lines} lines is not kube-proxy's metrics (limit {MAX_LINES} lines; "
                           "kube-proxy exports about 1,100)")
    kept: list[str] = []
    seen_kube_proxy = False
    for line in text.split("\n"):
        if len(line) > MAX_LINE_BYTES:
            raise MetricsError(f"a {len(line)}-byte line ({line[:60]!r}...) is not kube-proxy's "
                               f"(limit {MAX_LINE_BYTES} bytes a line)")
        if line.startswith("#"):
            parts = line.split(None, 3)
            if not (len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in WANTED_FAMILIES):
                continue
        else:
            name = _metric_name(line)
            seen_kube_proxy = seen_kube_proxy or name.startswith("kubeproxy_")
            if name not in WANTED:
                continue
            # Each label is name="value": a count of '=' bounds the labels (a '=' inside a value only
            # makes the count larger, so nothing over the bound slips through).
            if line.count("=") > MAX_LABELS:
                raise MetricsError(f"{name} has more than {MAX_LABELS} labels on a line "
                                   "(kube-proxy's carry two)")
        if len(kept) == MAX_SELECTED_LINES:
            raise MetricsError(f"more than {MAX_SELECTED_LINES} lines of the metrics the gate reads")
        kept.append(line)
    return "\n".join(kept) + "\n", seen_kube_proxy


def _family_key(labels: dict[str, str]) -> str:
    return labels.get("ip_family", "")


def _check_number(name: str, value: float, *, maximum: float) -> float:
    if math.isnan(value):
        raise MetricsError(f"{name} is NaN")
    if math.isinf(value):
        raise MetricsError(f"{name} is infinite")
    if value < 0:
        raise MetricsError(f"{name} is negative ({value!r})")
    if value > maximum:
        raise MetricsError(f"{name} is implausibly large ({value!r})")
    return value


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile from cumulative (upper bound, count) buckets, as Prometheus estimates it.

    Linear interpolation inside the bucket holding the rank. When the rank lies in the
    +Inf bucket the answer is +Inf: all we know is "above the largest bucket", and a gate
    must treat that as too slow. None when the histogram has no observations.
    """
    points = sorted(buckets)
    if not points or not math.isinf(points[-1][0]):
        raise MetricsError("histogram has no +Inf bucket")
    total = points[-1][1]
    if total == 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in points:
        if count >= rank:
            if math.isinf(bound):
                return math.inf
            if count == prev_count:
                return bound
            lower = prev_bound if prev_bound < bound else 0.0
            return lower + (bound - lower) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return math.inf


def parse_kube_proxy_metrics(text: str, *, max_bytes: int = MAX_TEXT_BYTES) -> KubeProxyFacts:
    """The gate's facts from kube-proxy's /metrics text (proxy mode, healthz, time: the caller's)."""
    if len(text) > max_bytes:
        raise MetricsError(f"metrics text is {len(text)} bytes, over the {max_bytes}-byte limit")
    start: float | None = None
    last_sync: dict[str, float] = {}
    counts: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = defaultdict(dict)
    failures: float | None = None
    selected, seen_kube_proxy = select_lines(text)
    try:
        for family in text_string_to_metric_families(selected):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, float(sample.value)
                if name == PROCESS_START:
                    start = _check_number(name, value, maximum=MAX_TIMESTAMP)
                elif name == LAST_SYNC:
                    last_sync[_family_key(labels)] = _check_number(name, value, maximum=MAX_TIMESTAMP)
                elif name == SYNC_DURATION + "_count":
                    counts[_family_key(labels)] = _check_number(name, value, maximum=MAX_COUNTER)
                elif name == SYNC_DURATION + "_bucket":
                    try:
                        bound = float(labels["le"])
                    except (KeyError, ValueError) as exc:
                        raise MetricsError(f"{name} has a bucket without a numeric 'le' label") from exc
                    if math.isnan(bound):
                        raise MetricsError(f"{name} has a NaN bucket bound")
                    buckets[_family_key(labels)][bound] = _check_number(name, value, maximum=MAX_COUNTER)
                elif name in FAILURE_COUNTERS:
                    failures = (failures or 0.0) + _check_number(name, value, maximum=MAX_COUNTER)
    except MetricsError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"metrics text is not in the Prometheus text format: {exc}") from exc

    if start is None and not seen_kube_proxy:
        raise MetricsError("no kube-proxy metrics in the text (is this kube-proxy's metrics port?)")

    merged: dict[float, float] = defaultdict(float)
    for fam, fam_buckets in buckets.items():
        ordered = sorted(fam_buckets.items())
        for (_, a), (b_bound, b) in itertools.pairwise(ordered):
            if b < a:
                raise MetricsError(f"{SYNC_DURATION} buckets are not cumulative (le={b_bound:g} < previous)")
        if fam in counts and ordered and math.isinf(ordered[-1][0]) and ordered[-1][1] != counts[fam]:
            raise MetricsError(f"{SYNC_DURATION}: +Inf bucket ({ordered[-1][1]:g}) differs from _count "
                               f"({counts[fam]:g})")
        for bound, count in ordered:
            merged[bound] += count
    p99 = histogram_quantile(0.99, merged.items()) if merged else None

    return KubeProxyFacts(
        process_start_time=start,
        last_sync_timestamp=min(last_sync.values()) if last_sync else None,
        sync_count=int(min(counts.values())) if counts else None,
        sync_duration_p99_seconds=p99,
        sync_failures=int(failures) if failures is not None else None,
    )
