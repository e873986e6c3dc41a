"""SNIC read series and their high-load window: the figures `dualpath bench` and the simulator
both compute from sampled per-node read bytes (pure: no Ray, no torch; the lowest layer, so the
simulator reports them without importing the cluster benchmark).

- High-load window: the paper measures SNIC balance "in a window" of high load without saying
  which. Here it is the span from the start of the first stretch of the sampled series, of
  `span_s` (1 s; a quarter of the timed phase when that is shorter), whose aggregate SNIC read
  throughput (all nodes together) is at least `fraction` (50%) of the peak stretch throughput, to
  the end of the last such stretch. It leaves out the ramp-up and the tail, where few requests
  are left and one node may simply have finished first.
- SNIC balance: max over nodes / mean over nodes of the SNIC read bytes inside that window
  (1.0 = every SNIC read the same; a 1P1D Basic run, whose decode SNIC reads nothing, is 2.0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

HIGH_LOAD_FRACTION = 0.5
HIGH_LOAD_SPAN_S = 1.0


@dataclass(frozen=True)
class SnicSeries:
    """Cumulative SNIC read bytes per node, sampled at `t_s` (seconds since the timed phase
    started). Every node's list has one value per sample and never decreases."""

    t_s: list[float]
    read_bytes: dict[str, list[int]]

    def __post_init__(self) -> None:
        for node, values in self.read_bytes.items():
            if len(values) != len(self.t_s):
                raise ValueError(f"node {node}: {len(values)} samples for {len(self.t_s)} times")

    def aggregate(self) -> list[int]:
        """All nodes' cumulative bytes at each sample."""
        return [sum(values[i] for values in self.read_bytes.values()) for i in range(len(self.t_s))]

    def to_json(self) -> dict[str, object]:
        return {"t_s": self.t_s, "read_bytes": self.read_bytes}


class HighLoadWindow(NamedTuple):
    """Samples first..last of a series (indices), and the stretch length and peak throughput
    that defined them."""

    first: int
    last: int
    start_s: float
    end_s: float
    span_s: float
    peak_bytes_s: float


def effective_span_s(t_s: Sequence[float], span_s: float = HIGH_LOAD_SPAN_S) -> float:
    """span_s, or a quarter of the sampled duration when that is shorter (a short run still
    has several stretches to compare)."""
    duration = t_s[-1] - t_s[0] if t_s else 0.0
    return min(span_s, duration / 4)


def span_rates(t_s: Sequence[float], cumulative: Sequence[int], span_s: float) -> list[tuple[int, int, float]]:
    """(i, j, bytes/s over samples i..j) for every sample i that has a later sample j at least
    span_s after it (j the first such): the throughput of each span_s stretch of the series."""
    rates = []
    j = 0
    for i in range(len(t_s)):
        j = max(j, i + 1)
        while j < len(t_s) and t_s[j] - t_s[i] < span_s:
            j += 1
        if j == len(t_s):
            break
        rates.append((i, j, (cumulative[j] - cumulative[i]) / (t_s[j] - t_s[i])))
    return rates


def high_load_window(
    series: SnicSeries, fraction: float = HIGH_LOAD_FRACTION, span_s: float = HIGH_LOAD_SPAN_S
) -> HighLoadWindow | None:
    """The high-load window (module docstring); None when the series moved no bytes or has
    fewer than two samples."""
    span = effective_span_s(series.t_s, span_s)
    rates = span_rates(series.t_s, series.aggregate(), span) if span > 0 else []
    if not rates:
        return None
    peak = max(rate for _, _, rate in rates)
    if peak <= 0:
        return None
    loaded = [(i, j) for i, j, rate in rates if rate >= fraction * peak]
    first, last = loaded[0][0], loaded[-1][1]
    return HighLoadWindow(first, last, series.t_s[first], series.t_s[last], span, peak)


def window_bytes(series: SnicSeries, window: HighLoadWindow) -> dict[str, int]:
    """Each node's SNIC read bytes inside the window."""
    return {node: values[window.last] - values[window.first] for node, values in series.read_bytes.items()}


def snic_balance(per_node_bytes: Mapping[str, int]) -> float | None:
    """max / mean of per-node bytes; None when nothing was read."""
    if not per_node_bytes:
        return None
    mean = sum(per_node_bytes.values()) / len(per_node_bytes)
    return max(per_node_bytes.values()) / mean if mean > 0 else None
