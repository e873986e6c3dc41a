"""What an engine computes, batched: prefill layers over a window slot, decode steps over pages.

The engines only see `EngineCompute`; `ModelCompute` runs the real decoder, and the emulated
`ProfileCompute` (runtime/emulation/profile_compute.py) sleeps the fitted time and stamps KV.
Both work on the engines' own memory, so no KV is copied between the engine and its compute:
- prefill: a batch of chunks laid out in a window slot [capacity, bytes] (kv/window.py); chunk i
  owns tokens [offset, offset + end) of the slot, its past KV first and then the KV computed here;
- decode: pages [n_pages, n_layer, block_size, bytes] (kv/paged.py) and a block table per
  sequence; the new token's KV is written into its page, then attention reads the pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.compute.held_kv import HeldKV
from dualpath_ray.runtime.compute.chunk_spec import ChunkSpec
from dualpath_ray.runtime.compute.continuous_prefill import ContinuousPrefill
from dualpath_ray.runtime.compute.prefill_kv import PrefillKV
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.model.sampling import LogProbs, sample_token
from dualpath_ray.protocol.messages import SamplingParams


@dataclass
class PrefillBatch:
    """A batch in flight through the layers; `state` belongs to the compute implementation."""

    chunks: tuple[ChunkSpec, ...]
    state: Any = None


@dataclass
class DecodeSeq:
    """One running sequence of a decode step: the input token at `position` (= tokens with KV so
    far), its page table, and the compute's own per-sequence state (created by `decode_state`)."""

    token: int
    position: int
    table: tuple[int, ...]
    state: Any = None


@dataclass(frozen=True)
class PageFill:
    """One sequence's in-place prefill into its pages: tokens [start, end) of `prompt`, whose
    KV for [0, start) is already in the pages of `table`."""

    prompt: np.ndarray
    start: int
    end: int
    table: Sequence[int]


class ComputeBusy(RuntimeError):
    """The compute cannot run this now: the pages it needs are held by sequences the core is
    ending (vLLM's, under preemption), which the core frees only once it gets control back.
    The caller tries again in a later round; nothing of the call is left running."""


@dataclass(frozen=True)
class Sampled:
    token: int
    log_prob: float


def sampling_generator(params: SamplingParams, position: int) -> torch.Generator | None:
    """Seeded by (seed, position): the prefill side (first token) and the decode side pick the
    same token for the same prefix, whichever engine serves it."""
    if params.temperature == 0.0:
        return None
    return torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (1 << 62))


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
    contexts: Sequence[Sequence[int]], log_probs: LogProbs = "sampling",
) -> list[Sampled]:
    """One token per row of [B, vocab] logits (model/sampling.py's contract); `contexts[i]` is
    row i's token ids so far (the repetition penalty's). Greedy rows with no penalty, the common
    case, in one vectorised pass: their "sampling" and "raw" log-probs are the same number."""
    logits = logits.float().cpu()
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0 and p.repetition_penalty == 1.0]
    picked: dict[int, Sampled] = {}
    if greedy:
        rows = logits[greedy]
        tokens = torch.argmax(rows, dim=-1)
        row_log_probs = torch.log_softmax(rows, dim=-1).gather(1, tokens[:, None])[:, 0]
        for i, token, log_prob in zip(greedy, tokens.tolist(), row_log_probs.tolist()):
            picked[i] = Sampled(int(token), float(log_prob))
    for i, p in enumerate(params):
        if i not in picked:
            token, log_prob = sample_token(
                logits[i], p.temperature, p.top_p, sampling_generator(p, positions[i]), top_k=p.top_k, min_p=p.min_p,
                repetition_penalty=p.repetition_penalty, context=contexts[i], log_probs=log_probs,
            )
            picked[i] = Sampled(int(token), float(log_prob))
    return [picked[i] for i in range(len(params))]


class EngineCompute(ABC):
    """What an engine computes; the engines never know whether it is the model or a profile."""

    layout: KVLayout
    device: torch.device
    # Offered by a compute that keeps decode sequences' KV in its own pages (vLLM's engine):
    # a decode engine then keeps none (runtime/compute/held_kv.py).
    held_kv: HeldKV | None = None
    # Offered by a compute that keeps a prefill batch's KV in its own pages (vLLM's engine): a
    # prefill engine then keeps no window of KV (runtime/compute/prefill_kv.py).
    prefill_kv: PrefillKV | None = None
    # Offered by a compute that runs its own engine loop over prefill chunks (vLLM's, with
    # engine.vllm_continuous_batching): the prefill core admits chunks into it as they become
    # ready and collects each as it samples, rather than one batch at a time
    # (runtime/compute/continuous_prefill.py).
    continuous_prefill: ContinuousPrefill | None = None

    @abstractmethod
    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        """Start a batch; its layers then run in order 0..n_layer-1."""

    @abstractmethod
    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        """Compute `layer` of the batch: read each chunk's past KV from its span of `slot`
        ([capacity, bytes] uint8) and write the KV it computes behind it."""

    @abstractmethod
    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        """After the last layer: the token after each chunk `which[i]` (chunks that end their prompt)."""

    def abandon_prefill(self, batch: PrefillBatch) -> None:
        """The batch failed before sample_last (a transfer of its KV did): a compute that runs it
        elsewhere (vLLM's step on its own thread) ends it and drops its results."""

    @abstractmethod
    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        """Per-sequence state of a sequence about to decode (all tokens so far, KV for all but the
        last); `cache_domain` as ChunkSpec's."""

    @abstractmethod
    def decode_step(
        self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams],
    ) -> Sequence[Sampled | None]:
        """One step of the sequences: compute the input token's KV, sample the next, one entry
        per sequence in order. The input token's KV is in its page once its block is full at
        the latest (what the persistence reads); the native model writes every token at once,
        vLLM's compute copies whole blocks.

        None for a sequence this step did not compute: a compute that schedules its own engine
        (vLLM's, which may preempt a sequence when its pages run short and recompute it later)
        may leave some out. The core then keeps that sequence at its position (no token, no KV
        added) and asks again next step with the same input token; a sequence's tokens are the
        same whichever steps compute them. The native computes compute every sequence, always."""

    def release(self, state: Any) -> None:
        """A decode sequence left the engine (finished, failed, aborted): free what its
        `decode_state` holds (a vLLM request)."""

    @abstractmethod
    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        """Compute the KV of tokens [start, end) into `pages` given tokens [0, start) are there
        (oracle mode's in-place prefill; the decode side's recompute when it verifies KV)."""

    def fill_pages_many(self, fills: Sequence[PageFill], pages: torch.Tensor) -> None:
        """`fill_pages` for several sequences (a decode step's oracle handoffs); an
        implementation may batch them (the model does: one forward for all)."""
        for fill in fills:
            self.fill_pages(fill.prompt, fill.start, fill.end, pages, fill.table)

    @abstractmethod
    def load_weights(self, source: Any) -> None:
        """New weights in place (a safetensors directory or a state dict); a bad source leaves
        the old ones."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The weights it computes with, as a host state dict that `load_weights` takes: what a
        peer restarted with its config's weights loads to catch up (runtime/engine/weights_catch_up.py)."""
        return {}

    def stats(self) -> dict[str, Any]:
        """What the compute itself reports for `engine_stats` (vLLM: its steps and free pages)."""
        return {}

    def offload(self) -> int:
        """Sleep: move the weights off the accelerator to host memory; returns the accelerator
        bytes freed (0 where the weights already live in host memory)."""
        return 0

    def restore(self) -> None:
        """Wake: the weights back where they compute."""


def page_token_views(pages: torch.Tensor, layer: int, table: Sequence[int], start: int, end: int) -> list[torch.Tensor]:
    """[n, bytes] views of tokens [start, end) of one layer, one per page the range touches."""
    from dualpath_ray.kv.layout import block_segments

    block_size = pages.shape[2]
    return [pages[table[block], layer, lo:hi] for block, lo, hi in block_segments(start, end, block_size)]


class ModelCompute(EngineCompute):
    """The real decoder, on the engine's device."""

    def __init__(self, cfg: DualPathConfig, layout: KVLayout, device: torch.device) -> None:
        from dualpath_ray.model.llama import DecoderModel

        self.layout = layout
        self.device = device
        self.model = DecoderModel(cfg.model).to(device)
        self.log_probs: LogProbs = cfg.engine.logprobs
        self._dtype = layout.torch_dtype
        self._page_views: dict[int, list[torch.Tensor]] = {}

    # --- prefill ------------------------------------------------------------------------

    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        ids = np.concatenate([np.asarray(c.prompt[c.start : c.end], dtype=np.int64) for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.end, dtype=np.int64) for c in chunks])
        with torch.inference_mode():
            hidden = self.model.embed(torch.from_numpy(ids).to(self.device))
        state = _ModelPrefill(hidden, torch.from_numpy(positions).to(self.device))
        return PrefillBatch(tuple(chunks), state)

    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        kv = self._as_kv(slot)
        spans = [kv[c.offset : c.offset + c.end] for c in batch.chunks]
        counts = [c.new_tokens for c in batch.chunks]
        state: _ModelPrefill = batch.state
        with torch.inference_mode():
            state.hidden = self.model.forward_layer_spans(layer, state.hidden, state.positions, spans, counts)

    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        ends = np.cumsum([c.new_tokens for c in batch.chunks]) - 1
        rows = torch.as_tensor([int(ends[i]) for i in which], device=self.device)
        with torch.inference_mode():
            logits = self.model.logits(batch.state.hidden[rows])
        chunks = [batch.chunks[i] for i in which]
        contexts = [c.prompt[: c.end].tolist() if p.repetition_penalty != 1.0 else () for c, p in zip(chunks, params)]
        return sample_rows(logits, params, [c.end for c in chunks], contexts, self.log_probs)

    # --- decode -------------------------------------------------------------------------

    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        """The sequence's tokens so far (what a repetition penalty looks at); each step appends
        the token it sampled, as the core does to its own copy."""
        return [int(t) for t in tokens]

    def decode_step(self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams]) -> list[Sampled]:
        views = self._layer_views(pages)
        width = max(len(s.table) for s in seqs)
        tables = torch.tensor([list(s.table) + [s.table[0]] * (width - len(s.table)) for s in seqs], dtype=torch.int64)
        positions = torch.tensor([s.position for s in seqs], dtype=torch.int64)
        tokens = torch.tensor([s.token for s in seqs], dtype=torch.int64)
        tables, positions, tokens = tables.to(self.device), positions.to(self.device), tokens.to(self.device)
        with torch.inference_mode():
            hidden = self.model.embed(tokens)
            for layer, view in enumerate(views):
                hidden = self.model.forward_layer_paged(layer, hidden, positions, view, tables, positions + 1)
            logits = self.model.logits(hidden)
        contexts: list[list[int]] = [s.state for s in seqs]
        sampled = sample_rows(logits, params, [s.position + 1 for s in seqs], contexts, self.log_probs)
        for context, token in zip(contexts, sampled):
            context.append(token.token)
        return sampled

    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        layout = self.layout
        past = None
        if start:
            past = [
                layout.bytes_as_kv(torch.cat(page_token_views(pages, layer, table, 0, start)).to(self.device))
                for layer in range(layout.n_layer)
            ]
        ids = torch.as_tensor(np.asarray(prompt[start:end], dtype=np.int64), device=self.device)
        with torch.inference_mode():
            produced = self.model.prefill(ids, past, last_only=True).kv
        for layer, kv in enumerate(produced):
            data = layout.kv_as_bytes(kv)
            offset = 0
            for view in page_token_views(pages, layer, table, start, end):
                view.copy_(data[offset : offset + view.shape[0]])
                offset += view.shape[0]

    def fill_pages_many(self, fills: Sequence[PageFill], pages: torch.Tensor) -> None:
        """One batched forward for all `fills`, as a prefill batch runs (forward_layer_spans):
        per layer, each sequence's span holds its past KV (from its pages) and receives its new
        KV, which then goes to its pages."""
        if len(fills) < 2:
            for fill in fills:
                self.fill_pages(fill.prompt, fill.start, fill.end, pages, fill.table)
            return
        layout, device = self.layout, self.device
        ids = np.concatenate([np.asarray(f.prompt[f.start : f.end], dtype=np.int64) for f in fills])
        positions = np.concatenate([np.arange(f.start, f.end, dtype=np.int64) for f in fills])
        counts = [f.end - f.start for f in fills]
        with torch.inference_mode():
            hidden = self.model.embed(torch.from_numpy(ids).to(device))
            positions_t = torch.from_numpy(positions).to(device)
            for layer in range(layout.n_layer):
                spans = [torch.empty((f.end, *layout.kv_token_shape), dtype=self._dtype, device=device) for f in fills]
                for fill, span in zip(fills, spans):
                    if fill.start:
                        past = torch.cat(page_token_views(pages, layer, fill.table, 0, fill.start)).to(device)
                        span[: fill.start].copy_(layout.bytes_as_kv(past))
                hidden = self.model.forward_layer_spans(layer, hidden, positions_t, spans, counts)
                for fill, span in zip(fills, spans):
                    data = layout.kv_as_bytes(span[fill.start : fill.end])
                    offset = 0
                    for view in page_token_views(pages, layer, fill.table, fill.start, fill.end):
                        view.copy_(data[offset : offset + view.shape[0]])
                        offset += view.shape[0]

    def load_weights(self, source: Any) -> None:
        self.model.load_weights(source)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.cpu() for name, tensor in self.model.checkpoint_tensors().items()}

    def offload(self) -> int:
        if self.device.type == "cpu":
            return 0
        freed = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        self.model.to("cpu")
        self._page_views.clear()
        torch.cuda.empty_cache()
        return freed

    def restore(self) -> None:
        self.model.to(self.device)

    # --- byte views ---------------------------------------------------------------------

    def _as_kv(self, data: torch.Tensor) -> torch.Tensor:
        """A [tokens, bytes] uint8 tensor viewed as [tokens, 2, n_kv_head, head_dim] model dtype."""
        return data.view(self._dtype).view(data.shape[0], *self.layout.kv_token_shape)

    def _layer_views(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the pages as [n_pages, block_size, 2, n_kv_head, head_dim] (strided) views."""
        key = pages.data_ptr()
        if key not in self._page_views:
            n_pages, _, block_size, _ = pages.shape
            self._page_views[key] = [
                pages[:, layer].view(self._dtype).view(n_pages, block_size, *self.layout.kv_token_shape)
                for layer in range(self.layout.n_layer)
            ]
        return self._page_views[key]


@dataclass
class _ModelPrefill:
    hidden: torch.Tensor
    positions: torch.Tensor
