"""Hugging Face style safetensors checkpoints (Qwen2/Llama parameter names) for DecoderModel.

A checkpoint directory holds either one `model.safetensors`, or shards listed by
`model.safetensors.index.json` (its `weight_map` names the file of every tensor), or, failing
both, any `*.safetensors` files. The architecture variant is read from the tensor names: q/k/v
biases present means Qwen2-style attention bias; no `lm_head.weight` means the lm_head is tied to
the embedding. Shapes are checked against the ModelConfig before anything is copied, so a
checkpoint of the wrong model fails with the name of the first tensor that does not fit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dualpath_ray.config import ROPE_SCALING_TYPES, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"

# Buffers that some exported checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """A checkpoint cannot be loaded into the configured model; the message names the tensor."""


class Architecture(NamedTuple):
    """The variant switches a Llama-family checkpoint can differ in."""

    attention_bias: bool
    tie_word_embeddings: bool


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expected_shapes(cfg: ModelConfig, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the model and its shape, in the model's registration order."""
    hidden, q_width = cfg.hidden_size, cfg.n_head * cfg.head_dim
    kv_width = cfg.n_kv_head * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for layer in range(cfg.n_layer):
        p = layer_prefix(layer)
        shapes[p + "self_attn.q_proj.weight"] = (q_width, hidden)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_width,)
        for name in ("k_proj", "v_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (kv_width, hidden)
            if arch.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (kv_width,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_width)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, hidden)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, cfg.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, hidden)
    return shapes


def detect_architecture(names: set[str]) -> Architecture:
    """The variant a set of checkpoint tensor names describes."""
    return Architecture(
        attention_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
        tie_word_embeddings=LM_HEAD not in names,
    )


def validate_checkpoint(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Architecture
) -> None:
    """Raise WeightsError naming the first missing, unexpected or mis-shaped tensor."""
    expected = expected_shapes(cfg, arch)
    for name, shape in expected.items():
        if name not in tensors:
            raise WeightsError(f"{name}: missing from the checkpoint (expected shape {list(shape)})")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise WeightsError(
                f"{name}: shape {list(got)} does not match the model config, which needs "
                f"{list(shape)}; set model.* (hidden_size, n_head, n_kv_head, head_dim, "
                f"intermediate_size, vocab_size, n_layer) to the checkpoint's values"
            )
        if not tensors[name].is_floating_point():
            raise WeightsError(f"{name}: dtype {tensors[name].dtype} is not a floating point type")
    unexpected = sorted(
        n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise WeightsError(
            f"{unexpected[0]}: not a parameter of a {cfg.n_layer}-layer model "
            f"({len(unexpected)} unexpected tensors); check model.n_layer"
        )


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from None


def _shard_files(directory: Path) -> list[Path]:
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{index_path}: not a valid safetensors index ({exc!r})") from None
    files = []
    for file_name in dict.fromkeys(weight_map.values()):
        path = (directory / file_name).resolve()
        if path.parent != directory.resolve():
            raise WeightsError(f"{index_path}: shard {file_name!r} is outside the checkpoint directory")
        if not path.is_file():
            raise WeightsError(f"{index_path}: shard {file_name!r} does not exist")
        files.append(path)
    return files


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order."""
    if not directory.is_dir():
        raise WeightsError(f"model.weights_dir: {directory} is not a directory")
    if (directory / INDEX_FILE).is_file():
        return _shard_files(directory)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"model.weights_dir: no *.safetensors files in {directory}")
    return files


def read_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory by name; a name in two shards is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(directory)):
        for name, tensor in _load_file(path).items():
            if name in tensors:
                raise WeightsError(f"{name}: appears in more than one shard ({path.name} repeats it)")
            tensors[name] = tensor
    return tensors


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor], directory: str | Path, shards: int = 1
) -> list[Path]:
    """Write tensors as an HF-style checkpoint: one file, or `shards` files plus an index."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = [(n, t.detach().contiguous()) for n, t in tensors.items()]
    if shards == 1:
        path = directory / SINGLE_FILE
        save_file(dict(items), str(path))
        return [path]
    per_shard = -(-len(items) // shards)
    weight_map: dict[str, str] = {}
    paths = []
    for i in range(shards):
        chunk = items[i * per_shard : (i + 1) * per_shard]
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(dict(chunk), str(directory / file_name))
        weight_map.update({name: file_name for name, _ in chunk})
        paths.append(directory / file_name)
    total = sum(t.numel() * t.element_size() for _, t in items)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return paths


# HF config.json keys -> ModelConfig fields they set.
_HF_CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "intermediate_size": "intermediate_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_context",
}
# Decoders with exactly this model's computation and tensor names (Mistral is Llama plus a
# sliding window, which equals full attention over a context no longer than the window).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
# rope_type values that mean unscaled RoPE.
_PLAIN_ROPE = ("default", None)


def model_fields_from_hf_config(directory: str | Path) -> dict[str, Any]:
    """ModelConfig fields read from a checkpoint's config.json (`load_config` fills from these).

    Reads the shapes, rope_theta and rope_scaling (both the `rope_type` and the older `type` key;
    transformers 5's `rope_parameters` too), rms_norm_eps, max_position_embeddings (capped at an
    active sliding window) and torch_dtype where it is a model dtype. A model_type other than
    llama/qwen2/mistral, or an MLP activation other than silu, is a WeightsError.
    """
    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: cannot read the Hugging Face config ({exc})") from None
    if not isinstance(hf, dict):
        raise WeightsError(f"{path}: the Hugging Face config must be a JSON object")
    _check_supported(hf, path)
    fields = {ours: hf[theirs] for theirs, ours in _HF_CONFIG_FIELDS.items() if hf.get(theirs) is not None}
    if hf.get("num_key_value_heads") is None and "n_head" in fields:
        fields["n_kv_head"] = fields["n_head"]  # HF's default: no grouping
    if hf.get("head_dim"):
        fields["head_dim"] = hf["head_dim"]
    elif "hidden_size" in hf and "num_attention_heads" in hf:
        fields["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    window = _sliding_window(hf)
    if window is not None and window < fields.get("max_context", window + 1):
        fields["max_context"] = window
    dtype = _HF_DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype")))
    if dtype is not None:
        fields["dtype"] = dtype
    fields.update(_rope_fields(hf))
    return fields


def _check_supported(hf: dict[str, Any], path: Path) -> None:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise WeightsError(
            f"{path}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama/Qwen2-style decoders)"
        )
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise WeightsError(f"{path}: hidden_act {activation!r} is not supported; the MLP is SwiGLU (silu)")


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window in tokens when one is in effect, else None."""
    window = hf.get("sliding_window")
    # Qwen2 configs carry a window size even when `use_sliding_window` switches it off.
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling; an unsupported rope type is passed on for ModelConfig to reject.

    No scaling in config.json is a fact too (rope_scaling None), so a YAML that sets one disagrees.
    """
    fields: dict[str, Any] = {"rope_scaling": None}
    scaling = hf.get("rope_scaling")
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict):  # transformers >= 5 puts theta and scaling in one dict
        if parameters.get("rope_theta") is not None:
            fields["rope_theta"] = parameters["rope_theta"]
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    if not isinstance(scaling, dict):
        return fields
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in _PLAIN_ROPE:
        return fields
    if rope_type in ROPE_SCALING_TYPES:
        # Every other key goes through, so ModelConfig rejects one it would otherwise ignore.
        fields["rope_scaling"] = {
            **{k: v for k, v in scaling.items() if k != "type"},
            "rope_type": rope_type,
        }
    else:
        # Only the type, so the error is "unsupported rope_type", not its parameters' names.
        fields["rope_scaling"] = {"rope_type": rope_type, "factor": scaling.get("factor", 1.0)}
    return fields
