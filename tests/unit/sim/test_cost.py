"""model/cost.py: one engine-time model for the runtime's profile emulation and the simulator."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.model.cost import cost_of_profile, derive_beta_tokens, prefill_tokens_per_second
from dualpath_ray.model.profile import default_profile, derive_beta, typical_request
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.emulation.profile_compute import ProfileCompute


def test_profile_cost_is_the_profiles_arithmetic():
    cfg = DualPathConfig()
    profile = default_profile(cfg.model)
    cost = cost_of_profile(profile, 256)
    pairs = [(1000, 32), (0, 200)]
    assert cost.prefill_layer_ms(pairs) == profile.attention_ms(pairs)
    assert cost.decode_step_ms(8, 4000) == profile.decode_step_ms(8, 4000)
    typical = typical_request(cfg.model.max_context)
    assert derive_beta_tokens(cost, 5.0, typical) == derive_beta(profile, 5.0, typical), "one beta, two callers"
    assert prefill_tokens_per_second(cost, *typical) == pytest.approx(profile.prefill_tokens_per_second(*typical))


def test_profile_compute_sleeps_the_cost_models_time(monkeypatch):
    cfg = DualPathConfig().with_overrides(emulation={"compute": "profile"})
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    compute = ProfileCompute(cfg, layout, torch.device("cpu"))
    slept: list[float] = []
    monkeypatch.setattr("dualpath_ray.runtime.emulation.profile_compute.time.sleep", slept.append)
    prompt = torch.arange(300).numpy()
    batch = compute.begin_prefill([ChunkSpec(prompt, 100, 300, 0)])
    compute.prefill_layer(batch, 0, torch.zeros((400, layout.bytes_per_token_per_layer), dtype=torch.uint8))
    assert slept == [pytest.approx(compute.cost.prefill_layer_ms([(100, 200)]) / 1000)], "one layer's predicted time"
