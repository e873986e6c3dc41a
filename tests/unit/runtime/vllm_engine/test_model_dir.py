"""The vllm backend's config surface: the model directory it writes (the native engine's weights,
cached per model section), the KV geometry check of a user's directory, the engine section's
rules and the key namespace (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import ConfigError, ModelConfig, parse_config
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.weights import Architecture, read_checkpoint, write_checkpoint
from dualpath_ray.runtime.vllm_engine.step_kv import layer_index
from dualpath_ray.runtime.vllm_engine.model_dir import check_kv_geometry, hf_config_of, model_dir_of

SMALL = {"n_layer": 3, "n_head": 4, "n_kv_head": 2, "head_dim": 32, "hidden_size": 128}


def test_the_model_section_is_written_as_a_llama_config(tmp_path: Path) -> None:
    model = ModelConfig(**SMALL)
    written = json.loads((model_dir_of(model, root=tmp_path) / "config.json").read_text())
    assert written == hf_config_of(model), "the directory holds exactly the model section's config"
    assert (written["num_hidden_layers"], written["num_key_value_heads"], written["head_dim"]) == (3, 2, 32), (
        "the KV geometry vLLM builds its pages from is the model section's"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weights_written_are_the_native_engines_seeded_ones(tmp_path: Path, dtype: str) -> None:
    model = ModelConfig(**SMALL, seed=5, dtype=dtype)
    written = read_checkpoint(model_dir_of(model, root=tmp_path))
    native = DecoderModel(model).checkpoint_tensors()
    assert written.keys() == native.keys(), "every parameter of the native model, by its Hugging Face name"
    for name, tensor in native.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), (
            f"{name}: the native engine's seeded weight, bit for bit in model.dtype ({dtype})"
        )


def test_a_written_directory_is_cached_by_what_determines_it(tmp_path: Path) -> None:
    model = ModelConfig(**SMALL)
    first = model_dir_of(model, root=tmp_path)
    written_at = (first / "model.safetensors").stat().st_mtime_ns
    assert model_dir_of(model, root=tmp_path) == first, "the same model section finds the same directory"
    assert (first / "model.safetensors").stat().st_mtime_ns == written_at, "a cached directory is not rewritten"
    others = {
        "seed": model_dir_of(model.model_copy(update={"seed": 1}), root=tmp_path),
        "dtype": model_dir_of(model.model_copy(update={"dtype": "bfloat16"}), root=tmp_path),
        "dummy": model_dir_of(model, weights=False, root=tmp_path),
    }
    assert len({first, *others.values()}) == 4, f"seed, dtype and dummy weights each have their own directory: {others}"
    assert not list(others["dummy"].glob("*.safetensors")), "dummy weights: the config only, vLLM fills the weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in {first, *others.values()}), (
        "no staging directory is left behind"
    )


def test_a_checkpoints_variant_is_written_for_vllms_llama(tmp_path: Path) -> None:
    # A Qwen2-style checkpoint (q/k/v biases, tied lm_head) behind model.weights_dir: vLLM's Llama
    # reads qkv_bias (biases on q/k/v, none on o_proj) and tie_word_embeddings.
    model = ModelConfig(**SMALL)
    qwen_like = DecoderModel(model, arch=Architecture(attention_bias=True, tie_word_embeddings=True))
    write_checkpoint(qwen_like.checkpoint_tensors(), tmp_path / "ckpt")
    with_checkpoint = model.model_copy(update={"weights_dir": tmp_path / "ckpt"})
    directory = model_dir_of(with_checkpoint, root=tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert (config["qkv_bias"], config["attention_bias"], config["tie_word_embeddings"]) == (True, False, True), (
        f"the checkpoint's variant is in the config vLLM builds its Llama from: {config}"
    )
    written = read_checkpoint(directory)
    assert all(torch.equal(written[n], t) for n, t in qwen_like.checkpoint_tensors().items()), (
        "the checkpoint's weights are what vLLM loads"
    )


def test_dummy_weights_with_a_checkpoint_is_a_config_error_naming_both_fields() -> None:
    with pytest.raises(ConfigError, match=r"engine.vllm_dummy_weights is true but engine.vllm_model"):
        parse_config({"engine": {"backend": "vllm", "vllm_model": "/models/x", "vllm_dummy_weights": True}})


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
    dummy = parse_config({"engine": {"backend": "vllm", "vllm_dummy_weights": True}})
    assert dummy.kv_namespace() != vllm.kv_namespace(), "vLLM's dummy weights never hit blocks the seeded ones wrote"


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
