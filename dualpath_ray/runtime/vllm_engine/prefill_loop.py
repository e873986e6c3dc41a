"""vLLM's continuous batching on a prefill engine: `VllmPrefillLoop`, the ContinuousPrefill
(runtime/compute/continuous_prefill.py) a vLLM prefill compute offers with
engine.vllm_continuous_batching.

Every admitted chunk becomes a vLLM request before the loop's next step (for its prompt up to
the chunk's end, its whole blocks of past KV external, sampling one token: the same request as a
batch's chunk, compute.py), joining vLLM's waiting queue while earlier ones compute. One thread
runs vLLM's loop and is the only one to touch vLLM while chunks are in it: it adds the admitted
chunks, steps while any is in vLLM, and sleeps when none is (`admit` only queues, so the
engine's worker never waits out a step for vLLM's lock). vLLM's scheduler
forms each step from what runs and waits, within its token budget
(engine.vllm_max_num_batched_tokens) and its sequence count, so one step may hold chunks of
several admissions. The step-lifetime StepKV (`RequestSteps`, request_steps.py) moves each
chunk's KV as its own PagedPrefillStep, and fails a chunk alone. A chunk is done when vLLM
sampled its token (its KV all sent: `PagedPrefillStep.finish`) or it failed (its vLLM request
aborted); the loop wakes the engine's worker to `collect` it.

A failed chunk leaves its blocks in vLLM's prefix cache, suspect (request_steps.py): the loop
then admits nothing (`admitting`) until every chunk in vLLM is done, and empties the cache.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.chunk_spec import ChunkSpec
from dualpath_ray.runtime.compute.continuous_prefill import PrefillCollected
from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap
from dualpath_ray.runtime.vllm_engine.host import VllmHost
from dualpath_ray.runtime.vllm_engine.prefill_pages import PagedPrefillStep, loaded_tokens
from dualpath_ray.runtime.vllm_engine.request_steps import RequestSteps

LOG = logging.getLogger("dualpath_ray.vllm_prefill")
GREEDY = SamplingParams(max_new_tokens=1)
IDLE_STEPS = 3  # steps in a row that schedule no admitted chunk: vLLM cannot run them


@dataclass(frozen=True)
class KVBinding:
    """What a chunk's KV moves through: the transport vLLM's backing `buffer` is registered with
    as `pool`, the block-layer map, and the engine's NIC directions (in, out)."""

    transport: Any
    pool: str
    buffer: torch.Tensor
    block_map: BlockLayerMap
    takes: tuple[Callable[[int], None], Callable[[int], None]]


class VllmPrefillLoop:
    """See the module doc. `binding` gives the KV binding once the engine bound its transport
    (None before)."""

    def __init__(
        self, host: VllmHost, layout: KVLayout, timeout_s: float, binding: Callable[[], KVBinding | None],
    ) -> None:
        self.host = host
        self.layout = layout
        self.timeout_s = timeout_s
        self._binding = binding
        self._steps = RequestSteps(layout.block_size)
        self._cond = threading.Condition()
        self._live: set[str] = set()  # admitted chunks not yet done (pending or in vLLM)
        self._pending: list[tuple[str, ChunkSpec]] = []  # admitted, not yet added to vLLM
        self._done: list[PrefillCollected] = []
        self._wake: Callable[[], None] = _nobody
        self._thread: threading.Thread | None = None
        self.admissions = 0
        self.vllm_steps = 0  # steps the loop ran (one may hold chunks of several admissions)
        self.failed_chunks = 0
        self.prefix_cache_resets = 0

    # --- ContinuousPrefill --------------------------------------------------------------

    def bind_wake(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def admitting(self) -> bool:
        return self._reset_if_drained()

    def admit(self, chunks: Sequence[ChunkSpec]) -> list[str]:
        binding = self._binding()
        if binding is None:
            raise RuntimeError("a vLLM prefill engine binds its transport (bind) before its first chunk")
        missing = [i for i, chunk in enumerate(chunks) if chunk.kv is None]
        if missing:
            raise ValueError(f"chunks {missing} name no KV sources and destinations (ChunkSpec.kv)")
        self.admissions += 1
        steps = [
            PagedPrefillStep(
                self.layout, [key], [chunk], binding.transport, binding.pool, binding.buffer, binding.block_map,
                binding.takes, self.timeout_s,
            )
            for key, chunk in ((self.host.new_key("p"), chunk) for chunk in chunks)
        ]
        keys = [step.keys[0] for step in steps]
        for key, step in zip(keys, steps):
            self._steps.add(key, self.admissions, step)  # known to the StepKV before vLLM may schedule it
        with self._cond:
            # The loop adds them to vLLM between its steps: the engine's worker never waits for
            # vLLM's lock (held through a step) and never contends with the loop for it.
            self._pending.extend(zip(keys, chunks))
            self._live.update(keys)
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vllm-prefill-loop", daemon=True)
            self._thread.start()
        return keys

    def collect(self) -> list[PrefillCollected]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def take_moved(self) -> PrefillMoved:
        return self._steps.take_moved()

    # --- the loop -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {"prefill_admissions": self.admissions, "prefill_loop_steps": self.vllm_steps,
                "prefill_mixed_steps": self._steps.mixed_steps, "prefill_failed_chunks": self.failed_chunks,
                "prefill_cache_resets": self.prefix_cache_resets, "prefill_in_flight": len(self._live),
                "prefill_loop_landed_block_layers": self._steps.landed_block_layers}

    def _run(self) -> None:
        idle = 0
        while True:
            with self._cond:
                while not self._live:
                    self._cond.wait()
                pending, self._pending = self._pending, []
                live = set(self._live)
            done = self._add(pending)
            if not live - {d.ticket for d in done}:
                idle = 0
            else:
                try:
                    done += self._step()
                except Exception as exc:  # noqa: BLE001 - the loop must outlive any one step: its chunks fail instead
                    LOG.exception("vLLM's prefill loop failed a step's bookkeeping")
                    done += self._fail({key for key in live if self._steps.holds(key)}, exc)
                idle = 0 if self._steps.scheduled & live else idle + 1
            if idle >= IDLE_STEPS:
                left = live - {d.ticket for d in done}
                error = RuntimeError(
                    f"vLLM scheduled none of the {len(left)} admitted prefill chunks in {idle} steps: raise "
                    "engine.vllm_max_num_seqs or the vLLM KV pages (cluster.prefill_hbm_tokens)"
                )
                done += self._fail(left, error)
                idle = 0
            with self._cond:
                self._live -= {d.ticket for d in done}
                self._done.extend(done)
            self._reset_if_drained()
            if done:
                self._wake()

    def _add(self, pending: list[tuple[str, ChunkSpec]]) -> list[PrefillCollected]:
        """Admitted chunks into vLLM's waiting queue (each a request for its prompt up to the
        chunk's end, its whole blocks of past KV external, one token sampled); one vLLM refuses
        fails."""
        done = []
        for key, chunk in pending:
            try:
                self.host.add(
                    key, chunk.prompt[: chunk.end], loaded_tokens(chunk, self.layout.block_size), chunk.sampling or GREEDY,
                    max_tokens=1, cache_domain=chunk.cache_domain,
                )
            except Exception as exc:  # noqa: BLE001 - e.g. a prompt vLLM refuses: this chunk fails
                self._steps.pop(key)
                self.failed_chunks += 1
                done.append(PrefillCollected(key, error=exc))
        return done

    def _step(self) -> list[PrefillCollected]:
        """One vLLM step: the chunks it finished (sampled, each having sent all its KV) or failed."""
        self._steps.new_step()
        try:
            sampled = self.host.run(self._steps)
        except BaseException as exc:  # noqa: BLE001 - vLLM's step failed as a whole: every chunk in it fails
            LOG.error("vLLM's prefill step failed: %r", exc)
            self._steps.recover()
            self.vllm_steps += 1
            with self._cond:  # the chunks in vLLM: not those admitted during the step, still to be added
                live = self._live - {key for key, _ in self._pending}
            return self._fail(live | self._steps.scheduled, exc)
        self.vllm_steps += 1
        failed = self._steps.take_failed()
        done = self._fail(set(failed), None, failed)
        for key, (token, log_prob) in sampled.items():
            if key in failed or not self._steps.holds(key):
                continue
            step = self._steps.pop(key)
            try:
                step.finish()
            except Exception as exc:  # noqa: BLE001 - a bug's symptom: this chunk fails, its blocks suspect
                self._steps.suspect_all()
                self.failed_chunks += 1
                done.append(PrefillCollected(key, error=exc))
                continue
            done.append(PrefillCollected(key, token, log_prob, step.moved.digests[0]))
        return done

    def _fail(
        self, keys: set[str], error: BaseException | None, errors: dict[str, BaseException] | None = None,
    ) -> list[PrefillCollected]:
        """These chunks fail (with `errors[key]`, else `error`): vLLM computes them no more."""
        self.host.abort(sorted(keys))
        done = []
        for key in sorted(keys):
            if self._steps.holds(key):
                self._steps.pop(key)
            reason = (errors or {}).get(key, error)
            assert reason is not None
            done.append(PrefillCollected(key, error=reason))
        self.failed_chunks += len(done)
        if error is not None:
            self._steps.suspect_all()  # a whole step failed: nothing in the cache is vouched for
        return done

    def _reset_if_drained(self) -> bool:
        """Whether chunks may be admitted: yes unless a failure left vLLM's prefix cache suspect,
        which is emptied once no chunk is in vLLM (vLLM refuses while a request holds pages)."""
        with self._cond:
            if not self._steps.suspect():
                return True
            if self._live:
                return False
            if not self.host.reset_prefix_cache():
                return False
            self._steps.clear_suspect()
            self.prefix_cache_resets += 1
            return True


def _nobody() -> None:
    """No worker bound to wake yet."""
