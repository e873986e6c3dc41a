"""An engine computes a request only under the namespace of the weights it holds, and only once
it holds the published ones (runtime/engine/held_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.kv.index import salted_namespace
from dualpath_ray.protocol.errors import ErrorKind
from dualpath_ray.protocol.messages import RequestSpec, SamplingParams
from dualpath_ray.protocol.weights import WeightsId
from dualpath_ray.runtime.engine.failures import classify
from dualpath_ray.runtime.engine.held_weights import HeldWeights, StaleWeightsError, config_fingerprint
from tests.helpers import runtime_config


def spec(namespace: str) -> RequestSpec:
    return RequestSpec("r", 0, np.arange(8), SamplingParams(), namespace, 0.0)


def test_a_request_of_another_weight_version_is_refused_retryably() -> None:
    cfg = runtime_config()
    weights = HeldWeights.of_config(cfg)
    weights.check(spec(cfg.kv_namespace(0)))  # the config's own version: admitted
    weights.check(spec(salted_namespace(cfg.kv_namespace(0), "tenant")))  # a tenant's salt names the same weights
    with pytest.raises(StaleWeightsError) as refused:
        weights.check(spec(cfg.kv_namespace(1)))
    kind, _ = classify(refused.value)
    assert kind is ErrorKind.STALE_WEIGHTS and kind.retryable, "a refusal is a typed, retryable failure"
    assert weights.refused == 1, "the refusal is counted"


def test_an_engine_not_ready_refuses_even_its_own_version_until_it_holds_the_published_weights() -> None:
    cfg = runtime_config()
    weights = HeldWeights.of_config(cfg)
    weights.awaiting()  # restarted: its config's weights are not the published ones
    with pytest.raises(StaleWeightsError, match="not loaded the published weights"):
        weights.check(spec(cfg.kv_namespace(0)))
    published = WeightsId(3, "tensors:abc")
    assert not weights.is_current(published)
    weights.now_holds(published)
    assert weights.ready() and weights.is_current(published), "loading the published weights makes it ready"
    weights.check(spec(cfg.kv_namespace(3)))  # admitted under the new version
    with pytest.raises(StaleWeightsError):
        weights.check(spec(cfg.kv_namespace(0)))  # and the old version's namespace is refused now


def test_the_config_fingerprint_names_the_weights_not_the_version() -> None:
    cfg = runtime_config()
    moved = cfg.with_overrides(model={"weight_version": 5})
    reseeded = cfg.with_overrides(model={"seed": 1})
    assert config_fingerprint(cfg) == config_fingerprint(moved), "the version is not part of the fingerprint"
    assert config_fingerprint(cfg) != config_fingerprint(reseeded), "other random weights: another fingerprint"
