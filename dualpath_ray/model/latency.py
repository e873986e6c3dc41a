"""Latency model of a decoder layer (attention + MLP over a batch) and its fit to measured batches.

Functional form. One decoder layer (attention + MLP) run over a batch of requests, each given as
(cached, bsz) = (tokens that already have KV, tokens to compute), takes

    t_ms = per_request_ms * n  +  per_token_ms * sum(bsz)  +  per_context_ms * sum(bsz * (cached + bsz))

n is the number of requests. per_token_ms covers the projections and the MLP, linear in the new
tokens; per_context_ms the attention, whose work grows with bsz * (cached + bsz) (every new token
attends to the cached ones and to the new ones, up to itself: about half of bsz^2, which the
fit absorbs); per_request_ms the fixed cost of running one sequence through the layer (the
model's `forward_layer` handles one sequence per call, so fixed costs are per request and an
empty batch costs nothing). A decode step is the same form with bsz = 1 per request. The
coefficients are fitted by non-negative least squares on relative error, so short and long
batches count alike and no term can turn negative outside the profiled range.

The hardware profile file that stores a fitted model is in model/profile.py.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

Pairs = Sequence[tuple[int, int]]


class TimedBatch(NamedTuple):
    """A measured layer time of one batch of (cached, bsz) pairs."""

    pairs: tuple[tuple[int, int], ...]
    ms: float


class FitQuality(NamedTuple):
    rms_relative_error: float
    max_relative_error: float


@dataclass(frozen=True)
class LayerModel:
    """Per-layer time of a batch: the functional form in the module docstring."""

    per_request_ms: float
    per_token_ms: float
    per_context_ms: float

    def __post_init__(self) -> None:
        for name in ("per_request_ms", "per_token_ms", "per_context_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"layer_model.{name} must be finite and >= 0 (got {value})")

    def predict_ms(self, pairs: Pairs) -> float:
        requests, tokens, context = _features(pairs)
        return self.per_request_ms * requests + self.per_token_ms * tokens + self.per_context_ms * context


def _features(pairs: Pairs) -> tuple[int, int, int]:
    """(n, sum bsz, sum bsz * (cached + bsz)) of a batch."""
    tokens = context = 0
    for cached, bsz in pairs:
        tokens += bsz
        context += bsz * (cached + bsz)
    return len(pairs), tokens, context


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly, for the few columns of the latency form.

    The optimum is the unconstrained least-squares solution on its own support, so it is the
    best of the non-negative solutions over all column subsets (2^k - 1 small solves, k = 3).
    """
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b * b))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            chosen = list(subset)
            solution, *_ = np.linalg.lstsq(a[:, chosen], b, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((a[:, chosen] @ solution - b) ** 2))
            if residual < best_residual:
                best = np.zeros(columns)
                best[chosen] = solution
                best_residual = residual
    return best


def fit_layer_model(samples: Sequence[TimedBatch]) -> tuple[LayerModel, FitQuality]:
    """Fit the latency form to measured batches (NNLS on relative error) and report the fit."""
    if len(samples) < 3:
        raise ValueError(f"fitting needs at least 3 timed batches (got {len(samples)})")
    for sample in samples:
        if not sample.pairs or not (math.isfinite(sample.ms) and sample.ms > 0):
            raise ValueError(f"a timed batch needs pairs and a positive time (got {sample})")
    features = np.array([_features(s.pairs) for s in samples], dtype=np.float64)
    measured = np.array([s.ms for s in samples], dtype=np.float64)
    # Dividing each row by its time turns absolute into relative error; column scaling keeps
    # the solve well conditioned when sum(bsz * context) is a million times sum(bsz).
    rows = features / measured[:, None]
    scale = np.where(rows.max(axis=0) > 0, rows.max(axis=0), 1.0)
    coefficients = _nonnegative_least_squares(rows / scale, np.ones(len(samples))) / scale
    model = LayerModel(*(float(c) for c in coefficients))
    relative = np.array([model.predict_ms(s.pairs) / s.ms - 1.0 for s in samples])
    quality = FitQuality(float(np.sqrt(np.mean(relative**2))), float(np.max(np.abs(relative))))
    return model, quality


def time_calls_ms(
    calls: Sequence[Callable[[], object]],
    repeats: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median wall time in ms of each call over `repeats` rounds, after `warmup` untimed runs.

    Rounds interleave the calls (each round times every call once), so a burst of load from
    another process spoils one round of many samples instead of every repeat of one.
    """
    for call in calls:
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, series in zip(calls, times):
            start = clock()
            call()
            series.append((clock() - start) * 1000.0)
    return [statistics.median(series) for series in times]
