"""What one vLLM step moves through the connector (runtime/vllm_engine/connector.py): `StepKV`s.

- `PrefillStep`: a prefill batch run by the engine's LayerPipeline (runtime/prefill/pipeline.py)
  while vLLM runs the same batch's forward on another thread. The two meet once per layer, in
  order: the pipeline offers layer l's window slot once the layer's past KV has landed in it
  (`offer`), vLLM's forward copies that past KV into its pages before the layer's attention
  (`before_layer`) and, after it, the KV the layer computed back into the slot (`after_layer`);
  only then does `offer` return and the pipeline send the slot on. So each layer's transfers
  overlap the other layers' compute exactly as with the native model.
- `PagesStep`: a decode step (or a recompute into pages): the past KV comes from the engine's
  own pages (runtime/decode: where the transport put the prompt's KV) and every token vLLM
  computes goes back to them, so the decode core's persistence and verification read them as
  they read the native model's.

Both speak token-major KV ([tokens, 2, n_kv_head, head_dim], kv/layout.py) on their side and
vLLM's pages on the other, through the PageCodec.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.engine.compute import ChunkSpec, page_token_views
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV
from dualpath_ray.runtime.vllm_engine.pages import PageCodec


class StepAbandoned(RuntimeError):
    """The batch was given up (its transfers failed): vLLM's forward finishes on stale pages and
    its outputs are dropped."""


class PrefillStep:
    """One prefill batch: chunk `keys[i]` computes `chunks[i]` (see the module doc)."""

    def __init__(self, layout: KVLayout, keys: Sequence[str], chunks: Sequence[ChunkSpec], timeout_s: float) -> None:
        self.layout = layout
        self.chunks = dict(zip(keys, chunks))
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._slots: dict[int, torch.Tensor] = {}
        self._done: set[int] = set()
        self._requests: dict[str, ScheduledKV] = {}
        self._layers: list[torch.Tensor] = []
        self._codec: PageCodec | None = None
        self._abandoned = False
        self.error: BaseException | None = None

    # --- the pipeline's side (the engine's worker thread) -----------------------------------

    def offer(self, layer: int, slot: torch.Tensor) -> None:
        """Layer `layer`'s past KV is in `slot`: returns once vLLM computed the layer and its KV
        is in the slot; raises what stopped vLLM's step."""
        with self._cond:
            self._slots[layer] = slot
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: layer in self._done or self.error is not None, self.timeout_s):
                raise TimeoutError(f"vLLM did not compute layer {layer} of the prefill batch in {self.timeout_s}s")
            if self.error is not None:
                raise RuntimeError(f"vLLM's prefill step failed: {self.error!r}") from self.error

    def abandon(self) -> None:
        """The pipeline failed: vLLM's forward stops waiting for slots and moves nothing more."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    # --- vLLM's side (the step thread) -------------------------------------------------------

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        by_key = {r.key: r for r in requests}
        if set(by_key) != set(self.chunks):
            raise RuntimeError(
                f"vLLM scheduled {len(by_key)} of the prefill batch's {len(self.chunks)} chunks in one step; "
                "raise engine.vllm_max_num_seqs or the vLLM KV pages (cluster.prefill_hbm_tokens)"
            )
        for key, chunk in self.chunks.items():
            got = by_key[key]
            if (got.computed, got.computed + got.scheduled) != (chunk.start, chunk.end):
                raise RuntimeError(
                    f"vLLM scheduled tokens [{got.computed}, {got.computed + got.scheduled}) of a chunk of "
                    f"[{chunk.start}, {chunk.end})"
                )
        self._requests, self._layers, self._codec = by_key, layers, codec

    def before_layer(self, layer: int) -> None:
        slot = self._wait_slot(layer)
        if slot is None:
            return
        assert self._codec is not None
        for key, chunk in self.chunks.items():
            if chunk.start:
                past = self.layout.bytes_as_kv(slot[chunk.offset : chunk.offset + chunk.start])
                self._codec.write(self._layers[layer], self._requests[key].block_ids, 0, chunk.start, past)

    def after_layer(self, layer: int) -> None:
        with self._cond:
            slot = None if self._abandoned else self._slots.get(layer)
        if slot is not None:
            assert self._codec is not None
            for key, chunk in self.chunks.items():
                kv = self._codec.read(self._layers[layer], self._requests[key].block_ids, chunk.start, chunk.end)
                slot[chunk.offset + chunk.start : chunk.offset + chunk.end].copy_(self.layout.kv_as_bytes(kv.contiguous()))
        with self._cond:
            self._done.add(layer)
            self._cond.notify_all()

    def end(self) -> None:
        return None

    def _wait_slot(self, layer: int) -> torch.Tensor | None:
        with self._cond:
            if not self._cond.wait_for(lambda: layer in self._slots or self._abandoned, self.timeout_s):
                raise TimeoutError(f"the prefill pipeline never offered layer {layer} in {self.timeout_s}s")
            return None if self._abandoned else self._slots[layer]


class PagesStep:
    """A step whose past KV comes from the engine's pages [n_pages, n_layer, block_size, bytes]
    and whose computed KV goes back to them: `tables[key]` is each sequence's page table."""

    def __init__(self, layout: KVLayout, pages: torch.Tensor, tables: dict[str, Sequence[int]]) -> None:
        self.layout = layout
        self.pages = pages
        self.tables = tables
        self._requests: list[ScheduledKV] = []
        self._layers: list[torch.Tensor] = []
        self._codec: PageCodec | None = None

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        unknown = [r.key for r in requests if r.key not in self.tables]
        if unknown:
            raise RuntimeError(f"vLLM scheduled sequences this step does not hold: {unknown[:5]}")
        self._requests, self._layers, self._codec = requests, layers, codec

    def before_layer(self, layer: int) -> None:
        assert self._codec is not None
        for request in self._requests:
            if request.external:
                views = page_token_views(self.pages, layer, self.tables[request.key], 0, request.external)
                past = self.layout.bytes_as_kv(torch.cat(views) if len(views) > 1 else views[0])
                self._codec.write(self._layers[layer], request.block_ids, 0, request.external, past)

    def after_layer(self, layer: int) -> None:
        assert self._codec is not None
        for request in self._requests:
            lo, hi = request.computed, request.computed + request.scheduled
            data = self.layout.kv_as_bytes(self._codec.read(self._layers[layer], request.block_ids, lo, hi).contiguous())
            offset = 0
            for view in page_token_views(self.pages, layer, self.tables[request.key], lo, hi):
                view.copy_(data[offset : offset + view.shape[0]])
                offset += view.shape[0]

    def end(self) -> None:
        return None
