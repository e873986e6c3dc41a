"""vLLM's paged KV cache as token-major KV, one layer at a time.

dualpath_ray keeps KV token-major everywhere it moves or stores it (kv/layout.py): one layer of
one token is [2, n_kv_head, head_dim] (K then V), so a store block, a buffer extent and the
prefill window hold the same bytes whichever engine computed them. vLLM keeps each layer in
pages laid out for its attention kernels. A `PageCodec` reads and writes token ranges of a
request's pages in that token-major form, for the page layouts of vLLM's attention backends:

- `head_major` (the CPU backend, "LBHNC"): a layer is [n_blocks, n_kv_head, block_size,
  2 * head_dim], each head's K row followed by its V row for every token of the block;
- `kv_first` (FlashAttention and Triton backends, NHD): [2, n_blocks, block_size, n_kv_head,
  head_dim], all Ks of the cache, then all Vs;
- `blocks_first` (FlashInfer, NHD): [n_blocks, 2, block_size, n_kv_head, head_dim].

Tokens are addressed by (page, slot) positions (`token_positions`: token t of a request whose
pages are `block_ids` is slot t % block_size of page block_ids[t // block_size]), so a step's
tokens of every request move in one indexed gather or scatter per layer, and a scatter into a
partly covered page keeps that page's other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

LAYOUTS = ("head_major", "kv_first", "blocks_first")


@dataclass(frozen=True)
class PageCodec:
    """How one vLLM attention backend lays out a layer's pages (see the module doc)."""

    layout: str
    n_kv_head: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown vLLM page layout {self.layout!r}; known: {', '.join(LAYOUTS)}")

    @classmethod
    def detect(cls, layer: torch.Tensor, n_kv_head: int, head_dim: int, block_size: int, on_cpu: bool) -> PageCodec:
        """The codec of a registered layer tensor, from its shape (and the platform: the CPU
        backend is the one head-major layout). Raises ValueError naming the shape otherwise."""
        shape = tuple(layer.shape)
        h, d, b = n_kv_head, head_dim, block_size
        if on_cpu and len(shape) == 4 and shape[1:] == (h, b, 2 * d):
            return cls("head_major", h, d, b)
        if len(shape) == 5 and shape[0] == 2 and shape[2:] == (b, h, d):
            return cls("kv_first", h, d, b)
        if len(shape) == 5 and shape[1:] == (2, b, h, d):
            return cls("blocks_first", h, d, b)
        raise ValueError(
            f"vLLM KV cache layer of shape {shape} matches no page layout this backend knows for "
            f"{h} KV heads, head_dim {d}, block_size {b} ({', '.join(LAYOUTS)}); use an attention "
            "backend with one of them (VLLM_ATTENTION_BACKEND)"
        )

    # --- tokens by position ---------------------------------------------------------------

    def gather(self, layer: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The KV [T, 2, H, D] of the tokens at (blocks[i], slots[i]) of one layer: one indexed
        read for any number of tokens of any number of requests."""
        h, d = self.n_kv_head, self.head_dim
        if self.layout == "head_major":
            return layer[blocks, :, slots].view(-1, h, 2, d).permute(0, 2, 1, 3)  # [T, H, 2D] -> [T, 2, H, D]
        if self.layout == "kv_first":
            return layer[:, blocks, slots].permute(1, 0, 2, 3)  # [2, T, H, D]
        return layer[blocks, :, slots]  # [T, 2, H, D]

    def scatter(self, layer: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store KV [T, 2, H, D] as the tokens at (blocks[i], slots[i]) of one layer."""
        h, d = self.n_kv_head, self.head_dim
        if kv.shape != (len(blocks), 2, h, d):
            raise ValueError(f"KV of shape {tuple(kv.shape)} for {len(blocks)} token positions")
        kv = kv.to(device=layer.device, dtype=layer.dtype)
        if self.layout == "head_major":
            layer[blocks, :, slots] = kv.permute(0, 2, 1, 3).reshape(-1, h, 2 * d)
        elif self.layout == "kv_first":
            layer[:, blocks, slots] = kv.permute(1, 0, 2, 3)
        else:
            layer[blocks, :, slots] = kv

    def positions(self, spans: Sequence[tuple[Sequence[int], int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of every token of each (block_ids, lo, hi) span, in vLLM's pages."""
        return token_positions(spans, self.block_size, device)

    # --- token ranges ---------------------------------------------------------------------

    def read(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of one layer as token-major KV [hi - lo, 2, H, D] (a copy)."""
        return self.gather(layer, *self.positions([(block_ids, lo, hi)], layer.device))

    def write(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, kv: torch.Tensor) -> None:
        """Store token-major KV [hi - lo, 2, H, D] as tokens [lo, hi) of one layer."""
        self.scatter(layer, *self.positions([(block_ids, lo, hi)], layer.device), kv)


def token_positions(
    spans: Sequence[tuple[Sequence[int], int, int]], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot in the page) of every token of each (table, lo, hi) span, spans in order: a
    sequence's page table[i] holds its tokens [i * block_size, (i + 1) * block_size). Two tensors
    for any number of spans (a decode step's are one token each); ValueError past a table's pages."""
    pages, slots = [], []
    for table, lo, hi in spans:
        if not 0 <= lo <= hi or hi > len(table) * block_size:
            raise ValueError(f"tokens [{lo}, {hi}) are not inside {len(table)} pages of {block_size}")
        tokens = np.arange(lo, hi, dtype=np.int64)
        pages.append(np.asarray(table, dtype=np.int64)[tokens // block_size])
        slots.append(tokens % block_size)
    if not pages:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.from_numpy(np.concatenate(pages)).to(device), torch.from_numpy(np.concatenate(slots)).to(device)
