"""The vllm backend's config surface: the model directory it writes, the KV geometry check of a
user's directory, the engine section's rules and the key namespace (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath_ray.config import ConfigError, ModelConfig, parse_config
from dualpath_ray.runtime.vllm_engine.step_kv import layer_index
from dualpath_ray.runtime.vllm_engine.model_dir import check_kv_geometry, dummy_model_dir, hf_config_of


def test_the_model_section_is_written_as_a_llama_config() -> None:
    model = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, head_dim=32, hidden_size=128)
    written = json.loads((dummy_model_dir(model) / "config.json").read_text())
    assert written == hf_config_of(model), "the directory holds exactly the model section's config"
    assert (written["num_hidden_layers"], written["num_key_value_heads"], written["head_dim"]) == (3, 2, 32), (
        "the KV geometry vLLM builds its pages from is the model section's"
    )


def test_a_directory_with_another_kv_geometry_is_refused_by_field(tmp_path: Path) -> None:
    model = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, head_dim=32, hidden_size=128)
    theirs = {**hf_config_of(model), "num_hidden_layers": 4, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(theirs))
    with pytest.raises(ValueError, match=r"model.n_layer is 2 but .* says 4; model.n_kv_head is 2 but .* says 4"):
        check_kv_geometry(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_of(model)))
    check_kv_geometry(tmp_path, model)  # the same geometry passes


def test_vllm_with_profile_compute_is_a_config_error_naming_both_fields() -> None:
    with pytest.raises(ConfigError, match="emulation.compute"):
        parse_config({"engine": {"backend": "vllm"}, "emulation": {"compute": "profile"}})
    with pytest.raises(ConfigError, match="engine.backend"):
        parse_config({"engine": {"backend": "sglang"}})


def test_the_engine_backend_is_part_of_the_key_namespace() -> None:
    native = parse_config({})
    vllm = parse_config({"engine": {"backend": "vllm"}})
    assert native.kv_namespace() == native.model.kv_namespace(block_size=native.store.block_size), (
        "the native backend keeps the namespace persistent stores already hold"
    )
    assert vllm.kv_namespace() != native.kv_namespace(), "vLLM's KV never hits blocks the native model wrote"
    assert vllm.kv_namespace(3) != vllm.kv_namespace(), "the weight version still separates namespaces"


def test_attention_layer_names_give_their_decoder_layer() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("language_model.model.layers.0.self_attn.attn") == 0
    with pytest.raises(ValueError, match="no layer index"):
        layer_index("lm_head")


def test_profile_refuses_a_vllm_config_and_says_what_to_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dualpath_ray.cli import main

    config = tmp_path / "vllm.yaml"
    config.write_text("engine:\n  backend: vllm\n")
    assert main(["profile", "--config", str(config), "--out", str(tmp_path / "p.json")]) == 2, "refused, exit 2"
    err = capsys.readouterr().err
    assert "engine.backend is vllm" in err and "dualpath bench" in err, f"the error names the field and the fix: {err}"
    assert not (tmp_path / "p.json").exists(), "nothing is written"
