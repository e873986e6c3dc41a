"""Attention-time balance of `dualpath bench`: how evenly the prefill engines' compute time is
spread (pure: no Ray, no torch).

The paper packs each data-parallel prefill engine's forward batches under a compute quota so that
the engines' attention times are balanced, and reports Max/Avg 1.06. The runtime's engines report
cumulative compute seconds, not attention alone (a tiny model's attention is not timed apart from
its other layers): the native engine its layers' compute (PipelineStats.compute_s), a vLLM engine
the time inside vLLM's `engine.step()` (its compute's `step_s`). The bench samples them during the
timed phase like the SNIC counters (a ComputeSeries), and the figure is

    max / mean over the prefill engines of the compute seconds each spent inside the SNIC
    high-load window (dualpath_ray/analysis/snic_window.py), or inside the whole sampled timed
    phase when that window is undefined (no SNIC traffic: oracle).

It is the simulator's "per engine over the window" measure (benchmarks/README.md, "Attention-time
balance"); the runtime has no per-round layer times, so the per-round measure has no counterpart
here. A cumulative value between two samples is interpolated linearly at the window's ends.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

HIGH_LOAD = "high-load window"
TIMED_PHASE = "timed phase"


@dataclass(frozen=True)
class ComputeSeries:
    """Cumulative compute seconds per prefill engine, sampled at `t_s` (seconds since the timed
    phase started, the SNIC series' clock). Every engine's list has one value per sample."""

    t_s: list[float]
    compute_s: dict[str, list[float]]

    def __post_init__(self) -> None:
        if any(b < a for a, b in zip(self.t_s, self.t_s[1:])):
            raise ValueError("ComputeSeries.t_s must not decrease: samples are stamped in the order taken")
        for engine, values in self.compute_s.items():
            if len(values) != len(self.t_s):
                raise ValueError(f"engine {engine}: {len(values)} compute samples for {len(self.t_s)} times")

    def to_json(self) -> dict[str, object]:
        return {"t_s": self.t_s, "compute_s": self.compute_s}


class AttentionBalance(NamedTuple):
    """The figure, each engine's compute seconds it compares, the span they were summed over
    (start, end in the series' clock) and which span that is (HIGH_LOAD or TIMED_PHASE)."""

    balance: float | None
    engine_compute_s: dict[str, float]
    span_s: tuple[float, float] | None
    over: str | None


def value_at(t_s: Sequence[float], values: Sequence[float], t: float) -> float:
    """A cumulative series' value at time t: linear between the samples around t, the first or
    last sample's value before or after them."""
    if not t_s:
        raise ValueError("value_at needs at least one sample")
    if t <= t_s[0]:
        return values[0]
    if t >= t_s[-1]:
        return values[-1]
    j = bisect.bisect_right(t_s, t)
    t0, t1 = t_s[j - 1], t_s[j]
    if t1 == t0:
        return values[j]
    return values[j - 1] + (values[j] - values[j - 1]) * (t - t0) / (t1 - t0)


def span_compute_s(series: ComputeSeries, start_s: float, end_s: float) -> dict[str, float]:
    """Each engine's compute seconds between start_s and end_s."""
    return {
        engine: value_at(series.t_s, values, end_s) - value_at(series.t_s, values, start_s)
        for engine, values in series.compute_s.items()
    }


def max_over_mean(per_engine: Mapping[str, float]) -> float | None:
    """max / mean of per-engine seconds (1.0 = even); None when no engine computed."""
    if not per_engine:
        return None
    mean = sum(per_engine.values()) / len(per_engine)
    return max(per_engine.values()) / mean if mean > 0 else None


def attention_balance(series: ComputeSeries, window_s: tuple[float, float] | None) -> AttentionBalance:
    """The figure over the SNIC high-load window `window_s`, or over the sampled timed phase when
    it is None (module docstring); no figure from fewer than two samples."""
    if window_s is not None:
        span, over = window_s, HIGH_LOAD
    elif len(series.t_s) >= 2:
        span, over = (series.t_s[0], series.t_s[-1]), TIMED_PHASE
    else:
        return AttentionBalance(None, {}, None, None)
    per_engine = span_compute_s(series, *span)
    return AttentionBalance(max_over_mean(per_engine), per_engine, span, over)
