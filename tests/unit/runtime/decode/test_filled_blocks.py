"""Where a decode engine's reader pulls filled blocks from when the compute keeps the KV
(runtime/decode/filled_blocks.py, HeldPulls): straight from the compute's pages, in their own
layout (here vLLM's CPU layout, [layer, block, head, token, K+V], through the same BlockLayerMap
a vLLM engine builds), into the reader's buffer slot, where the pull's moves and its settling
(runtime/reader/page_pulls.py) make it the store's token-major Full Block; the engine keeps no
copy of it."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.decode.filled_blocks import HeldPulls
from dualpath_ray.runtime.decode.job import DecodeJob
from dualpath_ray.runtime.reader.page_pulls import pull_moves, settle_pulled
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
from dualpath_ray.runtime.vllm_engine.pages import PageCodec

LAYOUT = KVLayout(n_layer=2, n_kv_head=2, head_dim=4, block_size=4, dtype="float32")
N_PAGES = 6


class PagesOfLayers:
    """A HeldKV over pages laid out as vLLM's CPU backend lays them out; a sequence's state is
    its page table."""

    def __init__(self) -> None:
        h, d, b = LAYOUT.n_kv_head, LAYOUT.head_dim, LAYOUT.block_size
        self.cache = torch.randn(LAYOUT.n_layer, N_PAGES, h, b, 2 * d)
        layers = [self.cache[layer] for layer in range(LAYOUT.n_layer)]
        self.map = BlockLayerMap.of(layers, PageCodec(h, d, b))
        self.kv_buffer = backing_buffer(layers[0])

    def block_pages(self, state: Any, blocks: Sequence[int]) -> list[int]:
        return [state[b] for b in blocks]

    def read_blocks(self, state: Any, blocks: Sequence[int]) -> torch.Tensor:
        pages = self.block_pages(state, blocks)
        layers = [self.map.unsettle(self.kv_buffer, layer, pages) for layer in range(LAYOUT.n_layer)]
        return torch.stack(layers, dim=1).reshape(len(pages), *LAYOUT.full_block_shape)

    def paged_blocks(self, pool: str) -> PagedBlockLayers:
        return self.map.paged(pool)


def test_a_filled_block_is_pulled_from_the_computes_page_as_the_stores_full_block() -> None:
    held = PagesOfLayers()
    pulls = HeldPulls(held, Pool.COMPUTE_KV)  # type: ignore[arg-type]
    job = DecodeJob("r", 0, 3 * LAYOUT.block_size, 0)
    job.compute_state = [4, 1, 5]  # the sequence's pages, out of order
    assert pulls.paged is not None and pulls.paged.pool == Pool.COMPUTE_KV, "pulls address the compute's pool"
    assert [pulls.capture(job, block) for block in range(3)] == [4, 1, 5], "a block is pulled from its own page"

    # The reader's side: the pull's moves from the registered pool into buffer slots 2 and 0.
    slots, full = [2, 0], LAYOUT.full_block_bytes
    buffer = torch.zeros(3, full, dtype=torch.uint8)
    moves = pull_moves(slots, [pulls.capture(job, 0), pulls.capture(job, 2)], full, pulls.paged)
    assert len(moves) == 2 * LAYOUT.n_layer, "one run per block-layer under vLLM's CPU layout"
    for local, remote in moves:
        assert local.pool == Pool.BUFFER and remote.pool == Pool.COMPUTE_KV, "compute pages into the reader's buffer"
        buffer.view(-1)[local.offset : local.end].copy_(held.kv_buffer[remote.offset : remote.end])
    settle_pulled([buffer[slot] for slot in slots], pulls.paged)
    for slot, block in zip(slots, [0, 2]):
        want = pulls.read(job, [block])[0].reshape(-1)
        assert torch.equal(buffer[slot], want), f"slot {slot} holds block {block} token-major, as the engine reads it"
    token = held.cache[1, 5, :, 3].reshape(LAYOUT.n_kv_head, 2, LAYOUT.head_dim).permute(1, 0, 2)
    last = buffer[0].view(LAYOUT.n_layer, LAYOUT.block_size, -1)[1, 3].view(torch.float32).view(2, LAYOUT.n_kv_head, -1)
    assert torch.equal(last, token), "layer 1's last token of block 2 is its K and V of every head, token-major"
