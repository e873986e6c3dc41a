"""Hugging Face checkpoints: config.json fills the model section, rope_scaling is applied or
refused, and weights swap in place (or not at all)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import ConfigError, ModelConfig, load_config, parse_config
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.rope import rope_inv_freq
from dualpath_ray.config.hf import WeightsError, model_fields_from_hf_config
from dualpath_ray.model.weights import write_checkpoint
from tests.model_factories import random_tokens, tiny_model_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _hf_config(tmp_path: Path, **overrides: object) -> Path:
    hf = {
        "model_type": "llama", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "torch_dtype": "float32", "hidden_act": "silu",
    }
    hf.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _reference_llama3(theta: float, head_dim: int, s: dict) -> list[float]:
    """The published Llama 3.1 rule, written out per frequency."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        context = s["original_max_position_embeddings"]
        if wavelength < context / s["high_freq_factor"]:
            out.append(freq)
        elif wavelength > context / s["low_freq_factor"]:
            out.append(freq / s["factor"])
        else:
            smooth = (context / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * freq / s["factor"] + smooth * freq)
    return out


def test_llama3_rope_scaling_follows_the_published_rule() -> None:
    cfg = tiny_model_config(head_dim=32, rope_scaling=LLAMA3)
    got = rope_inv_freq(cfg).tolist()
    want = _reference_llama3(cfg.rope_theta, 32, LLAMA3)
    assert got == pytest.approx(want, rel=1e-6), "every frequency matches the rule: kept, divided or blended"
    plain = rope_inv_freq(tiny_model_config(head_dim=32)).tolist()
    assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / 8.0), (
        "the highest frequency is kept and the lowest divided by the factor"
    )
    linear = rope_inv_freq(tiny_model_config(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert linear.tolist() == pytest.approx([f / 2.0 for f in plain]), "linear scaling divides every frequency"


def test_rope_scaling_changes_the_model_and_unknown_types_are_refused() -> None:
    tokens = random_tokens(40, 97)
    plain = DecoderModel(tiny_model_config()).prefill(tokens).logits
    scaled = DecoderModel(tiny_model_config(rope_scaling=LLAMA3)).prefill(tokens).logits
    assert not torch.allclose(plain, scaled), "rope_scaling is applied, never ignored"
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.rope_type.*supported: llama3, linear"):
        parse_config({"model": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}})
    with pytest.raises(ConfigError, match="needs high_freq_factor"):
        parse_config({"model": {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                 "original_max_position_embeddings": 64}}})


def test_hf_config_fields_cover_shapes_rope_and_dtype(tmp_path: Path) -> None:
    directory = _hf_config(tmp_path, rope_scaling={**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"},
                           torch_dtype="bfloat16")
    fields = model_fields_from_hf_config(directory)
    assert fields["n_layer"] == 3 and fields["n_kv_head"] == 2 and fields["head_dim"] == 8, "shapes are read"
    assert fields["dtype"] == "bfloat16", "torch_dtype sets the model dtype"
    assert fields["rope_scaling"]["rope_type"] == "llama3", "the older `type` key of rope_scaling is read"
    with pytest.raises(WeightsError, match="model_type 'gpt2' is not supported"):
        model_fields_from_hf_config(_hf_config(tmp_path, model_type="gpt2"))


def test_load_config_fills_the_model_from_config_json_and_names_disagreements(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    _hf_config(checkpoint)
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text(f"model:\n  weights_dir: {checkpoint}\n  max_context: 256\n")
    model = load_config(yaml_path).model
    assert (model.n_layer, model.hidden_size, model.vocab_size) == (3, 32, 97), "missing fields come from config.json"
    assert model.max_context == 256, "a shorter context than the checkpoint's is the user's choice"
    yaml_path.write_text(f"model:\n  weights_dir: {checkpoint}\n  n_layer: 4\n")
    with pytest.raises(ConfigError, match=r"model\.n_layer: YAML says 4, .*config\.json says 3"):
        load_config(yaml_path)


def test_load_weights_swaps_in_place_and_a_bad_source_changes_nothing(tmp_path: Path) -> None:
    model = DecoderModel(tiny_model_config(seed=1))
    other = DecoderModel(tiny_model_config(seed=2))
    tokens = random_tokens(20, 97)
    before = model.prefill(tokens).logits
    write_checkpoint(other.checkpoint_tensors(), tmp_path / "new")
    model.load_weights(tmp_path / "new")
    assert torch.equal(model.prefill(tokens).logits, other.prefill(tokens).logits), "a checkpoint directory swaps weights"
    model.load_weights(DecoderModel(tiny_model_config(seed=1)).checkpoint_tensors())
    assert torch.equal(model.prefill(tokens).logits, before), "a state dict swaps them back"
    broken = dict(other.checkpoint_tensors())
    broken["model.norm.weight"] = torch.ones(5)
    with pytest.raises(WeightsError, match="model.norm.weight"):
        model.load_weights(broken)
    assert torch.equal(model.prefill(tokens).logits, before), "a source that does not fit leaves the old weights"
    assert isinstance(model.cfg, ModelConfig), "the config is unchanged by a weight swap"
