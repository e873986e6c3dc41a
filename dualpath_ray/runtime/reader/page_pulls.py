"""The moves of a page pull (a decode engine's filled blocks into a reader's buffer slots, to
persist them), and what makes the pulled bytes the store's Full Blocks.

A native engine's page is a Full Block in its Pool.HBM: one region per block. A compute that
keeps the KV in pages of its own layout (vLLM's) names how they lie (`PagedBlockLayers`,
kv/paged_block_layers.py): each block is pulled run by run straight from the compute's pool into
its slot, then rewritten token-major in the slot (`settle_pulled`), so the reader writes and the
store checks (the block's digest, runtime/reader/writer.py) exactly what it would for a native
engine's page.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.transport.moves import Move, Region


def pull_moves(slots: Sequence[int], pages: Sequence[int], full_block_bytes: int, paged: PagedBlockLayers | None) -> list[Move]:
    """(buffer region, engine region) pairs that pull page pages[i] into buffer slot slots[i]."""
    moves: list[Move] = []
    for slot, page in zip(slots, pages):
        base = slot * full_block_bytes
        if paged is None:
            moves.append((Region(Pool.BUFFER, base, full_block_bytes), Region(Pool.HBM, page * full_block_bytes, full_block_bytes)))
            continue
        if paged.n_layer * paged.block_layer_bytes != full_block_bytes:
            raise ValueError(
                f"pages of {paged.n_layer} block-layers of {paged.block_layer_bytes} bytes for Full Blocks of {full_block_bytes}"
            )
        done = 0
        for offset, nbytes in paged.runs(page):
            moves.append((Region(Pool.BUFFER, base + done, nbytes), Region(paged.pool, offset, nbytes)))
            done += nbytes
    return moves


def settle_pulled(blocks: Sequence[torch.Tensor], paged: PagedBlockLayers | None) -> None:
    """Make pulled slots Full Blocks, in place (nothing to do for Full Block pages)."""
    if paged is not None:
        for block in blocks:
            paged.to_token_major(block)
