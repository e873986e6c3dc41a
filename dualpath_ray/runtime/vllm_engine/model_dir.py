"""The model directory a vLLM engine loads: the user's (engine.vllm_model), or the `model` section
written out as a Hugging Face Llama directory: its config.json and, by default, its weights.

The weights written are the native engine's (model/llama.py `DecoderModel`): its seeded random
weights (model.seed, fan-in scaled), or model.weights_dir's checkpoint, as one safetensors file
in the model dtype. So a vLLM engine without a checkpoint computes the same model as the native
engine, with spread-out logits: greedy tokens depend on the whole prompt, so a test comparing
them with a reference run sees wrong KV. Every engine of a cluster (each its own process) loads
the same file, so a prefill engine's KV is what its decode engine would have computed.

engine.vllm_dummy_weights writes the config.json only, and vLLM fills its dummy weights (uniform
in [-1e-3, 1e-3] from a fixed seed): free to start whatever the model's size, but KV is ~1e-6 and
greedy tokens follow almost only the last token, blind to wrong KV.

A written directory is cached in the temp directory under a digest of everything it depends on
(the model section, a checkpoint's files, whether weights are written, this module's format), so
the engines of one machine write it once; it is published by renaming a complete directory, so
engines starting together never load a half-written one. Either way the directory's KV geometry
must be the model section's, since that is what every buffer, transfer and store block of the
cluster is sized by (kv/layout.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dualpath_ray.config import ModelConfig
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.weights import Architecture, checkpoint_files, write_checkpoint

# Part of every cache digest: a change of what a written directory holds changes its name.
FORMAT_REVISION = "hf-llama-1"
CONFIG_FILE = "config.json"
PLAIN_LLAMA = Architecture(attention_bias=False, tie_word_embeddings=False)


def hf_config_of(model: ModelConfig, arch: Architecture = PLAIN_LLAMA) -> dict[str, Any]:
    """The model section as a Hugging Face Llama config, of the variant `arch` (a Qwen2-style
    checkpoint's q/k/v biases are vLLM Llama's qkv_bias: no o_proj bias)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head, "num_key_value_heads": model.n_kv_head, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_context, "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta, "torch_dtype": model.dtype,
        "tie_word_embeddings": arch.tie_word_embeddings, "attention_bias": False, "qkv_bias": arch.attention_bias,
        "hidden_act": "silu",
    }
    if model.rope_scaling is not None:
        config["rope_scaling"] = model.rope_scaling.model_dump(exclude_none=True)
    return config


def model_digest(model: ModelConfig, *, weights: bool) -> str:
    """What a written directory depends on: the model section (seed and dtype included), the
    files of model.weights_dir (path, size, mtime: a rewritten checkpoint is another directory),
    whether it holds weights, and FORMAT_REVISION."""
    parts: list[Any] = [FORMAT_REVISION, weights, model.model_dump(mode="json")]
    if weights and model.weights_dir is not None:
        parts.append([(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in checkpoint_files(model.weights_dir)])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _write(model: ModelConfig, directory: Path, *, weights: bool) -> None:
    arch = PLAIN_LLAMA
    if weights:
        native = DecoderModel(model)  # model.seed's random weights, or model.weights_dir's checkpoint
        arch = native.arch
        write_checkpoint(native.checkpoint_tensors(), directory)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config_of(model, arch), indent=1))


def model_dir_of(model: ModelConfig, *, weights: bool = True, root: Path | None = None) -> Path:
    """The model section's directory for vLLM, written once per machine under `root` (the temp
    directory): with `weights`, the native engine's weights as a safetensors checkpoint (vLLM
    loads them, load_format auto); without, the config.json only (vLLM's dummy weights)."""
    root = Path(tempfile.gettempdir()) if root is None else root
    final = root / f"dualpath-vllm-model-{model_digest(model, weights=weights)}"
    if (final / CONFIG_FILE).is_file():
        return final
    staging = Path(tempfile.mkdtemp(prefix=".dualpath-vllm-model-", dir=root))
    try:
        _write(model, staging, weights=weights)
        os.rename(staging, final)
    except OSError:
        # Another engine published the same directory first (rename onto a non-empty one fails):
        # it holds the same files. Anything else is a real error.
        if not (final / CONFIG_FILE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def check_kv_geometry(directory: Path, model: ModelConfig) -> None:
    """Raise ValueError naming each field where the directory's config.json and the model section
    disagree on the KV layout (layers, KV heads, head_dim)."""
    path = directory / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"engine.vllm_model: cannot read {path} ({exc})") from None
    text = hf.get("text_config", hf)
    heads = text.get("num_attention_heads")
    theirs = {
        "n_layer": text.get("num_hidden_layers"),
        "n_kv_head": text.get("num_key_value_heads", heads),
        "head_dim": text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None),
    }
    wrong = [
        f"model.{field} is {getattr(model, field)} but {path} says {value}"
        for field, value in theirs.items() if value is not None and value != getattr(model, field)
    ]
    if wrong:
        raise ValueError(
            "engine.vllm_model's KV layout differs from the model section (buffers, transfers and store blocks are "
            f"sized by the model section): {'; '.join(wrong)}. Set the model section from the checkpoint "
            "(model.weights_dir fills it) or fix the fields"
        )
