"""The seed of `proxyshift plan`'s advice: what moving a cluster of this size to nftables buys.

Pure: no I/O. The numbers are kube-proxy v1.37.2's own metrics, measured side
by side in both modes by bench/bench_kube_proxy_modes.py (docs/benchmarks.md,
"What the move buys"), for Services of 3 endpoints each. Between the measured
sizes the costs are interpolated linearly; beyond the largest they are
extrapolated along the last segment, which understates iptables' cost (its
cold full sync grows superlinearly: 0.4 s, 22 s, 387 s for 1k, 5k, 10k), so
the advice errs on the modest side; below the smallest they scale down
proportionally towards zero.

Size is counted in "units" because a Service and each of its endpoints both
cost kube-proxy rules (a KUBE-SVC chain, a KUBE-SEP chain per endpoint in
iptables mode; a service chain and map elements in nftables mode): a measured
Service with 3 endpoints is 4 units, so any (services, endpoints) pair maps to
(services + endpoints) / 4 measured-Service equivalents.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyshift.modes import MODE_FACTS, MODES, Mode, is_mode
from proxyshift.modes.nftables import FACTS as NFTABLES

# The mode the advice recommends; bench_kube_proxy_modes.py measured it against iptables mode (Measured's columns).
ADVISED_MODE: Mode = NFTABLES.mode

UNITS_PER_MEASURED_SERVICE = 4  # 1 Service + 3 endpoints, as benchmarked
# Below this saving per full sync, speed alone is no reason to move a fleet.
MIN_SAVING_SECONDS = 0.1


@dataclass(frozen=True)
class Measured:
    """Medians at one size, seconds (bench_kube_proxy_modes.py)."""

    services: int
    iptables_full_sync: float
    nftables_full_sync: float
    iptables_programming: float  # EndpointSlice change -> rules in the kernel
    nftables_programming: float


# bench/bench_kube_proxy_modes.py --services 1000,5000,10000 --runs 3 --changes 5, 2026-11-30
# (docs/benchmarks.md): medians of the cold full sync and of the programming latency.
MEASURED: tuple[Measured, ...] = (
    Measured(1000, 0.414, 0.273, 0.0949, 0.0369),
    Measured(5000, 22.490, 3.858, 0.6011, 0.1339),
    Measured(10000, 386.662, 28.393, 2.5128, 0.4411),
)


@dataclass(frozen=True)
class Estimate:
    iptables_full_sync: float
    nftables_full_sync: float
    iptables_programming: float
    nftables_programming: float

    @property
    def sync_ratio(self) -> float:
        return self.iptables_full_sync / self.nftables_full_sync

    @property
    def programming_ratio(self) -> float:
        return self.iptables_programming / self.nftables_programming


def _interpolate(size: float, xs: list[float], ys: list[float]) -> float:
    if size <= xs[0]:
        return ys[0] * size / xs[0]
    for i in range(1, len(xs)):
        if size <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (size - x0) / (x1 - x0)
    raise AssertionError("unreachable")  # pragma: no cover


def estimate(service_count: int, endpoint_count: int, table: tuple[Measured, ...] = MEASURED) -> Estimate:
    """kube-proxy's costs in both modes for a cluster of this size (seconds)."""
    if service_count < 0 or endpoint_count < 0:
        raise ValueError("service and endpoint counts cannot be negative")
    size = (service_count + endpoint_count) / UNITS_PER_MEASURED_SERVICE
    rows = sorted(table, key=lambda m: m.services)
    xs = [float(m.services) for m in rows]
    fields = ("iptables_full_sync", "nftables_full_sync", "iptables_programming", "nftables_programming")
    return Estimate(*(max(0.0, _interpolate(size, xs, [getattr(m, f) for m in rows])) for f in fields))


def _s(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.0f}s"


def advise(service_count: int, endpoint_count: int, current_mode: str,
           table: tuple[Measured, ...] = MEASURED) -> str | None:
    """One sentence of advice for a cluster whose nodes run `current_mode`, or None when there is none.

    None for nftables (already there) and for clusters so small that a full sync would save under
    MIN_SAVING_SECONDS: the move is then a matter of the mode's features, not of speed.
    """
    if not is_mode(current_mode):
        raise ValueError(f"unknown kube-proxy mode {current_mode!r} (expected one of {', '.join(MODES)})")
    if current_mode == ADVISED_MODE:
        return None
    deprecation = MODE_FACTS[current_mode].deprecation
    if deprecation is not None:
        # Not measured here (no IPVS in the benchmark kernel); the reason to move is the deprecation.
        return deprecation
    est = estimate(service_count, endpoint_count, table)
    if est.iptables_full_sync - est.nftables_full_sync < MIN_SAVING_SECONDS or est.sync_ratio <= 1.0:
        return None
    return (f"with {service_count} Services and {endpoint_count} endpoints, kube-proxy in nftables mode would "
            f"sync about {est.sync_ratio:.1f}x faster than in iptables mode (full sync ~{_s(est.nftables_full_sync)} "
            f"instead of ~{_s(est.iptables_full_sync)}), and an endpoint change would reach the kernel "
            f"~{est.programming_ratio:.1f}x sooner (~{_s(est.nftables_programming)} instead of "
            f"~{_s(est.iptables_programming)}); measured by bench/bench_kube_proxy_modes.py")
