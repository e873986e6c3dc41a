"""The attention-time balance of `dualpath bench` (dualpath_ray/bench/compute_balance.py): each
prefill engine's compute seconds over the SNIC high-load window, or over the timed phase, and
their max / mean, on hand-made series with literal numbers."""

from __future__ import annotations

import pytest

from dualpath_ray.bench.compute_balance import (
    HIGH_LOAD,
    TIMED_PHASE,
    ComputeSeries,
    attention_balance,
    max_over_mean,
    span_compute_s,
    value_at,
)

# Two engines sampled every second for 4 s: p0 computes 0.5 s a second throughout; p1 idles the
# first second, then computes 0.3 s a second.
SERIES = ComputeSeries(
    t_s=[0.0, 1.0, 2.0, 3.0, 4.0],
    compute_s={"prefill/p0/g0": [0.0, 0.5, 1.0, 1.5, 2.0], "prefill/p1/g0": [0.0, 0.0, 0.3, 0.6, 0.9]},
)


def test_value_at_interpolates_between_samples_and_clamps_outside() -> None:
    t, v = SERIES.t_s, SERIES.compute_s["prefill/p1/g0"]
    assert value_at(t, v, 1.5) == pytest.approx(0.15), "halfway between 0.0 at 1 s and 0.3 at 2 s"
    assert value_at(t, v, 2.0) == pytest.approx(0.3), "a sample's own time gives its value"
    assert value_at(t, v, -1.0) == 0.0, "before the first sample: the first value"
    assert value_at(t, v, 9.0) == pytest.approx(0.9), "after the last sample: the last value"
    assert value_at([0.0, 1.0, 1.0, 2.0], [0.0, 1.0, 3.0, 4.0], 1.0) == 3.0, (
        "two samples stamped alike: the later one's value, never a division by zero"
    )


def test_span_compute_s_is_each_engines_seconds_between_the_ends() -> None:
    per_engine = span_compute_s(SERIES, 1.5, 3.5)
    assert per_engine["prefill/p0/g0"] == pytest.approx(1.0), "2 s at 0.5 s a second"
    assert per_engine["prefill/p1/g0"] == pytest.approx(0.6), "2 s at 0.3 s a second"


def test_balance_over_the_high_load_window() -> None:
    figure = attention_balance(SERIES, (1.0, 3.0))
    assert figure.over == HIGH_LOAD and figure.span_s == (1.0, 3.0), "the SNIC window is the span when there is one"
    assert figure.engine_compute_s == pytest.approx({"prefill/p0/g0": 1.0, "prefill/p1/g0": 0.6}), "1 s and 0.6 s"
    assert figure.balance == pytest.approx(1.0 / 0.8), "max 1.0 s over mean 0.8 s"


def test_balance_over_the_timed_phase_without_a_window() -> None:
    figure = attention_balance(SERIES, None)
    assert figure.over == TIMED_PHASE and figure.span_s == (0.0, 4.0), "no SNIC window (oracle): the sampled phase"
    assert figure.engine_compute_s == pytest.approx({"prefill/p0/g0": 2.0, "prefill/p1/g0": 0.9}), "whole-phase seconds"
    assert figure.balance == pytest.approx(2.0 / 1.45), "max 2.0 s over mean 1.45 s"


def test_no_figure_without_compute_or_samples() -> None:
    assert max_over_mean({}) is None, "no engine: no figure"
    assert max_over_mean({"a": 0.0, "b": 0.0}) is None, "nothing computed: undefined, not a division by 0"
    assert max_over_mean({"a": 0.4}) == pytest.approx(1.0), "one engine is balanced with itself"
    assert max_over_mean({"a": 0.6, "b": 0.0}) == pytest.approx(2.0), "one of two idle: max / mean is 2"
    one_sample = ComputeSeries([0.0], {"a": [0.0]})
    assert attention_balance(one_sample, None).balance is None, "one sample spans no time"
    assert attention_balance(ComputeSeries([], {}), None).over is None, "an empty series names no span"


def test_series_rejects_mismatched_or_unordered_samples() -> None:
    with pytest.raises(ValueError, match="engine a: 1 compute samples for 2 times"):
        ComputeSeries([0.0, 1.0], {"a": [0.0]})
    with pytest.raises(ValueError, match="t_s must not decrease"):
        ComputeSeries([1.0, 0.5], {"a": [0.0, 0.1]})
