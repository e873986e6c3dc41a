"""The TP rank logic (tp_ranks.py) on a fake of tensor-parallel ranks: each rank's pages are the
views vLLM 0.32's worker allocates for its own KV heads (vLLM's allocation helpers, as in
test_gpu_layouts.py, with the spec's num_kv_heads = vLLM's per-rank count), for every K/V
attention backend and layout. Ranks landing store block-layers together through a real transport
put every head's K and V where that rank's kernels read it, reading each store byte once (per
replica where heads are replicated); the ranks' saves reassemble the store's block-layers,
writing each store byte exactly once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.moves import Region
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap
from dualpath_ray.runtime.vllm_engine.declared import declared_from
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.tp_ranks import RankHeads, TensorParallelHeads, rank_heads

from tests.unit.runtime.vllm_engine.test_gpu_layouts import (
    B,
    D,
    KV_BACKENDS,
    LAYERS,
    backend_class,
    literal_kv,
    raw_of,
    vllm_views,
)

ENDPOINT = "decode/n0/g0"
TABLE = [4, 0, 5]  # the vLLM blocks a request's three hit blocks land in (every rank allocates the same ids)


class FakeRank:
    """One TP rank's KV pages as vLLM allocates them for its heads, and its rank logic."""

    def __init__(self, config: VllmConfig, backend: type, layout: KVCacheLayout, heads: RankHeads, dtype: torch.dtype) -> None:
        h = len(heads.heads)
        spec, self.views = vllm_views(config, backend, FullAttentionSpec(block_size=B, num_kv_heads=h, head_size=D, dtype=dtype), layout, B)
        self.layers = [self.views[name] for name in LAYERS]
        codec = PageCodec.detect(self.layers[0], declared_from(backend, layout, spec), h, D, B)
        self.map = BlockLayerMap.of(self.layers, codec)
        self.buffer = raw_of(self.views)
        self.heads = heads
        self.pool = f"rank{heads.rank}"


def fake_ranks(config: VllmConfig, backend: type, layout: KVCacheLayout, split: TensorParallelHeads, dtype: torch.dtype) -> list[FakeRank]:
    return [FakeRank(config, backend, layout, heads, dtype) for heads in rank_heads(split, B, D, dtype)]


def store_block_layers(n_kv_head: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random KV [layers, blocks, B, 2, H, D] and the same as store block-layers, uint8 [layers * blocks, bytes]."""
    kv = torch.randn(len(LAYERS), len(TABLE), B, 2, n_kv_head, D, dtype=dtype)
    return kv, kv.reshape(len(LAYERS) * len(TABLE), -1).view(torch.uint8).clone()


def kv_layouts(name: str) -> tuple[type, list[KVCacheLayout]]:
    backend = backend_class(name, KV_BACKENDS)
    return backend, list(get_supported_kv_cache_layouts([backend]))


# tp = 1 lands as the map alone does (test_one_rank_lands_a_block_layer_as_the_map_alone_does).
@pytest.mark.parametrize(("n_kv_head", "tp"), [(2, 2), (4, 2), (1, 2)])
@pytest.mark.parametrize("name", list(KV_BACKENDS))
def test_ranks_land_store_block_layers_in_their_own_heads_pages(vllm_config: VllmConfig, name: str, n_kv_head: int, tp: int) -> None:
    backend, layouts = kv_layouts(name)
    split = TensorParallelHeads(n_kv_head, tp)
    for layout in layouts:
        case = f"{name} {layout.name}, {n_kv_head} KV heads over {tp} ranks"
        ranks = fake_ranks(vllm_config, backend, layout, split, torch.bfloat16)
        kv, store = store_block_layers(n_kv_head, torch.bfloat16)
        row = store.shape[1]
        before = [rank.buffer.clone() for rank in ranks]
        transport = make_transport("gloo", ENDPOINT, namespace="dualpath")
        transport.register("store", store)
        for rank in ranks:
            transport.register(rank.pool, rank.buffer)
        transport.seal()
        read_counts = torch.zeros(store.numel(), dtype=torch.int64)
        for rank in ranks:
            moves = [
                move
                for layer in range(len(LAYERS))
                for i, block in enumerate(TABLE)
                for move in rank.heads.landing_moves(rank.map, rank.pool, layer, block, Region("store", (layer * len(TABLE) + i) * row, row))
            ]
            for _, source in moves:
                read_counts[source.offset : source.end] += 1
            transport.read(ENDPOINT, moves).wait(10.0)
            for layer in range(len(LAYERS)):
                rank.map.settle(rank.buffer, layer, TABLE)
        assert bool((read_counts == split.replicas).all()), (
            f"{case}: the ranks together read every store byte once per replica of its head, no byte more or less"
        )
        assert transport.stats().bytes_read == store.numel() * split.replicas, (
            f"{case}: the transport moved each rank's heads only ({transport.stats().bytes_read} bytes)"
        )
        for rank, old in zip(ranks, before):
            heads = rank.heads.heads
            for layer, view in enumerate(rank.layers):
                for i, block in enumerate(TABLE):
                    for slot in range(B):
                        assert torch.equal(literal_kv(view, block, slot, D, name == "CPU_ATTN"), kv[layer, i, slot][:, heads.start : heads.stop]), (
                            f"{case}: rank {rank.heads.rank}'s kernels read heads {list(heads)} of token {slot} of block "
                            f"{block}, layer {layer}, as the store holds them"
                        )
            touched = torch.zeros(rank.buffer.numel(), dtype=torch.bool)
            for layer in range(len(LAYERS)):
                for block in TABLE:
                    for offset, nbytes in rank.map.runs(layer, block):
                        touched[offset : offset + nbytes] = True
            assert torch.equal(rank.buffer[~touched], old[~touched]), (
                f"{case}: rank {rank.heads.rank}'s landing writes only its block-layers' bytes"
            )
        transport.close()


@pytest.mark.parametrize(("n_kv_head", "tp"), [(2, 2), (4, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("name", ["CPU_ATTN", "FLASH_ATTN"])
def test_ranks_saves_reassemble_the_store_block_layers(vllm_config: VllmConfig, name: str, n_kv_head: int, tp: int) -> None:
    """Each rank's pages hold random K and V of its heads (replicas of a head the same); the
    store block-layers the kernels' views imply are rebuilt from the ranks' unsettled
    block-layers in memory (`place`) and through a transport write (`save_moves`)."""
    backend, layouts = kv_layouts(name)
    split = TensorParallelHeads(n_kv_head, tp)
    for layout in layouts:
        case = f"{name} {layout.name}, {n_kv_head} KV heads over {tp} ranks"
        ranks = fake_ranks(vllm_config, backend, layout, split, torch.float32)
        for rank in ranks[1:]:
            first = ranks[rank.heads.rank - rank.heads.rank % split.replicas]
            rank.buffer.copy_(first.buffer)  # a replica computes the same K and V as its head's first rank
        want = torch.empty(len(LAYERS), len(TABLE), B, 2, n_kv_head, D)
        for rank in ranks:
            heads = rank.heads.heads
            for layer, view in enumerate(rank.layers):
                for i, block in enumerate(TABLE):
                    for slot in range(B):
                        want[layer, i, slot][:, heads.start : heads.stop] = literal_kv(view, block, slot, D, name == "CPU_ATTN")
        want_bytes = want.reshape(len(LAYERS) * len(TABLE), -1).view(torch.uint8)
        local = {
            rank.heads.rank: torch.cat([rank.map.unsettle(rank.buffer, layer, TABLE) for layer in range(len(LAYERS))])
            for rank in ranks
        }

        placed = torch.zeros_like(want_bytes)
        for rank in ranks:
            rank.heads.place(local[rank.heads.rank], placed)
        assert torch.equal(placed, want_bytes), f"{case}: the ranks' block-layers placed in memory are the store's"

        out = torch.full_like(want_bytes, 0xAB)
        transport = make_transport("gloo", ENDPOINT, namespace="dualpath")
        transport.register("store", out)
        for rank in ranks:
            transport.register(rank.pool, local[rank.heads.rank])
        transport.seal()
        written = torch.zeros(out.numel(), dtype=torch.int64)
        for rank in ranks:
            size, row = rank.heads.local_bytes, out.shape[1]
            moves = [
                move
                for n in range(len(LAYERS) * len(TABLE))
                for move in rank.heads.save_moves(Region(rank.pool, n * size, size), Region("store", n * row, row))
            ]
            for _, target in moves:
                written[target.offset : target.end] += 1
            if moves:
                transport.write(ENDPOINT, moves).wait(10.0)
        assert bool((written == 1).all()), f"{case}: the saving ranks write every store byte exactly once"
        assert torch.equal(out, want_bytes), f"{case}: the ranks' saves through the transport reassemble the store's block-layers"
        assert transport.stats().bytes_written == out.numel(), f"{case}: no replica writes a head another rank saved"
        transport.close()


def test_heads_follow_vllms_shard_rule() -> None:
    """vLLM's QKVParallelLinear: H // tp heads per rank in rank order, or, past H ranks, head
    tp_rank // (tp / H) on every rank (its weight loader's shard_rank)."""
    assert [TensorParallelHeads(8, 4).heads(r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)], (
        "8 heads over 4 ranks: two consecutive heads each"
    )
    split = TensorParallelHeads(2, 4)
    assert [split.heads(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)], (
        "2 heads over 4 ranks: each head on two consecutive ranks"
    )
    assert [split.saves(r) for r in range(4)] == [True, False, True, False], "only a head's first replica saves it"
    assert TensorParallelHeads(4, 1).heads(0) == range(0, 4), "one rank holds every head"


def test_one_rank_lands_a_block_layer_as_the_map_alone_does() -> None:
    """tp = 1: the rank's runs merge into one, and its moves are BlockLayerMap.landing_moves'."""
    buffer = torch.zeros(2, 4, 2, B, 2 * D)
    block_map = BlockLayerMap.of([buffer[0], buffer[1]], PageCodec(2, D, B))
    (heads,) = rank_heads(TensorParallelHeads(2, 1), B, D, torch.float32)
    assert len(heads.runs) == 1, "one rank's heads are the whole block-layer: one run"
    source = Region("store", 64, block_map.block_layer_bytes)
    assert heads.landing_moves(block_map, "vllm", 1, 3, source) == block_map.landing_moves("vllm", 1, 3, source), (
        "one rank moves what the map moves without TP"
    )


@pytest.mark.parametrize(("n_kv_head", "tp"), [(3, 2), (2, 3), (4, 3), (6, 4)])
def test_a_head_count_vllm_cannot_shard_is_refused_by_name(n_kv_head: int, tp: int) -> None:
    with pytest.raises(ValueError, match=r"model\.n_kv_head .* engine\.vllm_tensor_parallel_size"):
        TensorParallelHeads(n_kv_head, tp)


def test_a_rank_outside_the_group_and_a_foreign_map_are_refused() -> None:
    split = TensorParallelHeads(4, 2)
    with pytest.raises(ValueError, match="TP rank 2 outside"):
        split.heads(2)
    whole = torch.zeros(2, 4, 4, B, 2 * D)
    block_map = BlockLayerMap.of([whole[0], whole[1]], PageCodec(4, D, B))  # every head's pages: not a rank's
    rank = split.rank(0, B, D, 4)
    with pytest.raises(ValueError, match="the map is not this rank's"):
        rank.landing_moves(block_map, "vllm", 0, 0, Region("store", 0, rank.store_bytes))


def test_a_ranks_share_is_one_run_per_token_k_and_v_row() -> None:
    """The module doc's cost: 2 heads of 64 in bf16 at block 64 over 2 ranks."""
    rank = TensorParallelHeads(2, 2).rank(1, 64, 64, 2)
    assert [(run.nbytes, run.store) for run in rank.runs[:2]] == [(128, 128), (128, 384)], (
        "rank 1's runs are head 1's K row then its V row of token 0, 128 bytes each"
    )
    assert len(rank.runs) == 2 * 64 and rank.local_bytes == rank.store_bytes // 2, (
        "a rank moves half a block-layer in 2 * block_size runs"
    )
