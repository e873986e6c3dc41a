"""Where each layer of each vLLM block lies in vLLM's own KV memory, so a transport can land a
store block-layer straight in the pages vLLM allocated: `BlockLayerMap`.

vLLM 0.32 allocates every layer's pages in one int8 backing buffer (v1/worker/utils.py
`allocate_kv_cache`) and hands the connector per-layer [B, H, N, C] views of it (pages.py). That
buffer is the one transport pool a vLLM engine registers for KV: a Region of it addresses any
block of any layer, on the CPU (host memory) and on a GPU (device memory, NIXL/verbs) alike.

What the transport moves is the store's format, unchanged: one block-layer is the block's tokens
token-major ([block_size, 2, H, D], kv/layout.py), the bytes every reader buffer, store block and
native engine holds. Those bytes land in the block-layer's own bytes of vLLM's buffer (`runs`:
the block-layer's contiguous byte runs in storage order, one run for the dense layouts), and
`settle` then rewrites them, in place, into the page layout vLLM's kernels read. The costs of
the three ways a store block-layer could reach a page (docs/architecture.md, the vLLM backend):

- land and settle (this module): the transport moves one block-layer as one descriptor per
  run, and the settle reads and writes the block-layer once in the page's memory (a local
  permute, no transport, no second buffer). Runs per block-layer: 1 under LBHNC (the CPU
  backend, FlashInfer on Blackwell) and LBNHC (FlashAttention, Triton, FlexAttention) with
  whole or kernel-split blocks and under the block-outer BLHNC / BLNHC; H under LHBNC and
  BHLNC (a head's tokens of one block are contiguous, the heads are not).
- a descriptor per common contiguous segment of both formats: a token's K or V row of one head
  (head_dim elements) is the longest run both share under every layout, so 2 * H * block_size
  descriptors of head_dim * dtype bytes per block-layer (4,096 of 256 bytes for 8 heads of 128
  in bf16 at block 128): far past what a NIC posts efficiently.
- a store block format in vLLM's page order: zero-copy, but the store's blocks would differ by
  the attention backend's layout, and every digest, verification and native reader of them
  would have to read that layout.

Every block of a layer is the translate of its block 0 by the view's block stride (kernel pages
b * r .. b * r + r - 1 of vLLM block b, r = block_size / kernel block size), so the pattern is
computed once per layer from the view's strides, and addressing a block is arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Sequence

import torch

from dualpath_ray.kv.paged_block_layers import DIM, HEAD, KV, PAGE, TOKEN, PagedBlockLayers
from dualpath_ray.runtime.transport.moves import Move, Region
from dualpath_ray.runtime.vllm_engine.pages import PageCodec


@dataclass(frozen=True, eq=False)
class BlockLayerMap:
    """Block-layer addressing of vLLM's backing buffer (see the module doc). Offsets are in
    elements of the KV dtype from the buffer's start; `order` lists block 0's elements of a
    layer in storage order (where landed token-major element k goes), `logical` where its
    token-major element m belongs in the page layout."""

    codec: PageCodec
    dtype: torch.dtype
    layer_base: tuple[int, ...]  # element offset of block 0 of each layer, in model order
    block_stride: int  # elements between vLLM block b and b + 1 of one layer
    order: torch.Tensor  # int64 [block elements]: sorted offsets relative to the layer's block 0
    logical: torch.Tensor  # int64 [block elements]: offset of token-major element m, same origin
    pattern: tuple[tuple[int, int], ...]  # (offset, length) of each contiguous run of `order`
    # `logical` as strides (offset of element 0, strides of [pages, page_tokens, 2, H, D] of a
    # block-layer), and the element stride between layers (None: the layers' bases are not
    # evenly spaced); `unsettle` reads through them as a strided view, one copy and no index.
    # None for the CPU backend's pages (K by dim, V by token: no one stride per token-major
    # axis), which read through the index (a filled block's read, a few tens of microseconds).
    strided: tuple[int, tuple[int, ...]] | None = None
    layer_stride: int | None = None

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], codec: PageCodec) -> BlockLayerMap:
        """The map of vLLM's per-layer views (model order), which must share one backing
        buffer and one pattern; ValueError naming what differs otherwise."""
        if not layers:
            raise ValueError("vLLM registered no KV cache layers")
        storage = layers[0].untyped_storage().data_ptr()
        if any(layer.untyped_storage().data_ptr() != storage for layer in layers):
            raise ValueError("vLLM's KV cache layers do not share one backing buffer (vLLM 0.32 allocate_kv_cache does)")
        if len({(layer.dtype, tuple(layer.shape), layer.stride()) for layer in layers}) != 1:
            raise ValueError("vLLM's KV cache layers differ in dtype, shape or strides; one map addresses every layer")
        view = layers[0]
        logical = _logical_offsets(view, codec)
        order = torch.sort(logical).values
        if bool((order[1:] == order[:-1]).any()):
            raise ValueError(f"a block-layer of the view with strides {view.stride()} addresses an element twice")
        per_block = codec.block_size // codec.page_tokens
        bases = tuple(layer.storage_offset() for layer in layers)
        return cls(
            codec, view.dtype, bases, per_block * view.stride(0), order, logical, _runs_of(order),
            _strides_of(logical, codec), _even_spacing(bases),
        )

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block of one layer: the store's block-layer, token-major."""
        return len(self.order) * self.element_size

    def runs(self, layer: int, block: int) -> list[tuple[int, int]]:
        """(byte offset in the backing buffer, bytes) of each contiguous run of one block-layer,
        in storage order: the destinations of one landed store block-layer, in its byte order."""
        base = (self.layer_base[layer] + block * self.block_stride) * self.element_size
        return [(base + start * self.element_size, length * self.element_size) for start, length in self.pattern]

    def landing_moves(self, pool: str, layer: int, block: int, source: Region) -> list[Move]:
        """(vLLM pool region, source region) pairs that land the store block-layer `source`
        (remote, token-major, block_layer_bytes long) in block `block` of `layer`, for a
        transport read; `settle` then makes it pages."""
        return self.gather_moves(pool, layer, block, [source])

    def gather_moves(self, pool: str, layer: int, block: int, sources: Sequence[Region]) -> list[Move]:
        """`landing_moves` for a token-major block-layer that lies in pieces: `sources`, in its
        byte order, together block_layer_bytes long (a TP rank's heads of a store block-layer,
        tp_ranks.py). One move per overlap of a piece with a run of the block-layer."""
        total = sum(source.nbytes for source in sources)
        if total != self.block_layer_bytes:
            raise ValueError(f"a store block-layer of {total} bytes for vLLM's block-layers of {self.block_layer_bytes}")
        moves: list[Move] = []
        pieces = iter(sources)
        piece, used = next(pieces), 0
        for offset, nbytes in self.runs(layer, block):
            while nbytes:
                if used == piece.nbytes:
                    piece, used = next(pieces), 0
                take = min(nbytes, piece.nbytes - used)
                moves.append((Region(pool, offset, take), Region(piece.pool, piece.offset + used, take)))
                offset, nbytes, used = offset + take, nbytes - take, used + take
        return moves

    def paged(self, pool: str) -> PagedBlockLayers:
        """This map as a reader pulls from it (kv/paged_block_layers.py): the runs of every
        layer of a vLLM block, and the axis order of a block-layer's runs read back to back,
        found among the orders of its outer axes as the one that puts every token-major element
        where `logical` says it lies (ValueError for a layout no axis order describes)."""
        codec, size = self.codec, self.element_size
        sizes = (codec.block_size // codec.page_tokens, codec.n_kv_head, codec.page_tokens, 2, codec.head_dim)
        # Element i of the runs read back to back is the one at offset order[i]: token-major
        # element m is there at the rank of logical[m] in order.
        stored = torch.searchsorted(self.order, self.logical)
        # K_DIM_MAJOR pages: a head's page is its tokens' K and V, so the token axis is the
        # innermost outer axis (kv/paged_block_layers.py).
        outers = (
            [(*pair, TOKEN) for pair in permutations((PAGE, HEAD))] if codec.k_dim_major
            else list(permutations((PAGE, HEAD, TOKEN)))
        )
        for outer in outers:
            paged = PagedBlockLayers(
                pool, tuple(base * size for base in self.layer_base), self.block_stride * size,
                tuple((offset * size, length * size) for offset, length in self.pattern), (*outer, KV, DIM), sizes, size,
                codec.k_dim_major,
            )
            if torch.equal(paged.token_major_index(), stored):
                return paged
        raise ValueError(f"vLLM's block-layers of {self.codec} are in no axis order a reader can make token-major")

    def settle(self, buffer: torch.Tensor, layer: int, blocks: Sequence[int]) -> None:
        """The landed token-major block-layers of `blocks` (landed at `runs`) become vLLM's page
        layout, in place: one gather and one scatter over the blocks' own memory. `buffer` is
        the backing buffer (any dtype; viewed as the KV dtype)."""
        if not blocks:
            return
        typed = _typed(buffer, self.dtype)
        base = self.layer_base[layer] + torch.as_tensor(list(blocks), dtype=torch.int64, device=typed.device) * self.block_stride
        landed = typed[base[:, None] + self.order.to(typed.device)[None, :]]
        typed[base[:, None] + self.logical.to(typed.device)[None, :]] = landed

    def unsettle(self, buffer: torch.Tensor, layer: int, blocks: Sequence[int]) -> torch.Tensor:
        """The token-major bytes of `blocks`' block-layers read from the page layout (a copy,
        [len(blocks), block_layer_bytes] uint8): what a block-layer of the store holds."""
        typed = _typed(buffer, self.dtype)
        if self.strided is not None and blocks:
            start, strides = self.strided
            shape = (max(blocks) + 1, *self._block_shape)
            view = typed.as_strided(shape, (self.block_stride, *strides), self.layer_base[layer] + start)
            return self._gather(view, blocks).view(len(blocks), -1).view(torch.uint8)
        base = self.layer_base[layer] + torch.as_tensor(list(blocks), dtype=torch.int64, device=typed.device) * self.block_stride
        # index_select of the flat index, not a 2-D advanced index: on the CPU the latter ran
        # 10-30x slower on this VM (an oracle prompt's persistence and every digest read this).
        index = (base[:, None] + self.logical.to(typed.device)[None, :]).reshape(-1)
        return typed.index_select(0, index).view(len(base), -1).view(torch.uint8)

    def unsettle_layers(self, buffer: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
        """Every layer of `blocks` read back token-major ([len(blocks), n_layer,
        block_layer_bytes] uint8, a block's Full Block bytes layer by layer): one strided copy
        where the layers are evenly spaced in the buffer (vLLM 0.32's are), a copy per layer
        otherwise."""
        n_layer = len(self.layer_base)
        if self.strided is None or self.layer_stride is None or not blocks:
            layers = [self.unsettle(buffer, layer, blocks) for layer in range(n_layer)]
            return torch.stack(layers, dim=1) if layers else torch.empty(len(blocks), 0, self.block_layer_bytes, dtype=torch.uint8)
        typed = _typed(buffer, self.dtype)
        start, strides = self.strided
        shape = (max(blocks) + 1, n_layer, *self._block_shape)
        view = typed.as_strided(shape, (self.block_stride, self.layer_stride, *strides), self.layer_base[0] + start)
        return self._gather(view, blocks).view(len(blocks), n_layer, -1).view(torch.uint8)

    @property
    def _block_shape(self) -> tuple[int, ...]:
        """A block-layer's token-major axes with its tokens split by page: [pages, page_tokens, 2, H, D]."""
        codec = self.codec
        return (codec.block_size // codec.page_tokens, codec.page_tokens, 2, codec.n_kv_head, codec.head_dim)

    @staticmethod
    def _gather(view: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
        """The blocks' rows of a strided view, copied contiguous in one call."""
        index = torch.as_tensor(list(blocks), dtype=torch.int64, device=view.device)
        return view.index_select(0, index)

def _logical_offsets(view: torch.Tensor, codec: PageCodec) -> torch.Tensor:
    """Element offset (from the view's block 0) of each token-major element of vLLM block 0:
    token t, K or V, head h, dim d of the page where positions() puts token t."""
    h, d = codec.n_kv_head, codec.head_dim
    pages, slots = codec.positions([([0], 0, codec.block_size)], torch.device("cpu"))
    s_page, s_head, s_token, s_content = view.stride()
    if codec.k_dim_major:
        # Each head's page is K [head_dim, tokens] then V [tokens, head_dim], dense (pages.py).
        n = view.shape[2]
        page = (pages * s_page)[:, None, None] + (torch.arange(h, dtype=torch.int64) * s_head)[None, :, None]
        dim = torch.arange(d, dtype=torch.int64)[None, None, :]
        keys = page + dim * n + slots[:, None, None]
        values = page + n * d + slots[:, None, None] * d + dim
        return torch.stack((keys, values), 1).reshape(-1)
    token = pages * s_page + slots * s_token  # [block_size]
    kv = torch.arange(2, dtype=torch.int64) * d * s_content
    head = torch.arange(h, dtype=torch.int64) * s_head
    dim = torch.arange(d, dtype=torch.int64) * s_content
    offsets = token[:, None, None, None] + kv[None, :, None, None] + head[None, None, :, None] + dim[None, None, None, :]
    return offsets.reshape(-1)


def _strides_of(logical: torch.Tensor, codec: PageCodec) -> tuple[int, tuple[int, ...]] | None:
    """`logical` as (offset of element 0, non-negative strides of [pages, page_tokens, 2, H, D]),
    checked element by element; None for a layout no such strides describe (`unsettle` then
    gathers through the index)."""
    shape = (codec.block_size // codec.page_tokens, codec.page_tokens, 2, codec.n_kv_head, codec.head_dim)
    grid = logical.view(shape)
    start = int(grid.reshape(-1)[0])
    strides = []
    for axis, size in enumerate(shape):
        step = [0] * len(shape)
        step[axis] = min(1, size - 1)
        strides.append(int(grid[tuple(step)]) - start)
    if min(strides) < 0:
        return None
    described = torch.full(shape, start, dtype=torch.int64)
    for axis, (size, stride) in enumerate(zip(shape, strides)):
        along = [1] * len(shape)
        along[axis] = size
        described = described + (torch.arange(size, dtype=torch.int64) * stride).view(along)
    return (start, tuple(strides)) if torch.equal(described, grid) else None


def _even_spacing(bases: tuple[int, ...]) -> int | None:
    """The element stride between consecutive layers' bases, None unless one stride fits all
    (a single layer: 0)."""
    if len(bases) < 2:
        return 0
    stride = bases[1] - bases[0]
    if stride < 0 or any(b - a != stride for a, b in zip(bases, bases[1:])):
        return None
    return stride


def _runs_of(order: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """(first offset, length) of each run of consecutive offsets of sorted `order`."""
    breaks = torch.nonzero(order[1:] - order[:-1] != 1).flatten() + 1
    bounds = [0, *breaks.tolist(), len(order)]
    return tuple((int(order[lo]), hi - lo) for lo, hi in zip(bounds, bounds[1:]))


def backing_buffer(layer: torch.Tensor) -> torch.Tensor:
    """vLLM's whole backing buffer under a layer view, as a flat uint8 tensor: the one pool a
    transport registers to address every block-layer (`runs` offsets are into it)."""
    return torch.empty(0, dtype=torch.uint8, device=layer.device).set_(layer.untyped_storage())


def _typed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole backing buffer as a flat tensor of the KV dtype, from its storage's start."""
    return backing_buffer(buffer).view(dtype)
