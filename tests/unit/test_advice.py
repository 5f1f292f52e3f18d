"""proxyshift.planner.advice: the size-based advice from the measured kube-proxy costs."""

from __future__ import annotations

import pytest

from proxyshift.planner.advice import MEASURED, MIN_SAVING_SECONDS, Measured, advise, estimate

pytestmark = pytest.mark.unit

TABLE = (
    Measured(1000, 1.0, 0.5, 0.2, 0.1),
    Measured(5000, 10.0, 2.0, 1.0, 0.2),
    Measured(10000, 30.0, 5.0, 2.0, 0.5),
)


def test_at_a_measured_size_the_estimate_is_the_measurement() -> None:
    # 1000 Services of 3 endpoints is exactly the benchmark's 1000 point.
    est = estimate(1000, 3000, TABLE)
    assert (est.iptables_full_sync, est.nftables_full_sync) == (1.0, 0.5)
    assert est.sync_ratio == pytest.approx(2.0)
    assert est.programming_ratio == pytest.approx(2.0)


def test_between_sizes_it_interpolates_linearly() -> None:
    est = estimate(3000, 9000, TABLE)  # halfway between 1000 and 5000
    assert est.iptables_full_sync == pytest.approx(5.5)
    assert est.nftables_full_sync == pytest.approx(1.25)


def test_endpoints_count_as_well_as_services() -> None:
    # 1000 Services with 11 endpoints each weigh as much as 3000 measured Services.
    assert estimate(1000, 11000, TABLE) == estimate(3000, 9000, TABLE)


def test_beyond_the_largest_size_it_extrapolates_the_last_segment() -> None:
    est = estimate(20000, 60000, TABLE)
    assert est.iptables_full_sync == pytest.approx(70.0)
    assert est.nftables_full_sync == pytest.approx(11.0)


def test_below_the_smallest_size_it_scales_towards_zero() -> None:
    assert estimate(0, 0, TABLE).iptables_full_sync == 0.0
    assert estimate(500, 1500, TABLE).iptables_full_sync == pytest.approx(0.5)


def test_estimates_grow_with_size_in_the_shipped_table() -> None:
    sizes = [0, 100, 1000, 2500, 5000, 7500, 10000, 20000]
    for field in ("iptables_full_sync", "nftables_full_sync", "iptables_programming", "nftables_programming"):
        values = [getattr(estimate(s, 3 * s), field) for s in sizes]
        assert values == sorted(values), field


def test_shipped_table_says_nftables_is_faster_at_every_measured_size() -> None:
    for m in MEASURED:
        assert m.iptables_full_sync > m.nftables_full_sync
        assert m.iptables_programming > m.nftables_programming


def test_advice_for_a_large_iptables_cluster_quotes_the_ratio_and_the_times() -> None:
    text = advise(5000, 15000, "iptables", TABLE)
    assert text is not None
    assert "5.0x faster" in text and "~2.00s instead of ~10s" in text
    assert "5.0x sooner" in text and "bench_kube_proxy_modes.py" in text


def test_no_advice_for_nftables_or_a_tiny_cluster() -> None:
    assert advise(5000, 15000, "nftables", TABLE) is None
    # A saving under MIN_SAVING_SECONDS per full sync is no reason to move a fleet.
    tiny = estimate(10, 30, TABLE)
    assert tiny.iptables_full_sync - tiny.nftables_full_sync < MIN_SAVING_SECONDS
    assert advise(10, 30, "iptables", TABLE) is None


def test_no_advice_when_the_table_says_iptables_is_not_slower() -> None:
    flat = (Measured(1000, 1.0, 1.0, 0.1, 0.1), Measured(2000, 2.0, 2.0, 0.2, 0.2))
    assert advise(2000, 6000, "iptables", flat) is None


def test_ipvs_gets_the_deprecation_advice_whatever_the_size() -> None:
    text = advise(1, 0, "ipvs")
    assert text is not None and "deprecated" in text and "nftables" in text


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kube-proxy mode"):
        advise(10, 10, "userspace")
    with pytest.raises(ValueError, match="negative"):
        estimate(-1, 0)
