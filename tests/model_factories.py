"""Small model configs and token sequences shared by the model and demo tests."""

from __future__ import annotations

from typing import Any

import torch

from dualpath_ray.config import ModelConfig


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """A decoder small enough that a test prefills hundreds of tokens in milliseconds."""
    fields: dict[str, Any] = dict(
        vocab_size=97,
        hidden_size=32,
        n_layer=3,
        n_head=4,
        n_kv_head=2,
        head_dim=8,
        intermediate_size=64,
        max_context=512,
        seed=7,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def random_tokens(count: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """`count` token ids drawn from a private generator (never the global RNG)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=generator)
