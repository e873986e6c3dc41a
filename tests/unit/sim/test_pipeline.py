"""The layerwise pipeline's closed form against the runtime's step-by-step schedule."""

from __future__ import annotations

import random

import pytest

from dualpath_ray.sim.pipeline import batch_seconds, layerwise_seconds


def stepwise(layers: int, load: float, compute: float, send: float) -> float:
    """runtime/prefill/pipeline.py's order, layer by layer: loads and sends each one at a time."""
    loaded: list[float] = []
    computed: list[float] = []
    sent: list[float] = []
    for layer in range(layers):
        posted = 0.0 if layer < 2 else computed[0] if layer == 2 else max(computed[layer - 2], sent[layer - 3])
        loaded.append(max(posted, loaded[-1] if loaded else 0.0) + load)
        computed.append(max(computed[-1] if computed else 0.0, loaded[-1]) + compute)
        sent.append(max(computed[-1], sent[-1] if sent else 0.0) + send)
    return sent[-1]


def test_closed_form_equals_the_stepwise_schedule():
    rng = random.Random(11)
    for _ in range(3000):
        layers = rng.randint(1, 90)
        times = [rng.choice((0.0, rng.random(), 10 * rng.random())) for _ in range(3)]
        assert layerwise_seconds(layers, *times) == pytest.approx(stepwise(layers, *times), rel=1e-12, abs=1e-15), (
            f"closed form differs for {layers} layers, times {times}"
        )


def test_steady_state_is_the_slowest_stage_per_layer():
    # 61 layers, compute-bound: fill with one load, drain with one send, 61 computes between.
    assert layerwise_seconds(61, 1.0, 2.0, 0.5) == pytest.approx(1.0 + 61 * 2.0 + 0.5)
    # load-bound: every layer waits for its load.
    assert layerwise_seconds(61, 3.0, 2.0, 0.5) == pytest.approx(61 * 3.0 + 2.0 + 0.5)


def test_without_layerwise_prefill_every_load_comes_first():
    assert batch_seconds(4, 1.0, 2.0, 0.5, layerwise=False) == pytest.approx(4 * 1.0 + 4 * 2.0 + 0.5)
    assert batch_seconds(4, 1.0, 2.0, 0.5, layerwise=True) < batch_seconds(4, 1.0, 2.0, 0.5, layerwise=False)
