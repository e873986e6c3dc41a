"""What one vLLM step moves through the connector (runtime/vllm_engine/connector.py): `StepKV`s.

- `PrefillStep`: a prefill batch run by the engine's LayerPipeline (runtime/prefill/pipeline.py)
  while vLLM runs the same batch's forward on another thread. The two meet once per layer, in
  order: the pipeline offers layer l's window slot once the layer's past KV has landed in it
  (`offer`), vLLM's forward copies that past KV into its pages before the layer's attention
  (`before_layer`) and, after it, the KV the layer computed back into the slot (`after_layer`);
  only then does `offer` return and the pipeline send the slot on. So each layer's transfers
  overlap the other layers' compute exactly as with the native model.
- `PagesStep`: a step over pages of ours [n_pages, n_layer, block_size, bytes]: the past KV
  comes from them and what vLLM computes goes back to them (a recompute into pages: KV
  verification's expected KV, with `whole_spans`).
- `RecordingStep`: a decode engine's step. Its sequences' KV stays in vLLM's pages (compute.py:
  the engine keeps none), so it moves nothing but records each request's vLLM pages, which
  full blocks are read back from; a PagesStep of a recompute may ride along.

Both speak token-major KV ([tokens, 2, n_kv_head, head_dim], kv/layout.py) on their side and
vLLM's pages on the other, through the PageCodec.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.vllm_engine.pages import PageCodec, token_positions
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV


class PrefillStep:
    """One prefill batch: chunk `keys[i]` computes `chunks[i]` (see the module doc)."""

    def __init__(self, layout: KVLayout, keys: Sequence[str], chunks: Sequence[ChunkSpec], timeout_s: float) -> None:
        self.layout = layout
        self.chunks = dict(zip(keys, chunks))
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._slots: dict[int, torch.Tensor] = {}
        self._done: set[int] = set()
        self._load: _Moves | None = None  # window rows -> vLLM (page, slot) of every chunk's past KV
        self._save: _Moves | None = None  # vLLM (page, slot) -> window rows of every chunk's new KV
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
            # vLLM computes the chunk to its end in this one step, from its start or from past it
            # where its own prefix cache holds more of the prompt than the chunk's past KV.
            if got.computed + got.scheduled != chunk.end or got.computed < chunk.start or got.load_from > got.computed:
                raise RuntimeError(
                    f"vLLM scheduled tokens [{got.computed}, {got.computed + got.scheduled}) of a chunk of "
                    f"[{chunk.start}, {chunk.end}) (loading from {got.load_from})"
                )
        device = layers[0].device
        # The window holds each chunk's past KV [0, start); what vLLM's prefix cache did not
        # hold of it goes into its pages. The new KV [start, end) goes back to the window whole,
        # including tokens vLLM's cache held (computed > start): the decode node needs them all.
        self._load = _moves(
            [(by_key[k].block_ids, c.offset, by_key[k].load_from, by_key[k].computed)
             for k, c in self.chunks.items() if by_key[k].loading], codec, device
        )
        self._save = _moves([(by_key[k].block_ids, c.offset, c.start, c.end) for k, c in self.chunks.items()], codec, device)
        self._layers, self._codec = layers, codec

    def before_layer(self, layer: int) -> None:
        slot = self._wait_slot(layer)
        if slot is None or self._load is None:
            return
        assert self._codec is not None
        rows, pages, slots = self._load
        self._codec.scatter(self._layers[layer], pages, slots, self.layout.bytes_as_kv(slot[rows]))

    def after_layer(self, layer: int) -> None:
        with self._cond:
            slot = None if self._abandoned else self._slots.get(layer)
        if slot is not None and self._save is not None:
            assert self._codec is not None
            rows, pages, slots = self._save
            slot[rows] = self.layout.kv_as_bytes(self._codec.gather(self._layers[layer], pages, slots))
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
    and whose computed KV goes back to them: `tables[key]` is each sequence's page table.

    With `whole_spans` (a recompute into pages: oracle handoffs, KV verification) every token the
    step computes is saved. Otherwise (decode steps) only the blocks the step completes are, each
    whole, from vLLM's pages: the decode core reads its pages only to persist full blocks (and
    verification reads the prompt, which the transport put there), so a decode step copies
    nothing until a block fills, once every block_size steps per sequence."""

    def __init__(
        self, layout: KVLayout, pages: torch.Tensor, tables: dict[str, Sequence[int]], whole_spans: bool = False,
    ) -> None:
        self.layout = layout
        self.pages = pages
        self.tables = tables
        self.whole_spans = whole_spans
        self._load: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._save: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._layers: list[torch.Tensor] = []
        self._codec: PageCodec | None = None

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        unknown = [r.key for r in requests if r.key not in self.tables]
        if unknown:
            raise RuntimeError(f"vLLM scheduled sequences this step does not hold: {unknown[:5]}")
        device = layers[0].device
        loads = [(r, r.load_from, r.computed) for r in requests if r.loading]
        if self.whole_spans:
            # A recompute's request loads its past and computes the rest in its first step (its
            # private cache salt keeps vLLM's prefix cache out of it: VllmHost.add), later steps
            # go on where that one ended: every step saves what it computed.
            saves = [(r, r.computed, r.computed + r.scheduled) for r in requests]
        else:
            saves = [span for r in requests if (span := self._completed_blocks(r)) is not None]
        self._load = self._positions(loads, codec, device) if loads else None
        self._save = self._positions(saves, codec, device) if saves else None
        self._layers, self._codec = layers, codec

    def _completed_blocks(self, request: ScheduledKV) -> tuple[ScheduledKV, int, int] | None:
        """The whole blocks whose last token this step computes, as one span of tokens, or None:
        block b is completed when computed < (b + 1) * block_size <= computed + scheduled."""
        size = self.layout.block_size
        lo = request.computed // size * size
        hi = (request.computed + request.scheduled) // size * size
        return (request, lo, hi) if hi > lo else None

    def _positions(self, spans: list[tuple[ScheduledKV, int, int]], codec: PageCodec, device: torch.device) -> tuple:
        """((our page, slot), (vLLM page, slot)) of every token of these spans, in one order."""
        ours = token_positions([(self.tables[r.key], lo, hi) for r, lo, hi in spans], self.layout.block_size, self.pages.device)
        return ours, codec.positions([(r.block_ids, lo, hi) for r, lo, hi in spans], device)

    def before_layer(self, layer: int) -> None:
        if self._load is None:
            return
        assert self._codec is not None
        (pages, slots), (vpages, vslots) = self._load
        past = self.layout.bytes_as_kv(self.pages[pages, layer, slots])
        self._codec.scatter(self._layers[layer], vpages, vslots, past)

    def after_layer(self, layer: int) -> None:
        if self._save is None:
            return
        assert self._codec is not None
        (pages, slots), (vpages, vslots) = self._save
        kv = self._codec.gather(self._layers[layer], vpages, vslots)
        self.pages[pages, layer, slots] = self.layout.kv_as_bytes(kv)

    def end(self) -> None:
        return None


class RecordingStep:
    """A decode engine's step (its sequences' KV stays in vLLM's pages, compute.py): it moves
    nothing itself but records every scheduled request's vLLM pages (`blocks`: key -> page
    list), which the persistence and the KV checks read full blocks from; the requests of
    `fills` (a recompute into pages run in the same step) go to it."""

    def __init__(self, fills: PagesStep | None = None) -> None:
        self.fills = fills
        self.blocks: dict[str, tuple[int, ...]] = {}

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        self.blocks = {r.key: r.block_ids for r in requests}
        if self.fills is not None:
            self.fills.begin([r for r in requests if r.key in self.fills.tables], layers, codec)

    def before_layer(self, layer: int) -> None:
        if self.fills is not None:
            self.fills.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        if self.fills is not None:
            self.fills.after_layer(layer)

    def end(self) -> None:
        return None


_Moves = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # window rows, vLLM pages, vLLM slots


def _moves(spans: list[tuple[Sequence[int], int, int, int]], codec: PageCodec, device: torch.device) -> _Moves | None:
    """Window rows and vLLM (page, slot) of tokens [lo, hi) of each (block_ids, offset, lo, hi):
    a chunk's token t sits in window row offset + t."""
    if not spans:
        return None
    rows = torch.cat([torch.arange(offset + lo, offset + hi, dtype=torch.int64) for _, offset, lo, hi in spans])
    pages, slots = codec.positions([(block_ids, lo, hi) for block_ids, _, lo, hi in spans], device)
    return rows.to(device), pages, slots
