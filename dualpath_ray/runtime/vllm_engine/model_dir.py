"""The model directory a vLLM engine loads: the user's (engine.vllm_model) or the `model` section
written as a Llama config.json for vLLM's dummy weights.

vLLM's dummy loader fills every weight from a fixed seed, so every engine of a cluster (each its
own process) computes with the same weights: a prefill engine's KV is what its decode engine
would have computed. Either way the directory's KV geometry must be the model section's, since
that is what every buffer, transfer and store block of the cluster is sized by (kv/layout.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from dualpath_ray.config import ModelConfig


def hf_config_of(model: ModelConfig) -> dict[str, Any]:
    """The model section as a Hugging Face Llama config."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head, "num_key_value_heads": model.n_kv_head, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_context, "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta, "torch_dtype": model.dtype, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if model.rope_scaling is not None:
        config["rope_scaling"] = model.rope_scaling.model_dump(exclude_none=True)
    return config


def dummy_model_dir(model: ModelConfig) -> Path:
    """A fresh directory holding the model section's config.json (vLLM loads dummy weights)."""
    directory = Path(tempfile.mkdtemp(prefix="dualpath-vllm-model-"))
    (directory / "config.json").write_text(json.dumps(hf_config_of(model), indent=1))
    return directory


def check_kv_geometry(directory: Path, model: ModelConfig) -> None:
    """Raise ValueError naming each field where the directory's config.json and the model section
    disagree on the KV layout (layers, KV heads, head_dim)."""
    path = directory / "config.json"
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
