"""Rotary position embedding: inverse frequencies (with rope_scaling) and the rotation.

The rotation is the "rotate half" form of the Hugging Face Llama/Qwen2 checkpoints: a head's
dimension i is paired with i + head_dim/2, not with its neighbour, and both halves share the
frequency inv_freq[i]. Angles are computed in float32 whatever the model dtype, so a bf16 model's
rotation differs from a float32 one only by the final rounding.
"""

from __future__ import annotations

import math

import torch

from dualpath_ray.config import ModelConfig, RopeScaling


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of `cfg`, after its rope_scaling."""
    # float32, as the checkpoints' reference implementations compute it. The llama3 blend is
    # continuous at its band edges, so rounding that moves a frequency across one changes nothing.
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta**exponents
    return inv_freq if cfg.rope_scaling is None else scaled_inv_freq(inv_freq, cfg.rope_scaling)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """`inv_freq` under `scaling` (linear or llama3, as ModelConfig validated it)."""
    if scaling.rope_type == "linear":
        # Dividing each frequency by the factor is dividing every position by it.
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"model.rope_scaling.rope_type {scaling.rope_type!r} has no implementation")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's per-frequency scaling.

    With L = original_max_position_embeddings and a frequency's wavelength w = 2 pi / f:
    w < L / high_freq_factor (many turns within L) keeps f; w > L / low_freq_factor (less than
    low_freq_factor turns within L) becomes f / factor; in between, with the number of turns
    r = L / w, the blend is (1 - s) f / factor + s f where s = (r - low) / (high - low) runs
    from 0 at the low-frequency edge to 1 at the high-frequency edge.
    """
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    context = float(scaling.original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    turns = context / wavelength
    smooth = ((turns - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    # The clamp already gives the two outer bands; choosing them explicitly keeps them exact.
    high_band = wavelength < context / high
    low_band = wavelength > context / low
    return torch.where(high_band, inv_freq, torch.where(low_band, inv_freq / scaling.factor, blended))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, head_dim] in `dtype`, broadcasting over heads."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the angles of `rope_cos_sin`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
