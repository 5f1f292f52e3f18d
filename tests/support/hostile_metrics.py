"""Generated worst cases for the cost of parsing kube-proxy's /metrics text (issue 15).

Shared by tests/unit/test_metrics_kube_proxy.py (which asserts each case's verdict and a bound on the parse's
work) and bench/bench_metrics_parse.py (which prints their parse times).
"""

from __future__ import annotations

from collections.abc import Callable

from proxyshift.planner.metrics import MAX_LABELS, MAX_LINE_BYTES, MAX_LINES, MAX_TEXT_BYTES

# Each 8 MiB (the agent's read cap) unless said: text of only newlines or of short lines (a Python loop
# per line costs seconds), lines of the maximum length, huge label sets (prometheus_client's parser is
# quadratic in a line's labels). Each is built when it is used: together they are over 100 MB.
WANTED_BUCKET = "kubeproxy_sync_proxy_rules_duration_seconds_bucket"


def _fill(line: str, size: int = MAX_TEXT_BYTES) -> str:
    return line * (size // len(line))


def _line_of(prefix: str, suffix: str, length: int = MAX_LINE_BYTES) -> str:
    """prefix + padding + suffix, exactly `length` characters without its newline."""
    return prefix + "y" * (length - len(prefix) - len(suffix)) + suffix + "\n"


# The line length (newline included) at which 8 MiB is just within MAX_LINES lines.
_AT_MAX_LINES = -(-MAX_TEXT_BYTES // MAX_LINES)
_LABELS_230 = ",".join(f'l{i}="v"' for i in range(230))  # 1,975 bytes: under the line bound
INVALID = "InvalidMetrics"
# name -> (text builder, the gate's reason). Every case but one is refused; 8 MiB of maximum-length
# lines of kubeproxy_ metrics the gate does not read is within every bound and could be a kube-proxy
# that does not export the gate's metrics yet: the verdict is to wait for them (MetricMissing), which
# the gate timeout ends.
WORST_CASES: dict[str, tuple[Callable[[], str], str]] = {
    "newlines-only": (lambda: "\n" * MAX_TEXT_BYTES, INVALID),
    "x-1-repeated": (lambda: _fill("x 1\n"), INVALID),
    "wanted-metric-repeated": (lambda: _fill("process_start_time_seconds 1\n"), INVALID),
    "wanted-help-repeated": (lambda: _fill("# HELP process_start_time_seconds x\n"), INVALID),
    "max-lines-of-8MiB": (lambda: _fill("a" * (_AT_MAX_LINES - 3) + " 1\n"), INVALID),
    "max-lines-of-wanted-help": (lambda: _fill(_line_of("# HELP process_start_time_seconds ", "",
                                                        _AT_MAX_LINES - 1)), INVALID),
    "max-length-lines-of-other-metrics": (lambda: _fill(_line_of('go_x{a="', '"} 1')), INVALID),
    "max-length-lines-of-kube-proxy-metrics-not-read": (lambda: _fill(_line_of('kubeproxy_x{a="', '"} 1')),
                                                        "MetricMissing"),
    "max-length-lines-wanted": (lambda: _fill(_line_of(WANTED_BUCKET + '{le="1",x="', '"} 1')), INVALID),
    # The most the parser may be handed: the selected-line bound of maximum-length wanted lines (1 MiB).
    "511-max-length-wanted-lines": (lambda: _line_of(WANTED_BUCKET + '{le="1",x="', '"} 1') * 511, INVALID),
    "511-max-length-wanted-lines-max-labels": (lambda: _line_of(
        WANTED_BUCKET + '{le="1",' + "".join(f'l{i}="v",' for i in range(MAX_LABELS - 2)) + 'z="', '"} 1') * 511,
        INVALID),
    # Both costs at once: the line loop's over 43,000 short lines, then the parser's over the 511 lines.
    "short-lines-then-511-max-length-wanted-lines": (lambda: (
        _fill("a" * (_AT_MAX_LINES - 3) + " 1\n", MAX_TEXT_BYTES - 511 * (MAX_LINE_BYTES + 1))
        + _line_of(WANTED_BUCKET + '{le="1",x="', '"} 1') * 511), INVALID),
    "511-wanted-lines-of-230-labels": (lambda: (WANTED_BUCKET + "{" + _LABELS_230 + "} 1\n") * 511, INVALID),
    "huge-label-sets-under-the-line-bound": (lambda: _fill(WANTED_BUCKET + "{" + _LABELS_230 + "} 1\n"),
                                             INVALID),
    "huge-label-sets-of-other-metrics": (lambda: _fill("go_x{" + _LABELS_230 + "} 1\n"), INVALID),
    "one-line-of-10^5-labels": (lambda: (WANTED_BUCKET + "{" + ",".join(f'l{i}="v"' for i in range(10**5))
                                         + "} 1\n"), INVALID),
    "one-8MiB-line": (lambda: ("kubeproxy_sync_proxy_rules_last_timestamp_seconds{"
                               + ",".join(f'l{i}="v"' for i in range(MAX_TEXT_BYTES // 8)))[:MAX_TEXT_BYTES],
                      INVALID),
}
