"""DecodeEngine (`decode/<node>/<gpu>`): KV in "HBM", batched decode, persistence.

A reservation (from the scheduler, via the group leader) holds HBM for the prompt and its
output. At handoff the prompt's KV moves from the node's buffer extent into HBM (H2D) and the
extent is freed; every full block of the prompt that is not yet stored, and every block that
fills up while decoding, is persisted at once through the node's reader (D2H + SNIC write).
The turn's result is reported only after its blocks are stored, so the next turn hits them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import block_keys
from dualpath_ray.kv.layout import split_by_blocks
from dualpath_ray.kv.pool import BufferPool
from dualpath_ray.runtime.engine import EngineBase, EngineIdentity
from dualpath_ray.runtime.messages import (
    DecodeHandoff,
    DecodeReservation,
    PersistedBlock,
    TurnResult,
    failed_result,
)
from dualpath_ray.runtime.transport import endpoint_actor_options
from dualpath_ray.scheduling import EngineLoad


LOG = logging.getLogger("dualpath_ray.decode")
# Full Blocks one engine may have on their way to the store at once (D2H staging slots).
PERSIST_STAGING_BLOCKS = 32


@dataclass
class DecodeJob:
    handoff: DecodeHandoff
    tokens: list[int]
    kv: torch.Tensor
    kv_len: int
    log_probs: list[float]
    persists: list[Any] = field(default_factory=list)
    persisted: list[PersistedBlock] = field(default_factory=list)
    verified_bytes: int = 0
    mismatches: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.handoff.task.request.prompt)


@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"control": 4, "io": 4}))
class DecodeEngine(EngineBase):
    role = "decode"

    def __init__(self, cfg: DualPathConfig, identity: EngineIdentity, store_root: str | None) -> None:
        super().__init__(cfg, identity, store_root)
        self.staging = BufferPool(PERSIST_STAGING_BLOCKS, self.layout)
        self.transport.register(self.staging.buffer)
        self.capacity = cfg.cluster.hbm_tokens_per_engine
        self.reserved: dict[str, int] = {}
        self.running: dict[str, DecodeJob] = {}

    def _load(self) -> EngineLoad:
        with self.lock:
            used = sum(self.reserved.values())
            return EngineLoad(self.id.engine_id, self.id.node_id, len(self.reserved), used, self.capacity - used)

    def _accept(self, reservations: list[DecodeReservation]) -> None:
        with self.lock:
            for r in reservations:
                if sum(self.reserved.values()) + r.tokens > self.capacity:
                    raise RuntimeError(f"{self.id.engine_id}: reservation of {r.tokens} tokens exceeds free HBM")
                self.reserved[r.request_id] = r.tokens

    # --- handoff: buffer -> HBM ---------------------------------------------------------

    @ray.method(concurrency_group="control")
    def cancel(self, request_id: str) -> None:
        """Drop the reservation of a request that failed before it reached this engine."""
        with self.lock:
            if request_id not in self.running:
                self.reserved.pop(request_id, None)

    @ray.method(concurrency_group="io")
    def handoff(self, handoff: DecodeHandoff) -> None:
        try:
            self._accept_handoff(handoff)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
            LOG.exception("%s: handoff of %s failed", self.id.engine_id, handoff.task.request.request_id)
            self._fail(handoff, exc)

    def _fail(self, handoff: DecodeHandoff, exc: BaseException) -> None:
        spec = handoff.task.request
        with self.lock:
            self.running.pop(spec.request_id, None)
            self.reserved.pop(spec.request_id, None)
        self.directory.get("scheduler").complete.remote(failed_result(spec, self.id.engine_id, exc))

    def _accept_handoff(self, handoff: DecodeHandoff) -> None:
        task = handoff.task
        spec = task.request
        prompt = [int(t) for t in spec.prompt]
        kv = torch.empty(
            (self.layout.n_layer, self.reserved[spec.request_id], self.layout.bytes_per_token_per_layer),
            dtype=torch.uint8,
        )
        if task.oracle:
            self._materialise(task, kv)
        else:
            self._pull_prompt_kv(handoff, kv)
        job = DecodeJob(handoff, prompt + [handoff.first_token], kv, len(prompt), [handoff.first_log_prob])
        if self.cfg.runtime.verify_kv:
            self._verify(job)
        hit_blocks = task.hit_tokens // self.layout.block_size
        for block in range(hit_blocks, len(prompt) // self.layout.block_size):
            self._persist(job, block)
        with self.lock:
            self.running[spec.request_id] = job

    def _pull_prompt_kv(self, handoff: DecodeHandoff, kv: torch.Tensor) -> None:
        task = handoff.task
        reader = self.directory.get(self.id.reader)
        n = len(task.request.prompt)
        for layer in range(self.layout.n_layer):
            ticket = ray.get(reader.offer.remote(handoff.extent_id, layer, 0, n, task.path))
            self.cnic_in.take(ticket.nbytes)
            self.counters.cnic_in[task.path] += self.transport.pull(
                ticket, split_by_blocks(kv[layer, :n], 0, self.layout.block_size)
            )
            ray.get(reader.release.remote(ticket))
        reader.free.remote(handoff.extent_id)

    def _materialise(self, task: Any, kv: torch.Tensor) -> None:
        """Oracle mode: hit KV straight from the store, miss KV computed here; no I/O modelled."""
        self._fill_from_store(task.hit_keys, kv)
        prompt = np.asarray(task.request.prompt, dtype=np.int64)
        hit, n = task.hit_tokens, len(prompt)
        state = self.compute.begin_chunk(prompt, hit, n)
        for layer in range(self.layout.n_layer):
            kv[layer, hit:n] = self.compute.layer(state, layer, kv[layer, :hit])

    def _fill_from_store(self, keys: tuple[str, ...], kv: torch.Tensor) -> None:
        block = self.layout.empty_full_block()
        size = self.layout.block_size
        for i, key in enumerate(keys):
            self.store.get_into(key, block)
            kv[:, i * size : (i + 1) * size] = block

    def _verify(self, job: DecodeJob) -> None:
        """Check every assembled prompt KV byte against the store (hits) and a recompute (miss)."""
        task = job.handoff.task
        n, hit = job.prompt_len, task.hit_tokens
        expected = torch.empty_like(job.kv[:, :n])
        self._materialise(task, expected)
        exact = torch.equal(job.kv[:, :hit], expected[:, :hit])
        # Miss tokens: byte-equal, or (a recompute in another batch shape) equal within float noise.
        close = torch.equal(job.kv[:, hit:n], expected[:, hit:n])
        if not close:
            got = self.layout.bytes_as_kv(job.kv[:, hit:n].reshape(-1, self.layout.bytes_per_token_per_layer))
            want = self.layout.bytes_as_kv(expected[:, hit:n].reshape(-1, self.layout.bytes_per_token_per_layer))
            close = torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5)
        job.verified_bytes = int(expected.numel())
        job.mismatches = int(not exact) + int(not close)

    # --- decode and persistence ---------------------------------------------------------

    def _persist(self, job: DecodeJob, block: int) -> None:
        size = self.layout.block_size
        spec = job.handoff.task.request
        keys = block_keys(job.tokens[: (block + 1) * size], size, spec.namespace)
        persisted = PersistedBlock(keys[block], keys[block - 1] if block else None)
        job.persisted.append(persisted)
        if job.handoff.task.oracle:
            self.store.put(persisted.key, job.kv[:, block * size : (block + 1) * size].contiguous(), parent=persisted.parent)
            return
        # D2H staging: the block is copied into a slot of this engine's registered staging pool,
        # so in-flight persists never offer overlapping views of the live KV tensor.
        owner = f"{spec.request_id}#{spec.attempt}"
        while (extent := self.staging.lease(owner, 1)) is None:
            self._settle_persist(job.persists.pop(0) if job.persists else self._oldest_persist())
        staged = self.staging.full_block(extent.slots[0])
        staged.copy_(job.kv[:, block * size : (block + 1) * size])
        ticket = self.transport.offer([staged])
        self.cnic_out.take(ticket.nbytes)
        self.counters.cnic_out[job.handoff.task.path] += ticket.nbytes
        ref = self.directory.get(self.id.reader).persist.remote(owner, persisted, ticket)
        job.persists.append((ticket, ref, extent.extent_id))

    def _oldest_persist(self) -> tuple[Any, Any, int]:
        with self.lock:
            for other in self.running.values():
                if other.persists:
                    return other.persists.pop(0)
        raise RuntimeError(f"{self.id.engine_id}: persist staging is full with nothing in flight")

    def _settle_persist(self, pending: tuple[Any, Any, int]) -> None:
        ticket, ref, extent_id = pending
        try:
            ray.get(ref)
        finally:
            self.transport.release(ticket)
            self.staging.release(extent_id)

    def _main_loop(self) -> None:
        try:
            while not self.stopped.is_set():
                with self.lock:
                    jobs = list(self.running.values())
                if not jobs:
                    self.stopped.wait(0.002)
                    continue
                self.compute.decode_pause(len(jobs), sum(job.kv_len for job in jobs))
                for job in jobs:
                    try:
                        self._step(job)
                    except Exception as exc:  # noqa: BLE001 - fail this request only
                        LOG.exception("%s: decode of %s failed", self.id.engine_id, job.handoff.task.request.request_id)
                        self._fail(job.handoff, exc)
        except BaseException as exc:  # noqa: BLE001 - reported by health()
            LOG.exception("%s: decode loop died", self.id.engine_id)
            self.error = exc

    def _done(self, job: DecodeJob) -> str | None:
        sampling = job.handoff.task.request.sampling
        generated = len(job.tokens) - job.prompt_len
        if generated and job.tokens[-1] in sampling.stop_token_ids:
            return "stop"
        if generated >= sampling.max_new_tokens:
            return "length"
        if len(job.tokens) >= self.cfg.model.max_context:
            return "context"
        return None

    def _step(self, job: DecodeJob) -> None:
        reason = self._done(job)
        if reason is not None:
            self._finish(job, reason)
            return
        n = job.kv_len
        past = [job.kv[layer, :n] for layer in range(self.layout.n_layer)]
        sampled, new_kv = self.compute.decode(np.asarray(job.tokens), past, job.handoff.task.request.sampling.rule())
        for layer, data in enumerate(new_kv):
            job.kv[layer, n : n + 1] = data
        job.kv_len = n + 1
        job.tokens.append(sampled.token)
        job.log_probs.append(sampled.log_prob)
        if job.kv_len % self.layout.block_size == 0:
            self._persist(job, job.kv_len // self.layout.block_size - 1)

    def _finish(self, job: DecodeJob, reason: str) -> None:
        while job.persists:
            self._settle_persist(job.persists.pop(0))
        task = job.handoff.task
        spec = task.request
        finished = time.time()
        output = tuple(job.tokens[job.prompt_len :])
        tpot = (finished - job.handoff.first_token_at) / (len(output) - 1) if len(output) > 1 else 0.0
        result = TurnResult(
            request_id=spec.request_id, attempt=spec.attempt, output_tokens=output,
            log_probs=tuple(job.log_probs), stop_reason=reason, prompt_tokens=job.prompt_len,
            hit_tokens=task.hit_tokens, path=task.path, prefill_engine=task.prefill_engine,
            decode_engine=self.id.engine_id, ttft_s=job.handoff.first_token_at - spec.submitted_at,
            tpot_s=tpot, kv_bytes_verified=job.verified_bytes, kv_mismatches=job.mismatches,
            persisted=tuple(job.persisted),
        )
        with self.lock:
            del self.running[spec.request_id]
            del self.reserved[spec.request_id]
        self.directory.get("scheduler").complete.remote(result)
