"""The pure figures of `dualpath bench`: percentiles, the high-load window, balance, bounds,
medians and the run order."""

from __future__ import annotations

import pytest

from dualpath_ray.analysis.snic_window import SnicSeries, high_load_window, snic_balance, span_rates, window_bytes
from dualpath_ray.bench.figures import io_bound_s, median_by_key, median_count, parse_modes, percentiles, run_order


def test_percentiles_interpolate_linearly_and_are_none_for_no_sample() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    p = percentiles(values)
    assert p.p50 == pytest.approx(50.5), "p50 of 1..100 is the mean of the two middle values"
    assert p.p99 == pytest.approx(99.01), "p99 interpolates between the 99th and 100th values"
    assert percentiles([]) == (None, None), "an empty sample has no percentiles (JSON null), not NaN"


def ramp_series() -> SnicSeries:
    """Samples every 0.5 s over 10 s: p0 reads 1 MB/s from 2 s to 8 s, d0 0.5 MB/s from 3 s to 9 s,
    with a slow trickle (0.1 MB/s on p0) before and after: the high load is 3 s..8 s."""
    t = [0.5 * i for i in range(21)]

    def cumulative(rate_at: object) -> list[int]:
        total, values = 0.0, [0]
        for a, b in zip(t, t[1:]):
            total += rate_at(a) * (b - a)  # type: ignore[operator]
            values.append(int(total))
        return values

    p0 = cumulative(lambda s: 1e6 if 2 <= s < 8 else 1e5)
    d0 = cumulative(lambda s: 5e5 if 3 <= s < 9 else 0.0)
    return SnicSeries(t, {"p0": p0, "d0": d0})


def test_high_load_window_spans_the_stretches_at_half_the_peak_or_more() -> None:
    series = ramp_series()
    window = high_load_window(series)
    assert window is not None, "a series that moved bytes has a window"
    assert window.peak_bytes_s == pytest.approx(1.5e6), "the peak 1 s stretch is both nodes reading: 1.5 MB/s"
    # Aggregate rate: 0.1 MB/s before 2 s, 1 MB/s in 2..3 s, 1.5 in 3..8, 0.6 in 8..9, 0.1 after. The
    # stretch 1.5..2.5 s averages 0.55 MB/s (< 0.75: out); 7.5..8.5 s averages 1.05 MB/s (in), 8..9 s 0.6 (out).
    assert (window.start_s, window.end_s) == (2.0, 8.5), (
        "the window runs from the first 1 s stretch at >= 50% of the peak to the end of the last one"
    )
    in_window = window_bytes(series, window)
    assert in_window == {"p0": 6_050_000, "d0": 2_750_000}, "bytes each node read inside the window"
    assert snic_balance(in_window) == pytest.approx(6.05 / 4.4), "balance is max / mean of per-node bytes"


def test_span_rates_use_the_first_sample_a_full_span_later() -> None:
    rates = span_rates([0.0, 0.4, 0.9, 1.2, 2.0], [0, 4, 9, 12, 20], 1.0)
    assert [(i, j) for i, j, _ in rates] == [(0, 3), (1, 4), (2, 4)], (
        "each stretch starts at a sample and ends at the first sample >= 1 s later; none past the end"
    )
    assert rates[0][2] == pytest.approx(10.0), "rate over a stretch is bytes / its seconds"


def test_window_of_a_short_run_uses_a_quarter_of_it() -> None:
    series = SnicSeries([0.0, 0.1, 0.2, 0.3, 0.4], {"p0": [0, 10, 20, 30, 40], "d0": [0, 10, 20, 30, 40]})
    window = high_load_window(series)
    assert window is not None and window.span_s == pytest.approx(0.1), (
        "a run shorter than 1 s is cut into stretches of a quarter of its length"
    )
    assert (window.start_s, window.end_s) == (0.0, 0.4), "uniform traffic is high load all along"
    assert snic_balance(window_bytes(series, window)) == pytest.approx(1.0), "equal nodes balance at 1.0"


def test_no_window_or_balance_without_traffic() -> None:
    idle = SnicSeries([0.0, 1.0, 2.0, 3.0, 4.0], {"p0": [0] * 5, "d0": [0] * 5})
    assert high_load_window(idle) is None, "Oracle reads nothing: no high-load window"
    assert high_load_window(SnicSeries([0.0], {"p0": [0]})) is None, "one sample has no stretch"
    assert snic_balance({"p0": 0, "d0": 0}) is None, "no traffic: balance undefined, not a division by 0"


def test_basic_1p1d_balance_is_two() -> None:
    assert snic_balance({"p0": 100, "d0": 0}) == pytest.approx(2.0), (
        "with one of two SNICs idle, max / mean is 2"
    )


def test_series_rejects_misaligned_samples() -> None:
    with pytest.raises(ValueError, match="d0"):
        SnicSeries([0.0, 1.0], {"p0": [0, 1], "d0": [0]})


def test_io_bound_counts_the_snics_each_mode_reads_through() -> None:
    rate = 2e6  # bytes/s per SNIC
    assert io_bound_s("basic", 120_000_000, rate, 2, 4) == pytest.approx(30.0), (
        "basic reads only through the 2 prefill SNICs"
    )
    assert io_bound_s("dualpath", 120_000_000, rate, 2, 4) == pytest.approx(10.0), (
        "dualpath reads through all 6 SNICs"
    )
    assert io_bound_s("oracle", 120_000_000, rate, 2, 4) == 0.0, "oracle does no I/O"


def test_median_counts_are_measured_values() -> None:
    assert median_count([5, 1, 9]) == 5, "odd count: the middle value"
    assert median_count([1, 2, 8, 9]) == 2, "even count: the lower middle, a value that was measured"
    assert median_by_key([{"p0": 3, "d0": 0}, {"p0": 1, "d0": 4}, {"p0": 2, "d0": 2}]) == {"p0": 2, "d0": 2}, (
        "medians are taken per key"
    )


def test_modes_parse_in_order_and_reject_unknown_or_repeated() -> None:
    assert parse_modes("oracle, basic") == ("oracle", "basic"), "the given order is the run order"
    for bad, needle in (("basic,fast", "'fast'"), ("", "no mode"), ("basic,basic", "twice")):
        with pytest.raises(ValueError, match=needle):
            parse_modes(bad)


def test_rounds_interleave_the_modes() -> None:
    assert run_order(("basic", "dualpath", "oracle"), 2) == [
        (1, "basic"), (1, "dualpath"), (1, "oracle"), (2, "basic"), (2, "dualpath"), (2, "oracle"),
    ], "every round runs every mode before the next round starts"
