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

Tokens [lo, hi) of a request whose pages are `block_ids` (block i holds tokens
[i * block_size, (i + 1) * block_size)) are gathered from, or scattered into, only the pages the
range touches; a scatter into a partly covered page keeps that page's other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

    # --- whole pages <-> token-major ------------------------------------------------------

    def _pages(self, layer: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Pages `ids` of a layer as token-major KV [len(ids) * block_size, 2, H, D] (a copy)."""
        h, d, b = self.n_kv_head, self.head_dim, self.block_size
        if self.layout == "head_major":
            pages = layer.index_select(0, ids).view(len(ids), h, b, 2, d)
            return pages.permute(0, 2, 3, 1, 4).reshape(len(ids) * b, 2, h, d)
        if self.layout == "kv_first":
            pages = layer.index_select(1, ids)  # [2, n, b, h, d]
            return pages.permute(1, 2, 0, 3, 4).reshape(len(ids) * b, 2, h, d)
        pages = layer.index_select(0, ids)  # [n, 2, b, h, d]
        return pages.permute(0, 2, 1, 3, 4).reshape(len(ids) * b, 2, h, d)

    def _put_pages(self, layer: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write token-major KV [len(ids) * block_size, 2, H, D] into pages `ids` of a layer."""
        h, d, b = self.n_kv_head, self.head_dim, self.block_size
        n = len(ids)
        if self.layout == "head_major":
            pages = tokens.view(n, b, 2, h, d).permute(0, 3, 1, 2, 4).reshape(n, h, b, 2 * d)
            layer.index_copy_(0, ids, pages)
        elif self.layout == "kv_first":
            layer.index_copy_(1, ids, tokens.view(n, b, 2, h, d).permute(2, 0, 1, 3, 4))
        else:
            layer.index_copy_(0, ids, tokens.view(n, b, 2, h, d).permute(0, 2, 1, 3, 4))

    # --- token ranges ---------------------------------------------------------------------

    def _touched(self, block_ids: Sequence[int], lo: int, hi: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """The pages tokens [lo, hi) touch, and the first of those pages' first token."""
        if not 0 <= lo < hi or hi > len(block_ids) * self.block_size:
            raise ValueError(f"tokens [{lo}, {hi}) are not inside {len(block_ids)} pages of {self.block_size}")
        first, last = lo // self.block_size, (hi - 1) // self.block_size
        ids = torch.as_tensor(list(block_ids[first : last + 1]), dtype=torch.int64, device=device)
        return ids, first * self.block_size

    def read(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of one layer as token-major KV [hi - lo, 2, H, D] (a copy)."""
        ids, base = self._touched(block_ids, lo, hi, layer.device)
        return self._pages(layer, ids)[lo - base : hi - base]

    def write(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, kv: torch.Tensor) -> None:
        """Store token-major KV [hi - lo, 2, H, D] as tokens [lo, hi) of one layer."""
        ids, base = self._touched(block_ids, lo, hi, layer.device)
        if kv.shape != (hi - lo, 2, self.n_kv_head, self.head_dim):
            raise ValueError(f"KV of shape {tuple(kv.shape)} for tokens [{lo}, {hi})")
        partial = lo != base or hi != base + len(ids) * self.block_size
        pages = self._pages(layer, ids) if partial else torch.empty(
            (len(ids) * self.block_size, 2, self.n_kv_head, self.head_dim), dtype=layer.dtype, device=layer.device
        )
        pages[lo - base : hi - base] = kv.to(device=layer.device, dtype=layer.dtype)
        self._put_pages(layer, ids, pages)
