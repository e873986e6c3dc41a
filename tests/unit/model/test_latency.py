"""The layer latency form and its non-negative least-squares fit (model/latency.py)."""

from __future__ import annotations

import pytest

from dualpath_ray.model.latency import LayerModel, TimedBatch, fit_layer_model

TRUE = LayerModel(per_request_ms=0.5, per_token_ms=0.002, per_context_ms=1e-5)


def _grid() -> list[tuple[int, int]]:
    return [(c, b) for c in (0, 100, 1000, 3000) for b in (1, 8, 64, 512)]


def test_predict_follows_the_documented_form() -> None:
    pairs = [(100, 10), (0, 4)]
    expected = 0.5 * 2 + 0.002 * 14 + 1e-5 * (10 * 110 + 4 * 4)
    assert TRUE.predict_ms(pairs) == pytest.approx(expected), "n, sum bsz, sum bsz*(cached+bsz) terms"
    assert TRUE.predict_ms([]) == 0, "an empty batch costs nothing"


def test_fit_recovers_exact_coefficients_from_batches() -> None:
    singles = [TimedBatch(((c, b),), TRUE.predict_ms([(c, b)])) for c, b in _grid()]
    batches = [TimedBatch(((10, 5), (2000, 100)), TRUE.predict_ms([(10, 5), (2000, 100)]))]
    model, quality = fit_layer_model(singles + batches)
    assert model.per_request_ms == pytest.approx(0.5, rel=1e-6), "per-request term recovered"
    assert model.per_token_ms == pytest.approx(0.002, rel=1e-6), "per-token term recovered"
    assert model.per_context_ms == pytest.approx(1e-5, rel=1e-6), "attention term recovered"
    assert quality.max_relative_error < 1e-9, "exact data fits exactly"


def test_fit_never_returns_negative_coefficients() -> None:
    # Times that shrink with bsz would want a negative per-token term; NNLS clamps it to 0.
    samples = [TimedBatch(((0, b),), 10.0 - 0.001 * b) for b in (1, 10, 100, 1000, 5000)]
    model, _ = fit_layer_model(samples)
    assert min(model.per_request_ms, model.per_token_ms, model.per_context_ms) >= 0, (
        "every fitted coefficient is non-negative"
    )
    assert model.per_request_ms > 0, "the fit still explains the times with the constant term"


def test_fit_rejects_too_few_or_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit_layer_model([TimedBatch(((0, 1),), 1.0)])
    with pytest.raises(ValueError, match="positive time"):
        fit_layer_model([TimedBatch(((0, 1),), 0.0)] * 3)
