"""Hardware profile files, the built-in default profile, alpha/beta, and the `dualpath profile` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpath_ray.cli import main
from dualpath_ray.config import ConfigError, DualPathConfig, ModelConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.model.latency import LayerModel, TimedBatch
from dualpath_ray.model.profile import (
    HardwareProfile,
    attention_predictor,
    default_profile,
    derive_alpha,
    derive_alpha_beta,
    derive_beta,
    describe_model,
    load_profile_for,
    profile_attention,
    typical_request,
)
from dualpath_ray.scheduling import pack_prefill_batch

TRUE = LayerModel(per_request_ms=0.5, per_token_ms=0.002, per_context_ms=1e-5)


def _grid() -> list[tuple[int, int]]:
    return [(c, b) for c in (0, 100, 1000, 3000) for b in (1, 8, 64, 512)]

def _profile(layer: LayerModel = TRUE, n_layer: int = 2) -> HardwareProfile:
    return HardwareProfile(layer, n_layer, describe_model(ModelConfig(n_layer=n_layer)), device="test")


def test_engine_estimates() -> None:
    profile = _profile()
    contexts = [10, 20, 30]
    assert profile.decode_step_ms(3, sum(contexts)) == pytest.approx(
        profile.forward_ms([(c, 1) for c in contexts])
    ), "a decode step is a forward of one new token per request"
    assert profile.forward_ms([(5, 5)]) == pytest.approx(2 * TRUE.predict_ms([(5, 5)])), "n_layer layers"
    flat = _profile(LayerModel(1.0, 0.0, 0.0))
    assert flat.prefill_tokens_per_second(100, 28) == pytest.approx(28 / 0.002), "2 ms per request"
    assert flat.prompt_tokens_per_second(100, 28) == pytest.approx(128 / 0.002), "cached counts in prompt"


def test_alpha_and_beta() -> None:
    assert derive_alpha(400, 1024, 3.0) == 146_484_375, "3 s * 50 GB/s / 1 KiB per token"
    flat = _profile(LayerModel(1.0, 0.0, 0.0))
    assert derive_beta(flat, 5.0, (100, 28)) == 70_000, "5 s * 28 computed tokens / 2 ms (cached tokens are not work)"
    cfg = DualPathConfig()
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    alpha, beta = derive_alpha_beta(cfg, layout)
    assert alpha == derive_alpha(cfg.cluster.snic_gbps, layout.bytes_per_token), "alpha from the config"
    assert beta == derive_beta(default_profile(cfg.model), 5.0, typical_request(4096)), "beta from profile"
    with pytest.raises(ValueError, match="snic_gbps"):
        derive_alpha(0, 1024)


def test_typical_request() -> None:
    assert typical_request(4096) == (2048, 429), "half the context cached, 429 appended"
    assert typical_request(8) == (4, 2), "appended tokens capped at a quarter of a short context"
    assert typical_request(1) == (0, 1), "at least one token to compute"


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    profile = HardwareProfile(
        TRUE, 4, describe_model(ModelConfig()), device="x", samples=(TimedBatch(((1, 2),), 3.0),)
    )
    path = tmp_path / "p.json"
    profile.save(path)
    assert HardwareProfile.load(path) == profile, "save then load gives the same profile"
    data = json.loads(path.read_text())
    assert data["format"] == "dualpath-hardware-profile" and data["version"] == 1, "documented header"
    assert set(data["layer_model"]) == {"per_request_ms", "per_token_ms", "per_context_ms"}, "layer keys"


def test_bad_profile_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        HardwareProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        HardwareProfile.load(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="format must be"):
        HardwareProfile.load(bad)


def test_load_profile_for_checks_the_model(tmp_path: Path) -> None:
    cfg = DualPathConfig()
    assert load_profile_for(cfg).source == "default", "no profile_path: the built-in profile"
    path = tmp_path / "p.json"
    HardwareProfile(TRUE, 4, describe_model(cfg.model)).save(path)
    with_path = cfg.with_overrides(emulation={"profile_path": str(path)})
    assert load_profile_for(with_path).layer == TRUE, "the configured profile is loaded"
    other = with_path.with_overrides(model={"hidden_size": 128})
    with pytest.raises(ConfigError, match="hidden_size"):
        load_profile_for(other)
    predict = attention_predictor(with_path)
    assert pack_prefill_batch([("a", 0, 10)], predict, 300.0) == [("a", 0, 10)], "usable as packer"


def test_default_profile_scales_with_the_model() -> None:
    small, big = default_profile(ModelConfig()), default_profile(ModelConfig(hidden_size=256, n_head=8))
    assert big.attention_ms([(1000, 100)]) > small.attention_ms([(1000, 100)]), "bigger model, slower layer"


def test_profile_attention_times_medians_and_fits() -> None:
    now = [0.0]
    calls: list[tuple[int, int]] = []

    def clock() -> float:
        return now[0]

    def run_layer(cached: int, bsz: int) -> None:
        calls.append((cached, bsz))
        spike = 1.0 if len(calls) % 7 == 0 else 0.0  # an occasional slow run the median drops
        now[0] += (TRUE.predict_ms([(cached, bsz)]) + spike * 1000) / 1000.0

    profile = profile_attention(run_layer, _grid(), model=ModelConfig(n_layer=3), repeats=5, warmup=1, clock=clock)
    assert len(calls) == len(_grid()) * 6, "each sample runs warmup + repeats times"
    assert profile.n_layer == 3 and profile.source == "measured", "n_layer from the model"
    assert profile.layer.per_context_ms == pytest.approx(1e-5, rel=1e-6), "median drops the spikes"
    assert [s.pairs[0] for s in profile.samples] == _grid(), "one timed sample per requested point"


def test_profile_command_measures_the_real_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  max_context: 256\n")
    out = tmp_path / "profile.json"
    assert main(["profile", "--config", str(config), "--out", str(out), "--repeats", "1"]) == 0, "exit 0"
    assert "alpha" in capsys.readouterr().out, "the summary shows alpha and beta"
    profile = HardwareProfile.load(out)
    assert profile.source == "measured" and len(profile.samples) >= 3, "a measured, fitted profile"
    assert profile.model["max_context"] == 256 and profile.n_layer == 4, "describes the configured model"
    assert profile.attention_ms([(128, 64)]) > 0, "a usable predictor"


def test_profile_command_rejects_bad_arguments(tmp_path: Path) -> None:
    assert main(["profile", "--out", str(tmp_path / "p.json"), "--repeats", "0"]) == 2, "usage error"
    if not torch.cuda.is_available():
        assert main(["profile", "--out", str(tmp_path / "p.json"), "--device", "cuda"]) == 2, (
            "asking for CUDA without a CUDA device is a usage error"
        )
