"""BlockLayerMap on the views vLLM 0.32 registers with a connector, for every K/V attention
backend and every layout it may run under (built by vLLM's own code, as in test_gpu_layouts.py):
a store block-layer moved by a real transport lands in the pages vLLM allocated, in one run per
block-layer where the layout keeps a block-layer dense, and reads back as the K and V the
kernels see for its tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.reader.page_pulls import pull_moves, settle_pulled
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.moves import Region
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap
from dualpath_ray.runtime.vllm_engine.declared import declared_from
from dualpath_ray.runtime.vllm_engine.pages import PageCodec

from tests.unit.runtime.vllm_engine.test_gpu_layouts import (
    B,
    D,
    H,
    KV_BACKENDS,
    LAYERS,
    backend_class,
    literal_kv,
    raw_of,
    splittable_layouts,
    vllm_views,
)

# Layouts under which a block-layer is one dense run of vLLM's buffer; the others split it by head.
DENSE = {KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC}


@pytest.mark.parametrize("kernel_block_size", [B, B // 2])
@pytest.mark.parametrize("name", list(KV_BACKENDS))
def test_store_block_layers_land_in_vllms_pages_through_the_transport(
    vllm_config: VllmConfig, name: str, kernel_block_size: int
) -> None:
    backend = backend_class(name, KV_BACKENDS)
    for layout in splittable_layouts(backend, kernel_block_size):
        check_landing(vllm_config, backend, name, layout, kernel_block_size, torch.bfloat16)


def check_landing(
    vllm_config: VllmConfig, backend: type, name: str, layout: KVCacheLayout, kernel_block_size: int, dtype: torch.dtype
) -> None:
    spec, views = vllm_views(
        vllm_config, backend, FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=dtype), layout, kernel_block_size
    )
    case = f"{name} {layout.name} pages of {kernel_block_size}"
    layers = [views[n] for n in LAYERS]
    codec = PageCodec.detect(layers[0], declared_from(backend, layout, spec), H, D, B)
    blocks = BlockLayerMap.of(layers, codec)
    assert blocks.block_layer_bytes == B * 2 * H * D * 2, f"{case}: a block-layer is block_size tokens of K and V"
    runs = len(blocks.runs(0, 0))
    assert runs == (1 if layout in DENSE else H), f"{case}: {runs} runs per block-layer"

    # The store's block-layers, token-major, in a reader buffer: hit blocks 0..2 of each layer
    # land in vLLM blocks [4, 0, 5] (a request's pages, out of order).
    table = [4, 0, 5]
    kv = torch.randn(len(LAYERS), len(table), B, 2, H, D, dtype=dtype)
    store = kv.reshape(len(LAYERS), len(table), -1).contiguous()
    buffer = raw_of(views)
    before = buffer.clone()
    transport = make_transport("gloo", "prefill/n0/g0", namespace="dualpath")
    transport.register("store", store)
    transport.register("vllm", buffer)
    # A reader's buffer slots the blocks are pulled back into (persistence), one Full Block each.
    pulled = torch.zeros(len(table), len(LAYERS) * store.shape[2] * store.element_size(), dtype=torch.uint8)
    transport.register(Pool.BUFFER, pulled)
    transport.seal()
    row = blocks.block_layer_bytes
    moves = [
        move
        for layer in range(len(LAYERS))
        for i, block in enumerate(table)
        for move in blocks.landing_moves("vllm", layer, block, Region("store", (layer * len(table) + i) * row, row))
    ]
    transport.read("prefill/n0/g0", moves).wait(10.0)
    for layer in range(len(LAYERS)):
        blocks.settle(buffer, layer, table)
    stats = transport.stats()
    assert stats.bytes_read == len(LAYERS) * len(table) * row, (
        f"{case}: the transport moved one block-layer per block per layer, nothing more"
    )
    assert stats.descriptors <= len(LAYERS) * len(table) * runs, (
        f"{case}: at most one descriptor per run of each block-layer ({stats.descriptors})"
    )
    for layer, view in enumerate(layers):
        for i, block in enumerate(table):
            for slot in range(B):
                assert torch.equal(literal_kv(view, block, slot, D, name == "CPU_ATTN"), kv[layer, i, slot]), (
                    f"{case}: layer {layer} token {slot} of block {block} is the landed K and V the kernels read"
                )
        assert torch.equal(blocks.unsettle(buffer, layer, table).view(dtype), store[layer]), (
            f"{case}: layer {layer}'s blocks read back token-major are the store's block-layers"
        )
    # Every layer at once (the decode side's reads of filled and landed blocks): a block's Full
    # Block, layer by layer, read through the strided view and through the index alike.
    whole = store.view(len(LAYERS), len(table), -1).transpose(0, 1).contiguous().view(torch.uint8)
    # The CPU backend's pages (K by dim, V by token) are no single strided view of a
    # token-major block-layer: they read back through the index.
    cpu = name == "CPU_ATTN"
    assert (blocks.strided is None) == cpu, f"{case}: every vLLM 0.32 GPU layout is a strided view of a block-layer"
    assert torch.equal(blocks.unsettle_layers(buffer, table), whole), (
        f"{case}: the blocks' layers read back in one copy are the store's Full Blocks"
    )
    indexed = dataclasses.replace(blocks, strided=None)
    for layer in range(len(LAYERS)):
        assert torch.equal(indexed.unsettle(buffer, layer, table), blocks.unsettle(buffer, layer, table)), (
            f"{case}: layer {layer} reads the same bytes through the strided view as through the index"
        )
    assert torch.equal(indexed.unsettle_layers(buffer, table), whole), (
        f"{case}: without strides, a copy per layer reads the same Full Blocks"
    )
    # The reader's pull of the blocks (persistence): run by run straight from the pages into
    # its slots, then token-major in place: each slot is the block's Full Block of the store.
    paged = blocks.paged("vllm")
    before_pull = transport.stats()
    moves = pull_moves(range(len(table)), table, pulled.shape[1], paged)
    transport.read("prefill/n0/g0", moves).wait(10.0)
    settle_pulled(list(pulled), paged)
    after_pull = transport.stats()
    assert after_pull.bytes_read - before_pull.bytes_read == pulled.numel(), (
        f"{case}: a pull moves each block's block-layers once"
    )
    assert after_pull.descriptors - before_pull.descriptors <= len(LAYERS) * len(table) * runs, (
        f"{case}: a pull posts one descriptor per run of each block-layer"
    )
    for i in range(len(table)):
        assert torch.equal(pulled[i], store[:, i].contiguous().view(torch.uint8).reshape(-1)), (
            f"{case}: block {table[i]} pulled from vLLM's pages is the store's token-major Full Block"
        )
    # Nothing outside the landed block-layers changed (other blocks, padding).
    touched = torch.zeros(buffer.numel(), dtype=torch.bool)
    for layer in range(len(LAYERS)):
        for block in table:
            for offset, nbytes in blocks.runs(layer, block):
                touched[offset : offset + nbytes] = True
    assert torch.equal(buffer[~touched], before[~touched]), f"{case}: a landing writes only its block-layers' bytes"
    transport.close()


def test_layers_on_different_buffers_are_refused() -> None:
    codec = PageCodec(H, D, B)
    layers = [torch.zeros(4, H, B, 2 * D), torch.zeros(4, H, B, 2 * D)]
    with pytest.raises(ValueError, match="do not share one backing buffer"):
        BlockLayerMap.of(layers, codec)


def test_a_store_block_layer_of_another_size_is_refused() -> None:
    buffer = torch.zeros(2, 4, H, B, 2 * D)
    blocks = BlockLayerMap.of([buffer[0], buffer[1]], PageCodec(H, D, B))
    with pytest.raises(ValueError, match="store block-layer of 8 bytes"):
        blocks.landing_moves("vllm", 0, 1, Region("buffer", 0, 8))
