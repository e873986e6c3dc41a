"""What one vLLM step moves through the connector (runtime/vllm_engine/connector.py): `StepKV`s.

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

from typing import Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.vllm_engine.pages import PageCodec, token_positions
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV


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
