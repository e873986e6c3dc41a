"""Reading a Hugging Face checkpoint's config.json into `model` section fields.

`load_config` fills the fields a YAML leaves out from these (and rejects those that disagree),
so a checkpoint's architecture is taken from the checkpoint. It reads JSON only: loading a
config never needs torch or the tensors (model/weights.py reads those).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dualpath_ray.config.model import ROPE_SCALING_TYPES


class WeightsError(ValueError):
    """A checkpoint cannot be loaded into the configured model; the message names the tensor.

    Defined with the config.json reading, the first part of a checkpoint anything reads (when a
    config loads); model/weights.py raises it for the tensors too, so callers catch one error."""


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
