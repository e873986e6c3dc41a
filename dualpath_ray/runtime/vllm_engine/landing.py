"""A vLLM step whose past KV lands once, straight in the pages vLLM allocated: `LandingStep`.

The StepKV (step_kv.py) of issue 32's "KV lands in vLLM's pages, once": the transport moves each
store block-layer of a request's past KV from where it lies (a reader's buffer extent, a decode
engine's pages: Full Blocks [n_layer, block_size, bytes] in the store's token-major format) into
its block of vLLM's own backing buffer, registered with the same transport (block_layers.py,
BlockLayerMap), with no window or page pool of ours in between:

- `begin` (the step's first connector hook, after vLLM zeroed the blocks it just allocated):
  every layer's reads are posted at once, one transfer per layer and source, for the blocks
  vLLM allocated for the loaded tokens. Loads are whole blocks: vLLM's own prefix-cache hits
  are whole blocks, so every loaded block is one vLLM just allocated and shares with no other
  request, and the loaded tokens must end on a block boundary too, because vLLM writes the KV
  of the tokens a step computes into the pages (`unified_kv_cache_update`) before the layer's
  `wait_for_layer_load`: a landing into a block the step also computes into would overwrite
  that KV. A request whose past ends inside a block loads its full blocks and vLLM computes the
  rest (fewer than block_size tokens), or the partial block lands before any step computes it
  (an asynchronous load);
- `before_layer(l)` (`wait_for_layer_load`): waits for layer l's transfers only and settles
  layer l's landed block-layers into the page layout, so loading overlaps compute layer by layer;
- nothing is saved (`after_layer`, `end`): the KV vLLM computes stays in its pages.

A failed transfer raises in `before_layer`: the step fails, and its caller fails the requests.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import Move, Region, Transfer, end_all
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.step_kv import KVSource, ScheduledKV


class LandingStep:
    """See the module doc. `sources[key]`: the past KV of each request that loads; `pool` is
    the name vLLM's backing buffer `buffer` is registered under with `transport`."""

    def __init__(
        self, transport: Transport, pool: str, buffer: torch.Tensor, block_map: BlockLayerMap,
        sources: dict[str, KVSource], timeout_s: float,
    ) -> None:
        self.transport = transport
        self.pool = pool
        self.buffer = buffer
        self.map = block_map
        self.sources = sources
        self.timeout_s = timeout_s
        self._posted: dict[int, list[Transfer]] = {}
        self._blocks: dict[int, list[int]] = {}  # layer -> vLLM blocks landed in it, to settle
        self.block_layers_posted = 0

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        size = codec.block_size
        landings: list[tuple[KVSource, int, int]] = []  # (source, request block, vLLM block)
        for request in requests:
            if not request.loading:
                continue
            source = self.sources.get(request.key)
            if source is None:
                raise RuntimeError(f"vLLM loads {request.loading} tokens of {request.key}, which has no KV source")
            if request.load_from % size or request.computed % size:
                raise RuntimeError(
                    f"{request.key} loads tokens [{request.load_from}, {request.computed}), not whole blocks of {size}: "
                    "a landing would overwrite the KV vLLM computes into the last one (see the module doc); load "
                    "the full blocks and let vLLM compute the rest"
                )
            first, end = request.load_from // size, request.computed // size
            landings += [(source, b, request.block_ids[b]) for b in range(first, end)]
        blocks = [vllm_block for _, _, vllm_block in landings]
        for layer in range(len(layers)):
            by_peer: dict[str, list[Move]] = {}
            for source, block, vllm_block in landings:
                region = Region(*source.block_layer(block, layer, self.map.block_layer_bytes))
                by_peer.setdefault(source.peer, []).extend(self.map.landing_moves(self.pool, layer, vllm_block, region))
            self._posted[layer] = [self.transport.read(peer, moves) for peer, moves in by_peer.items()]
            self._blocks[layer] = blocks
        self.block_layers_posted += len(landings) * len(layers)

    def before_layer(self, layer: int) -> None:
        try:
            for transfer in self._posted.pop(layer, []):
                transfer.wait(self.timeout_s)
        except Exception:
            self._drain()
            raise
        self.map.settle(self.buffer, layer, self._blocks.pop(layer, []))

    def _drain(self) -> None:
        """After a failed transfer: every other layer's transfers end (either way) before the
        step fails, so none lands in pages vLLM frees and hands to another request."""
        end_all((transfer for transfers in self._posted.values() for transfer in transfers), self.timeout_s)
        self._posted.clear()

    def after_layer(self, layer: int) -> None:
        return None

    def end(self) -> None:
        return None


def full_block_offsets(table: Sequence[int], full_block_bytes: int) -> tuple[int, ...]:
    """Byte offsets of pages or buffer slots `table` in a pool of Full Blocks."""
    return tuple(page * full_block_bytes for page in table)
