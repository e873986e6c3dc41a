"""Where a Full Block lies in page memory that does not keep Full Blocks: `PagedBlockLayers`.

A native decode engine's page is one Full Block (kv/paged.py), which its node's reader pulls as
one region to persist it. A compute that keeps the KV in pages of its own layout (vLLM's, one
backing buffer for every layer: runtime/vllm_engine/block_layers.py) holds each layer of a block
as a few contiguous byte runs whose elements follow the page layout's axes. This object is what
the reader needs to pull such a block straight from those pages into a buffer slot and make it
the store's token-major Full Block ([n_layer, block_size, 2, H, D], kv/layout.py) there:

- `runs(page)`: the (byte offset in `pool`, bytes) of every run of every layer of the page, in
  slot order (layer 0's runs, then layer 1's, ...). Pulled back to back, they fill the slot with
  n_layer block-layers in storage order: one descriptor per run, one block-layer moved per layer.
- `to_token_major(block)`: in place, each block-layer of a pulled slot from storage order to
  token-major. A block-layer's storage order is its three outer page axes (kernel page of the
  block, KV head, token of the kernel page) in the order of their strides, then the K-and-V
  content (K row, V row of head_dim each), so one axis permutation maps it: one read and one
  write of the block in the reader's memory, no transport. Pages whose kernels keep a head's
  K transposed (`k_dim_major`, vLLM's CPU attention: per kernel page and head, K as
  [head_dim, tokens] then V as [tokens, head_dim]) have the token axis innermost of the outer
  axes and K's token and dim axes swapped; the rewrite transposes K on the way.

It is small (a few hundred bytes) and frozen: sent with every persist of such pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

# The logical axes of a block-layer's elements: kernel page of the block, KV head, token of the
# kernel page, K or V, head dim. Token-major is (page, token, K/V, head, dim).
PAGE, HEAD, TOKEN, KV, DIM = range(5)
TOKEN_MAJOR = (PAGE, TOKEN, KV, HEAD, DIM)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class PagedBlockLayers:
    """See the module doc. `stored_axes`: the logical axes in storage order (outermost first;
    always ending with K/V and head dim); `sizes`: each logical axis's size."""

    pool: str
    layer_base: tuple[int, ...]  # byte offset of block 0 of each layer, in model order
    block_stride: int  # bytes between a layer's block b and b + 1
    pattern: tuple[tuple[int, int], ...]  # (byte offset from the block-layer's base, bytes) of each run
    stored_axes: tuple[int, ...]
    sizes: tuple[int, ...]  # (kernel pages per block, KV heads, tokens per kernel page, 2, head_dim)
    element_size: int
    # Within each (kernel page, head): K as [head_dim, tokens], then V as [tokens, head_dim]
    # (stored_axes then name TOKEN last of the outer axes).
    k_dim_major: bool = False

    def __post_init__(self) -> None:
        if sorted(self.stored_axes) != list(range(5)) or self.stored_axes[3:] != (KV, DIM):
            raise ValueError(f"stored_axes {self.stored_axes}: an order of the 5 block-layer axes ending with K/V, dim")
        if self.k_dim_major and self.stored_axes[2] != TOKEN:
            raise ValueError(f"stored_axes {self.stored_axes}: k_dim_major pages keep the token axis inside kernel page and head")
        if len(self.sizes) != 5 or self.sizes[KV] != 2 or min(self.sizes) <= 0:
            raise ValueError(f"sizes {self.sizes}: (kernel pages, KV heads, tokens per page, 2, head_dim), all > 0")
        if self.element_size not in _INTS:
            raise ValueError(f"element_size {self.element_size}: one of {sorted(_INTS)} bytes")
        if sum(nbytes for _, nbytes in self.pattern) != self.block_layer_bytes:
            raise ValueError(f"runs of {sum(n for _, n in self.pattern)} bytes for block-layers of {self.block_layer_bytes}")

    @property
    def block_layer_bytes(self) -> int:
        return prod(self.sizes) * self.element_size

    @property
    def n_layer(self) -> int:
        return len(self.layer_base)

    def runs(self, page: int) -> list[tuple[int, int]]:
        """(byte offset in the pool, bytes) of each run of page `page`, every layer, in slot order."""
        return [
            (base + page * self.block_stride + offset, nbytes)
            for base in self.layer_base
            for offset, nbytes in self.pattern
        ]

    def to_token_major(self, block: torch.Tensor) -> None:
        """Rewrite a pulled block (n_layer block-layers in storage order, contiguous, any shape
        of n_layer * block_layer_bytes bytes) in place as the store's token-major Full Block."""
        flat = block.reshape(-1).view(torch.uint8)
        if flat.numel() != self.n_layer * self.block_layer_bytes or flat.data_ptr() != block.data_ptr():
            raise ValueError(f"a pulled block of {flat.numel()} bytes for {self.n_layer} block-layers of {self.block_layer_bytes}")
        stored = self._stored_axes_view(flat.view(_INTS[self.element_size]).view(self.n_layer, -1))
        where = [self.stored_axes.index(axis) + 1 for axis in TOKEN_MAJOR]
        flat.copy_(stored.permute(0, *where).contiguous().view(-1).view(torch.uint8))

    def token_major_index(self) -> torch.Tensor:
        """Where in the stored block-layer (element index) each token-major element lies: what
        the compute's exact page map checks this description against."""
        stored = self._stored_axes_view(torch.arange(prod(self.sizes), dtype=torch.int64).view(1, -1))[0]
        return stored.permute(*[self.stored_axes.index(axis) for axis in TOKEN_MAJOR]).reshape(-1)

    def _stored_axes_view(self, layers: torch.Tensor) -> torch.Tensor:
        """Block-layers [n, block-layer elements] in storage order as [n, *stored_axes sizes]: a
        view, or for k_dim_major pages a tensor whose K is transposed back to [tokens, head_dim]."""
        shape = [self.sizes[a] for a in self.stored_axes]
        if not self.k_dim_major:
            return layers.view(len(layers), *shape)
        tokens, dim = self.sizes[TOKEN], self.sizes[DIM]
        pages = layers.view(len(layers), *shape[:2], 2 * tokens * dim)
        keys = pages[..., : tokens * dim].unflatten(-1, (dim, tokens)).transpose(-1, -2)
        values = pages[..., tokens * dim :].unflatten(-1, (tokens, dim))
        return torch.stack((keys, values), -2)
