"""A compute that keeps decode sequences' KV in pages of its own (a HeldKV, runtime/compute/held_kv.py),
as vLLM's does (runtime/vllm_engine/compute.py), over an inner compute (the native model): what a
unit test of the decode intake's held-KV paths runs without a vLLM engine.

Its pages are Full Blocks [n_pages, n_layer, block_size, bytes], one page list per sequence: a
prompt lands in them through the transport (`load_prompt`), oracle mode computes it into them
(`compute_prompts`), and decode steps run the inner compute on them. Being Full Blocks, they are
pulled to be persisted as a native engine's Pool.HBM pages are (`paged_blocks` is None; the
engine harness registers them under both names).

`busy` makes it answer ComputeBusy, as vLLM does when decode sequences hold the pages a call
needs: `busy[site]` more calls at a site raise it (sites: "fill", the KV check's recompute;
"read", reading a sequence's blocks back; "prompts", oracle mode's prompt compute). With
`prompt_page_limit`, oracle mode's prompt compute finds pages as vLLM's does: a prompt is
computed only while the sequences' pages stay within the limit, else ComputeBusy while another
sequence holds pages (the sequences a call computed before it too). `events` records every call
by the prompt it was for, so a test sees what waited and in what order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.engine_compute import (
    ChunkSpec,
    ComputeBusy,
    DecodeSeq,
    EngineCompute,
    PrefillBatch,
    Sampled,
)
from dualpath_ray.runtime.transport.moves import Region

SITES = ("fill", "read", "prompts")


@dataclass
class HeldSeq:
    """One decode sequence: its tokens (all but the last have KV), the inner compute's state, its pages."""

    tokens: tuple[int, ...]
    inner: Any
    pages: list[int] = field(default_factory=list)
    computed: bool = False  # its prompt's KV is in its pages (landed or computed)


class HeldPagesCompute(EngineCompute):
    """See the module doc."""

    def __init__(self, inner: EngineCompute, n_pages: int) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.device = inner.device
        self.pages = torch.zeros((n_pages, *self.layout.full_block_shape), dtype=torch.uint8, device=self.device)
        self.free: list[int] = list(range(n_pages))
        self.held_kv = self  # type: ignore[assignment]
        self.busy: dict[str, int] = {site: 0 for site in SITES}
        self.prompt_page_limit: int | None = None
        self.events: list[tuple[str, tuple[int, ...]]] = []
        self._transport: Any = None
        self._pool = ""

    # --- ComputeBusy, as vLLM raises it ----------------------------------------------------

    def _call(self, site: str, prompt: Sequence[int]) -> None:
        """Record a call at `site` for `prompt`; raise ComputeBusy while `busy[site]` says so."""
        key = tuple(int(t) for t in prompt)
        if self.busy[site] > 0:
            self.busy[site] -= 1
            self.events.append((f"{site} busy", key))
            raise ComputeBusy(f"injected: no pages for a {site} call")
        self.events.append((site, key))

    def _allocate(self, seq: HeldSeq, tokens: int) -> None:
        need = self.layout.blocks_for(tokens) - len(seq.pages)
        if need > len(self.free):
            raise RuntimeError(f"the held compute has {len(self.free)} free pages, {need} asked for")
        for _ in range(max(0, need)):
            seq.pages.append(self.free.pop(0))

    def free_pages(self) -> int:
        return len(self.free)

    # --- HeldKV ----------------------------------------------------------------------------

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.pages.view(-1)

    def bind(self, transport: Any, pool: str) -> None:
        self._transport, self._pool = transport, pool

    def load_prompt(self, state: Any, sampling: SamplingParams, peer: str, pool: str, offsets: Sequence[int]) -> Any:
        seq: HeldSeq = state
        self.events.append(("load", seq.tokens[:-1]))
        self._allocate(seq, len(seq.tokens) - 1)
        full = self.layout.full_block_bytes
        moves = [(Region(self._pool, page * full, full), Region(pool, offset, full))
                 for page, offset in zip(seq.pages, offsets)]
        seq.computed = True
        return self._transport.read(peer, moves)

    def compute_prompts(self, states: Sequence[Any], sampling: Sequence[SamplingParams]) -> None:
        """As vLLM's: the prompts in order, while pages last; a call that raises ComputeBusy
        leaves its sequences waiting, and the same call later carries on (a sequence computed
        already is not computed again)."""
        seqs: list[HeldSeq] = [state for state in states if not state.computed]
        for seq in seqs:
            self._call("prompts", seq.tokens[:-1])
        for seq in seqs:
            prompt = np.asarray(seq.tokens[:-1], dtype=np.int64)
            held = len(self.pages) - len(self.free)
            if self.prompt_page_limit is not None and held + self.layout.blocks_for(len(prompt)) > self.prompt_page_limit:
                self.events.append(("prompts no pages", seq.tokens[:-1]))
                if not held:
                    raise RuntimeError(f"a prompt of {len(prompt)} tokens needs more than {self.prompt_page_limit} pages")
                raise ComputeBusy(f"no pages for a prompt of {len(prompt)} tokens: sequences hold {held}")
            self._allocate(seq, len(prompt))
            self.inner.fill_pages(prompt, 0, len(prompt), self.pages, seq.pages)
            seq.computed = True

    def read_blocks(self, state: Any, blocks: Sequence[int]) -> torch.Tensor:
        seq: HeldSeq = state
        self._call("read", seq.tokens[:-1])
        return self.pages[[seq.pages[b] for b in blocks]].clone()

    def block_pages(self, state: Any, blocks: Sequence[int]) -> list[int]:
        return [state.pages[b] for b in blocks]

    def paged_blocks(self, pool: str) -> PagedBlockLayers | None:
        return None  # Full Block pages: pulled as a native engine's Pool.HBM

    # --- EngineCompute ---------------------------------------------------------------------

    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        return self.inner.begin_prefill(chunks)

    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        self.inner.prefill_layer(batch, layer, slot)

    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        return self.inner.sample_last(batch, which, params)

    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        return HeldSeq(tuple(int(t) for t in tokens), self.inner.decode_state(tokens, cache_domain))

    def decode_step(self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams]) -> Sequence[Sampled | None]:
        """The inner compute's step on this compute's pages (`pages`, the engine's, hold nothing)."""
        inner = []
        for seq in seqs:
            held: HeldSeq = seq.state
            self._allocate(held, seq.position + 1)
            inner.append(DecodeSeq(seq.token, seq.position, tuple(held.pages), held.inner))
        return self.inner.decode_step(inner, self.pages, params)

    def release(self, state: Any) -> None:
        if isinstance(state, HeldSeq):
            self.free.extend(state.pages)
            state.pages = []

    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        self._call("fill", prompt)
        self.inner.fill_pages(prompt, start, end, pages, table)

    def load_weights(self, source: Any) -> None:
        self.inner.load_weights(source)
