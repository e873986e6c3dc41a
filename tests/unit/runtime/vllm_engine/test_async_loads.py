"""AsyncLoads without vLLM: a request's past KV (Full Blocks, the store's format, in a registered
pool) lands through a real transport straight in the blocks of a paged buffer laid out as vLLM's
CPU backend lays it out (LBHNC: one backing buffer, per-layer [blocks, heads, tokens, K|V]
views), is reported finished only once landed and settled, and a load that cannot be read is
reported finished with its blocks as load errors."""

from __future__ import annotations

import torch

from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.vllm_engine.async_loads import AsyncLoad, AsyncLoads
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.step_kv import KVSource

L, N, H, B, D = 3, 8, 2, 16, 8  # layers, vLLM blocks, KV heads, block size, head dim
ME = "decode/n0/g0"


def setup() -> tuple[AsyncLoads, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """vLLM-like pages, a source pool of 3 Full Blocks of random KV, and a bound AsyncLoads."""
    raw = torch.zeros(L * N * H * B * 2 * D, dtype=torch.float32)
    views = [raw.view(L, N, H, B, 2 * D)[layer] for layer in range(L)]
    codec = PageCodec(H, D, B)
    blocks = BlockLayerMap.of(views, codec)
    kv = torch.randn(3, L, B, 2, H, D)  # request block, layer, token: the store's Full Blocks
    source = kv.clone()
    transport = make_transport("gloo", ME, namespace="dualpath")
    transport.register("hbm", source)
    transport.register("vllm", backing_buffer(views[0]))
    transport.seal()
    loads = AsyncLoads(blocks, backing_buffer(views[0]), L)
    loads.bind(transport, "vllm")
    return loads, views, kv, source


def test_a_load_lands_in_its_pages_and_is_reported_once_settled() -> None:
    loads, views, kv, source = setup()
    full_block = L * B * 2 * H * D * 4
    table = (6, 1, 3)  # the request's vLLM blocks
    tokens = 2 * B + 5  # the last block partly
    loads.start([AsyncLoad("r1", "d1", KVSource(ME, "hbm", tuple(i * full_block for i in range(3))), table, 0, tokens)])
    assert loads.finished() == {"r1"}, "a landed load (a self-move lands at once) is reported finished"
    assert loads.finished() == set() and loads.in_flight() == 0, "a load is reported finished exactly once"
    assert loads.load_errors() == set(), "a load that landed reports no failed blocks"
    assert loads.block_layers_posted == 3 * L, "one block-layer per block per layer, the partial block whole"
    codec = loads.block_map.codec
    for layer in range(L):
        got = codec.read(views[layer], table, 0, tokens)
        want = kv[:, layer].reshape(3 * B, 2, H, D)[:tokens]
        assert torch.equal(got, want), f"layer {layer}: the pages hold the source's K and V of every loaded token"
    untouched = [b for b in range(N) if b not in table]
    assert all(not views[layer][untouched].any() for layer in range(L)), "no other block of vLLM's pages was written"


def test_an_unreadable_load_reports_its_blocks_as_load_errors() -> None:
    loads, views, _, source = setup()
    beyond = source.numel() * 4  # past the end of the source pool
    loads.start([AsyncLoad("r2", "d2", KVSource(ME, "hbm", (beyond, beyond)), (2, 5), 0, 2 * B)])
    assert loads.finished() == {"r2"}, "a failed load is still reported finished (vLLM's contract)"
    assert loads.load_errors() == {2, 5}, "its blocks are reported as load errors, then forgotten"
    assert loads.load_errors() == set(), "load errors are reported once"
    assert loads.failed == 1, "the failure is counted"


def test_a_load_from_another_engines_pages_copies_them_as_they_are() -> None:
    """A source in vLLM's own layout (a prefill engine's held pages, same geometry): runs to
    runs, nothing settled; here the other engine's pages are blocks of the same buffer."""
    loads, views, _, _ = setup()
    codec = loads.block_map.codec
    theirs, ours = (0, 7), (4, 2)
    for layer in range(L):
        codec.write(views[layer], theirs, 0, 2 * B, torch.randn(2 * B, 2, H, D))
    loads.start([AsyncLoad("r3", "d3", KVSource(ME, "vllm", theirs, pages=True), ours, 0, 2 * B - 3)])
    assert loads.finished() == {"r3"}, "the load from pages is reported finished"
    for layer in range(L):
        assert torch.equal(codec.read(views[layer], ours, 0, 2 * B), codec.read(views[layer], theirs, 0, 2 * B)), (
            f"layer {layer}: our blocks hold exactly the other engine's K and V, token for token"
        )


def test_released_holds_are_reported_once() -> None:
    loads, _, _, _ = setup()
    loads.release("p1")
    assert loads.released() == {"p1"}, "a released hold is reported as sent"
    assert loads.released() == set(), "and only once"
