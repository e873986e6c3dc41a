"""`VllmCompute`: the engines' EngineCompute (runtime/compute/engine_compute.py) with vLLM computing.

The prefill and decode cores, the layer pipeline, the decode intake and persistence are the
native engines' own; only what computes changes, so the scheduler, readers, store, transport,
metrics and emulation decide and move exactly what they do for the native engines:

- A prefill batch (packed by the core with the paper's compute quota) is one vLLM step: every
  chunk is a vLLM request for its prompt up to the chunk's end whose first `start` tokens are
  external, sampling one token (the first output token on the last chunk). vLLM's forward runs on
  a thread of its own while the core's LayerPipeline moves the layers: runtime/vllm_engine/steps.py
  PrefillStep hands each layer's past KV from the window slot into vLLM's pages and the layer's
  new KV back into the slot, which the pipeline then sends to the decode node.
- A decode sequence is one vLLM request from its first step to its end: its prompt's KV is
  loaded from the decode engine's pages (where the transport put it) on its first step, and each
  block it fills is copied back into those pages (PagesStep), which the persistence sends to the
  store as it does the native model's.
- Oracle mode and KV verification recompute into pages (`fill_pages`) the same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec, DecodeSeq, EngineCompute, PageFill, PrefillBatch, Sampled
from dualpath_ray.protocol.types import Role
from dualpath_ray.runtime.vllm_engine.host import VllmHost
from dualpath_ray.runtime.vllm_engine.steps import PagesStep, PrefillStep

GREEDY = SamplingParams(max_new_tokens=1)


@dataclass
class _PrefillRun:
    step: PrefillStep
    keys: list[str]
    thread: threading.Thread
    sampled: dict[str, tuple[int, float]] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class _DecodeState:
    """One decode sequence's vLLM request: its key, every token so far, and whether it was added."""

    key: str
    tokens: list[int]
    cache_domain: str
    added: bool = False
    suspended: bool = False  # taken out of vLLM once (fill_pages): its pages hold only its full blocks


class VllmCompute(EngineCompute):
    def __init__(self, cfg: DualPathConfig, layout: KVLayout, device: torch.device, role: Role) -> None:
        self.layout = layout
        self.device = device
        self.timeout_s = cfg.runtime.request_timeout_s
        self.max_context = cfg.model.max_context
        self.host = VllmHost(cfg, layout, role)
        self._live: dict[str, _DecodeState] = {}  # decode sequences added to vLLM and not yet released
        self._loaded: dict[str, torch.Tensor] | None = None  # the last state dict loaded (export_weights)

    # --- prefill ------------------------------------------------------------------------

    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        keys = [self.host.new_key("p") for _ in chunks]
        for key, chunk in zip(keys, chunks):
            self.host.add(
                key, chunk.prompt[: chunk.end], chunk.start, chunk.sampling or GREEDY, max_tokens=1,
                cache_domain=chunk.cache_domain,
            )
        run = _PrefillRun(PrefillStep(self.layout, keys, chunks, self.timeout_s), keys, threading.Thread())
        run.thread = threading.Thread(target=self._run_prefill, args=(run,), name="vllm-prefill-step", daemon=True)
        run.thread.start()
        return PrefillBatch(tuple(chunks), run)

    def _run_prefill(self, run: _PrefillRun) -> None:
        try:
            run.sampled = self.host.run(run.step)
        except BaseException as exc:  # noqa: BLE001 - handed to the pipeline's thread, which fails the batch
            run.error = exc
            run.step.failed(exc)

    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        batch.state.step.offer(layer, slot)

    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        run: _PrefillRun = batch.state
        run.thread.join(self.timeout_s)
        if run.thread.is_alive():
            raise TimeoutError(f"vLLM's prefill step did not end in {self.timeout_s}s")
        if run.error is not None:
            raise RuntimeError(f"vLLM's prefill step failed: {run.error!r}") from run.error
        missing = [run.keys[i] for i in which if run.keys[i] not in run.sampled]
        if missing:
            raise RuntimeError(f"vLLM sampled no token for {len(missing)} chunks of the batch")
        return [Sampled(*run.sampled[run.keys[i]]) for i in which]

    def abandon_prefill(self, batch: PrefillBatch) -> None:
        """The pipeline failed: let vLLM's step end without moving more KV, and drop it."""
        run: _PrefillRun | None = batch.state
        if run is None:
            return
        run.step.abandon()
        run.thread.join(self.timeout_s)
        self.host.abort(list(run.keys))

    # --- decode -------------------------------------------------------------------------

    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        return _DecodeState(self.host.new_key("d"), [int(t) for t in tokens], cache_domain)

    def decode_step(self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams]) -> list[Sampled]:
        states: list[_DecodeState] = [seq.state for seq in seqs]
        # The core steps every running sequence: one of vLLM's that is not here stopped running
        # (it reached its stop rule or failed), so vLLM must not compute it again.
        stepping = {state.key for state in states}
        self.host.abort([key for key in self._live if key not in stepping])
        self._live = {key: state for key, state in self._live.items() if key in stepping}
        for seq, state, sampling in zip(seqs, states, params):
            if state.tokens[-1] != seq.token or len(state.tokens) != seq.position + 1:
                raise RuntimeError(f"decode sequence {state.key} is at token {seq.position} ({seq.token}), vLLM's at "
                                   f"{len(state.tokens) - 1} ({state.tokens[-1]})")
            if not state.added:
                budget = max(1, self.max_context - len(state.tokens))
                # A sequence added again after a suspension loads only its full blocks: the pages
                # hold a block's KV once it fills (PagesStep), and vLLM recomputes the tail.
                external = seq.position // self.layout.block_size * self.layout.block_size if state.suspended else seq.position
                self.host.add(state.key, state.tokens, external, sampling, max_tokens=budget, cache_domain=state.cache_domain)
                state.added = True
                self._live[state.key] = state
        sampled = self.host.run(PagesStep(self.layout, pages, {s.key: seq.table for s, seq in zip(states, seqs)}))
        missing = [s.key for s in states if s.key not in sampled]
        if missing:
            raise RuntimeError(
                f"vLLM left {len(missing)} of {len(states)} decode sequences out of a step (too few pages or "
                "engine.vllm_max_num_seqs)"
            )
        out = []
        for state in states:
            token, log_prob = sampled[state.key]
            state.tokens.append(token)
            out.append(Sampled(token, log_prob))
        return out

    def release(self, state: Any) -> None:
        """The decode job ended (finished, failed, aborted): its vLLM request goes too."""
        if isinstance(state, _DecodeState) and self._live.pop(state.key, None) is not None:
            self.host.abort([state.key])

    def fill_pages_many(self, fills: Sequence[PageFill], pages: torch.Tensor) -> None:
        """Recompute tokens [start, end) of each fill into pages (oracle handoffs, KV
        verification), in as few vLLM steps as its token budget allows (a fill longer than the
        budget is chunked by vLLM across steps; each step saves what it computed). vLLM would run
        every live decode sequence in those steps too and sample for it outside the core's decode
        step, so they leave vLLM first; each is added again at its next decode step, loading the
        full blocks the engine's pages hold and recomputing its tail."""
        if not fills:
            return
        self._suspend_decode_sequences()
        tables = {}
        for fill in fills:
            key = self.host.new_key("f")
            self.host.add(key, fill.prompt[: fill.end], fill.start, GREEDY, max_tokens=1, private_cache=True)
            tables[key] = fill.table
        left = set(tables)
        while left:
            sampled = self.host.run(PagesStep(self.layout, pages, tables, whole_spans=True))
            if not sampled and not self.host.unfinished():
                raise RuntimeError(f"vLLM dropped {len(left)} recomputes into pages")
            left -= set(sampled)

    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        self.fill_pages_many([PageFill(prompt, start, end, table)], pages)

    def stats(self) -> dict[str, Any]:
        """vLLM's own figures: steps run, requests it holds and its free KV pages (its scheduler's count)."""
        return {"backend": "vllm", "steps": self.host.steps, "unfinished": self.host.unfinished(),
                "free_pages": self.host.free_pages(), "decode_sequences": len(self._live),
                "prefix_cache_hit_tokens": self.host.connector.local_hit_tokens}

    def _suspend_decode_sequences(self) -> None:
        self.host.abort(list(self._live))
        for state in self._live.values():
            state.key = self.host.new_key("d")  # a fresh vLLM request when it is added again
            state.added = False
            state.suspended = True
        self._live = {}

    # --- weights ------------------------------------------------------------------------

    def load_weights(self, source: Any) -> None:
        self.host.load_weights(source)
        # vLLM keeps its weights in its own (fused, sharded) layout, which no state dict names:
        # what was loaded is kept on the host for a restarted peer to catch up from (one host
        # copy of the weights; the config's weights need none, a restarted peer builds them too).
        self._loaded = {name: tensor.detach().cpu() for name, tensor in dict(source).items()} if isinstance(source, dict) else None

    def export_weights(self) -> dict[str, torch.Tensor]:
        if self._loaded is None:
            raise RuntimeError("this vLLM engine holds its config's weights (or a checkpoint directory's): nothing to export")
        return dict(self._loaded)

    def offload(self) -> int:
        """Sleep: vLLM's own sleep mode frees its weights and pages on a GPU; on the CPU nothing
        moves (the weights already live in host memory)."""
        if self.device.type == "cpu":
            return 0
        before = torch.cuda.memory_allocated(self.device)
        self.host.sleep()
        return max(0, before - torch.cuda.memory_allocated(self.device))

    def restore(self) -> None:
        if self.device.type != "cpu":
            self.host.wake_up()
