"""PagedBlockLayers (kv/paged_block_layers.py): how a reader pulls a block from page memory that
does not keep Full Blocks. Its runs address every layer of one page in slot order, its rewrite
makes a pulled block token-major in place, and a description that cannot be right is refused
naming the field. (Every vLLM layout's description is checked against vLLM's own views in
tests/unit/runtime/vllm_engine/test_block_layers.py.)"""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.kv.paged_block_layers import DIM, HEAD, KV, PAGE, TOKEN, PagedBlockLayers

H, T, D = 2, 4, 3  # heads, tokens of a page, head dim; one kernel page per block
SIZES = (1, H, T, 2, D)
ELEMENTS = H * T * 2 * D


def head_major(pattern: tuple[tuple[int, int], ...] = ((0, ELEMENTS * 4),)) -> PagedBlockLayers:
    """Pages as [layer, block, head, token, K+V] float32: two layers, 10 blocks each."""
    return PagedBlockLayers("kv", (0, 10 * ELEMENTS * 4), ELEMENTS * 4, pattern, (PAGE, HEAD, TOKEN, KV, DIM), SIZES, 4)


def test_runs_address_every_layer_of_a_page_in_slot_order() -> None:
    paged = head_major()
    assert paged.runs(3) == [(3 * ELEMENTS * 4, ELEMENTS * 4), (13 * ELEMENTS * 4, ELEMENTS * 4)], (
        "page 3 of layer 0, then page 3 of layer 1: one run each, a block-layer apart in the slot"
    )


def test_a_pulled_block_becomes_token_major_in_place() -> None:
    paged = head_major()
    stored = torch.randn(2, H, T, 2, D)  # what the pull put in the slot: each layer head-major
    block = stored.clone().view(torch.uint8).reshape(2, -1)
    paged.to_token_major(block)
    want = stored.permute(0, 2, 3, 1, 4).contiguous()  # [layer, token, K/V, head, dim]
    assert torch.equal(block.view(torch.float32).reshape(want.shape), want), "each layer's tokens, K then V of every head"


def test_descriptions_that_cannot_be_right_are_refused() -> None:
    with pytest.raises(ValueError, match="runs of 8 bytes for block-layers of 192"):
        head_major(((0, 8),))
    with pytest.raises(ValueError, match="stored_axes"):
        PagedBlockLayers("kv", (0,), 0, ((0, ELEMENTS * 4),), (KV, PAGE, HEAD, TOKEN, DIM), SIZES, 4)
    with pytest.raises(ValueError, match="element_size 3"):
        PagedBlockLayers("kv", (0,), 0, ((0, ELEMENTS * 3),), (PAGE, HEAD, TOKEN, KV, DIM), SIZES, 3)
    with pytest.raises(ValueError, match="a pulled block of 8 bytes"):
        head_major().to_token_major(torch.zeros(8, dtype=torch.uint8))
