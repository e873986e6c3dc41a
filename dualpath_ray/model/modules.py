"""The decoder's building blocks, named as the Hugging Face Qwen2/Llama checkpoints name them.

Parameters start uninitialised (torch.empty), so building a model touches no RNG; DecoderModel
fills them from a checkpoint or from its own seeded generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dualpath_ray.config import ModelConfig


class Linear(nn.Module):
    """y = x W^T (+ b); parameters start uninitialised so construction touches no RNG."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, width, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class AttentionProjections(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_width, bias, dtype)
        self.k_proj = Linear(cfg.hidden_size, kv_width, bias, dtype)
        self.v_proj = Linear(cfg.hidden_size, kv_width, bias, dtype)
        self.o_proj = Linear(q_width, cfg.hidden_size, False, dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.self_attn = AttentionProjections(cfg, bias, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, bias, dtype) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
