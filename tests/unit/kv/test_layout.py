"""Full Block / Layer Block layout: zero-copy views, exact byte round trips, block segments."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.layout import KVLayout, block_segments, split_by_blocks


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_model(ModelConfig(n_layer=3, n_kv_head=2, head_dim=8), block_size=4)


def test_bytes_per_token_follow_the_model_spec(layout):
    assert layout.bytes_per_token_per_layer == 2 * 2 * 8 * 4, "2 (K,V) x kv heads x head_dim x float32"
    assert layout.full_block_shape == (3, 4, 128), "[n_layer, block_size, bytes per token per layer]"
    assert layout.full_block_bytes == 3 * layout.layer_block_bytes, "a Full Block is n_layer Layer Blocks"


def test_layer_blocks_are_zero_copy_slices_that_concatenate_to_the_full_block(layout):
    full = torch.randint(0, 256, layout.full_block_shape, dtype=torch.uint8)
    blocks = [layout.layer_block(full, layer) for layer in range(layout.n_layer)]
    assert all(b.shape == (1, 4, 128) for b in blocks), "a Layer Block is [1, block_size, bytes]"
    assert all(b.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for b in blocks), (
        "Layer Blocks share the Full Block's storage (zero copy)"
    )
    assert torch.equal(torch.cat(blocks, dim=0), full), "n_layer Layer Blocks concatenated are the Full Block"
    blocks[1][0, 0, 0] = 7
    assert full[1, 0, 0] == 7, "writing a Layer Block writes the Full Block"


def test_kv_bytes_round_trip_exactly(layout):
    kv = torch.randn(5, 2, 2, 8)
    data = layout.kv_as_bytes(kv)
    assert data.shape == (5, 128) and data.dtype == torch.uint8, "one row of bytes per token"
    assert torch.equal(layout.bytes_as_kv(data), kv), "bytes -> KV is the exact inverse"
    with pytest.raises(ValueError):
        layout.kv_as_bytes(torch.randn(5, 2, 3, 8))


def test_block_segments_cut_token_ranges_at_block_boundaries():
    assert block_segments(0, 4, 4) == [(0, 0, 4)], "one whole block"
    assert block_segments(2, 9, 4) == [(0, 2, 4), (1, 0, 4), (2, 0, 1)], "partial, whole, partial"
    assert block_segments(5, 5, 4) == [], "an empty range touches no block"
    with pytest.raises(ValueError):
        block_segments(3, 2, 4)
    data = torch.arange(7).reshape(7, 1)
    pieces = split_by_blocks(data, 2, 4)
    assert [p.shape[0] for p in pieces] == [2, 4, 1], "pieces match the segments of [2, 9)"
    assert torch.equal(torch.cat(pieces), data), "the pieces are the data, in order"
