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
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dualpath_ray.config.hf import WeightsError
from dualpath_ray.config.model import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"

# Buffers that some exported checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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


def weights_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """A digest of a state dict: every tensor's name, dtype, shape and bytes, in name order, so
    the same weights give the same fingerprint whatever their order or device. It names a weight
    version's tensors in the weight ledger (runtime/weights/ledger.py). Cost: one pass of
    xxh3 over the bytes (GB/s on one core), plus a device-to-host copy of GPU tensors."""
    import xxhash

    hasher = xxhash.xxh3_128()
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        header = f"{name}\x00{str(tensor.dtype).removeprefix('torch.')}\x00{tuple(tensor.shape)}\x00"
        hasher.update(header.encode())
        hasher.update(tensor.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().data)
    return "tensors:" + hasher.hexdigest()
