"""The figures of `dualpath bench`, computed from what a run measured (pure: no Ray, no torch).

Definitions (benchmarks/README.md repeats them):

- TTFT / TPOT percentiles: numpy's linear-interpolation percentile of the timed turns' values.
- High-load window and SNIC balance: dualpath_ray/analysis/snic_window.py.
- Attention-time balance over that window: dualpath_ray/bench/compute_balance.py.
- I/O bound: the timed phase's hit bytes / the aggregate SNIC read rate the mode can use
  (basic: the prefill nodes' SNICs; dualpath: every node's; oracle reads nothing: 0 s).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

MODES = ("basic", "dualpath", "oracle")


class Percentiles(NamedTuple):
    """p50 and p99 of a sample; None for an empty sample."""

    p50: float | None
    p99: float | None

    def to_json(self) -> dict[str, float | None]:
        return {"p50": self.p50, "p99": self.p99}


def percentiles(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(None, None)
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return Percentiles(float(p50), float(p99))


class Bounds(NamedTuple):
    """Lower bounds on a mode's timed JCT. compute_s: the measured Oracle JCT (the same turns on
    the same engines with all I/O removed), None when oracle was not run."""

    io_s: float
    compute_s: float | None

    def to_json(self) -> dict[str, float | None]:
        return {"io_s": self.io_s, "compute_s": self.compute_s}


def io_bound_s(mode: str, hit_bytes: int, snic_bytes_s: float, prefill_nodes: int, decode_nodes: int) -> float:
    """Hit bytes over the aggregate SNIC read rate the mode can use (module docstring)."""
    if mode == "oracle":
        return 0.0
    readers = prefill_nodes if mode == "basic" else prefill_nodes + decode_nodes
    return hit_bytes / (snic_bytes_s * readers)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_optional(values: Sequence[float | None]) -> float | None:
    """Median of the values that exist; None when none does."""
    present = [v for v in values if v is not None]
    return median(present) if present else None


def median_count(values: Sequence[int]) -> int:
    """The median of counts (bytes, requests) as one of them: the lower middle value for an
    even number, so a reported count is always one that was measured."""
    return int(statistics.median_low(values))


def median_by_key(dicts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per-key median counts of dicts with the same keys (per-node bytes over rounds, say)."""
    keys = list(dicts[0]) if dicts else []
    return {key: median_count([d[key] for d in dicts]) for key in keys}


def parse_modes(text: str) -> tuple[str, ...]:
    """A comma list of distinct modes, in the given order; ValueError names what is wrong."""
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        shown = f"unknown mode(s) {', '.join(map(repr, unknown))}" if unknown else "no mode given"
        raise ValueError(f"{shown}; use a comma list of {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is listed twice in {text!r}; list each once")
    return modes


def run_order(modes: Sequence[str], repeat: int) -> list[tuple[int, str]]:
    """(round, mode) in run order: every round runs every mode, in the given order, so drift of
    the machine falls on all modes alike."""
    return [(round_index, mode) for round_index in range(1, repeat + 1) for mode in modes]
