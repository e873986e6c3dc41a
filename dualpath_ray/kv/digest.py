"""Per-token digests of Layer Blocks: the end-to-end check of KV on its way to attention.

The store's checksum covers a Full Block at rest. KV also crosses the network twice (buffer ->
prefill window, window -> decode buffer) and a copy (buffer -> decode HBM); each receiver
checks what landed against digests computed by whoever last held it verified, before it is
used. A digest is one int64 per (layer, token): a Fletcher-style pair of sums over the token's
bytes (plain and position-weighted), computed with tensor ops on the device where the KV is,
so checking costs a few passes over data that is already there, and only digests travel.
Any single flipped byte changes its token's digest (the plain sum changes by an odd amount).

A persisted block carries one digest of its own (`persist_digest`): its per-token digests folded
into one int64, from the engine that computed its KV; the reader checks the bytes the store
wrote against it before the block is published (runtime/reader/core.py write_block).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

_MIX = 1_000_003  # combines the two sums; int64 arithmetic wraps, which keeps them a checksum


# float32 adds integers exactly below 2**24: a chunk of k bytes has a position-weighted sum of at
# most 255 * k * (k + 1) / 2, which stays below that for k <= 362.
_EXACT_CHUNK = 362
_MIN_CHUNK = 32


def token_digests(rows: torch.Tensor) -> torch.Tensor:
    """[..., bytes] uint8 -> [...] int64: one digest per token row (on the rows' device)."""
    if rows.dtype != torch.uint8 or rows.dim() < 1:
        raise ValueError(f"token digests need [..., bytes] uint8 rows, got {tuple(rows.shape)} {rows.dtype}")
    plain, weighted = _sums(rows)
    return plain + weighted * _MIX


def _sums(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the plain and the position-weighted (1-based) byte sums, exactly, as int64.

    Digests are checked on every hop of every request's KV, so this is on the hot path: the rows
    are cut into chunks whose sums float32 adds exactly, summed with one matmul each (4 bytes
    per input byte, not the 16 of an int64 product), and combined in int64."""
    width = rows.shape[-1]
    chunk = next(k for k in range(min(width, _EXACT_CHUNK), 0, -1) if width % k == 0)
    if chunk < _MIN_CHUNK and width > chunk:
        values = rows.to(torch.int64)
        weights = torch.arange(1, width + 1, dtype=torch.int64, device=rows.device)
        return values.sum(dim=-1), (values * weights).sum(dim=-1)
    chunks = width // chunk
    values = rows.reshape(*rows.shape[:-1], chunks, chunk).to(torch.float32)
    local = torch.arange(1, chunk + 1, dtype=torch.float32, device=rows.device)
    chunk_plain = values.sum(dim=-1).to(torch.int64)
    chunk_weighted = (values @ local).to(torch.int64)
    offsets = torch.arange(chunks, dtype=torch.int64, device=rows.device) * chunk
    return chunk_plain.sum(dim=-1), (chunk_weighted + chunk_plain * offsets).sum(dim=-1)


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


def persist_digest(per_token: np.ndarray) -> int:
    """One Full Block's [n_layer, block_size] per-token digests folded into one signed int64
    (what a PersistedBlock carries): a hash of them in (layer, token) order, so a moved token
    changes it as a changed byte does."""
    folded = hashlib.blake2b(np.ascontiguousarray(per_token, dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(folded.digest(), "little", signed=True)


def full_block_digest(block: torch.Tensor) -> int:
    """persist_digest of one Full Block [n_layer, block_size, bytes] (on its own device)."""
    return persist_digest(block_digests(block.unsqueeze(0), block.shape[1]))
