"""Per-token digests of Layer Blocks: the end-to-end check of KV on its way to attention.

The store's checksum covers a Full Block at rest. KV also crosses the network twice (buffer ->
prefill window, window -> decode buffer) and a copy (buffer -> decode HBM); each receiver
checks what landed against digests computed by whoever last held it verified, before it is
used. A digest is one int64 per (layer, token): a Fletcher-style pair of sums over the token's
bytes (plain and position-weighted), computed with tensor ops on the device where the KV is,
so checking costs a few passes over data that is already there, and only digests travel.
Any single flipped byte changes its token's digest (the plain sum changes by an odd amount).
"""

from __future__ import annotations

import numpy as np
import torch

_MIX = 1_000_003  # combines the two sums; int64 arithmetic wraps, which keeps them a checksum


def token_digests(rows: torch.Tensor) -> torch.Tensor:
    """[..., bytes] uint8 -> [...] int64: one digest per token row (on the rows' device)."""
    if rows.dtype != torch.uint8 or rows.dim() < 1:
        raise ValueError(f"token digests need [..., bytes] uint8 rows, got {tuple(rows.shape)} {rows.dtype}")
    values = rows.to(torch.int64)
    weights = torch.arange(1, rows.shape[-1] + 1, dtype=torch.int64, device=rows.device)
    return values.sum(dim=-1) + (values * weights).sum(dim=-1) * _MIX


def block_digests(blocks: torch.Tensor, tokens: int) -> np.ndarray:
    """Full Blocks [n_blocks, n_layer, block_size, bytes] in token order -> [n_layer, tokens]
    digests of their first `tokens` tokens, as a host array."""
    n_blocks, n_layer, block_size, _ = blocks.shape
    if tokens > n_blocks * block_size:
        raise ValueError(f"{tokens} tokens exceed {n_blocks} blocks of {block_size}")
    per_token = token_digests(blocks).permute(1, 0, 2).reshape(n_layer, n_blocks * block_size)
    return per_token[:, :tokens].cpu().numpy()


def window_digests(rows: torch.Tensor) -> np.ndarray:
    """One layer's contiguous [tokens, bytes] rows (a prefill window slot) -> [tokens] digests."""
    return token_digests(rows).cpu().numpy()


def mismatched_tokens(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Flat positions whose digests differ (same shapes)."""
    if got.shape != want.shape:
        raise ValueError(f"digest shapes differ: {got.shape} vs {want.shape}")
    return np.flatnonzero(got != want)
