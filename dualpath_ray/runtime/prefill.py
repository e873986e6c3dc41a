"""PrefillEngine (`prefill/<node>/<gpu>`): compute-quota batching and layerwise prefill.

Per layer of each request in a batch: bring in the layer's hit KV (PE path: from this node's
buffer; DE path: pulled from the decode node's buffer), compute the chunk, and send the layer's
KV to the decode node's buffer: everything not yet there (PE path: hit + new tokens; DE path:
only the newly computed miss tokens, which the decode-side reader merges behind the hits).
In oracle mode nothing is read or moved: the hit KV is materialised from the store directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import split_by_blocks
from dualpath_ray.model.cost import attention_predictor
from dualpath_ray.runtime.emulation import PrefillState
from dualpath_ray.runtime.engine import EngineBase, EngineIdentity
from dualpath_ray.runtime.messages import DecodeHandoff, PrefillTask, failed_result
from dualpath_ray.runtime.transport import endpoint_actor_options
from dualpath_ray.scheduling import EngineLoad, pack_prefill_batch


LOG = logging.getLogger("dualpath_ray.prefill")


@dataclass
class PrefillJob:
    """One request on this engine, from assignment to handoff."""

    task: PrefillTask
    prompt: np.ndarray
    staging: dict[str, Any]
    computed: int = 0
    pe_extent: int | None = None
    de_extent: int | None = None
    hbm: torch.Tensor | None = None
    hits_loaded: bool = False

    @property
    def request_id(self) -> str:
        return self.task.request.request_id


@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"control": 4}))
class PrefillEngine(EngineBase):
    role = "prefill"

    def __init__(self, cfg: DualPathConfig, identity: EngineIdentity, store_root: str | None) -> None:
        super().__init__(cfg, identity, store_root)
        self.predict_ms = attention_predictor(cfg)
        self.jobs: list[PrefillJob] = []

    # --- work ---------------------------------------------------------------------------

    def _load(self) -> EngineLoad:
        with self.lock:
            tokens = sum(len(job.prompt) for job in self.jobs)
            return EngineLoad(self.id.engine_id, self.id.node_id, len(self.jobs), tokens)

    def _accept(self, tasks: list[PrefillTask]) -> None:
        jobs = [self._stage(task) for task in tasks]
        with self.lock:
            self.jobs.extend(jobs)

    def _stage(self, task: PrefillTask) -> PrefillJob:
        """Start the reads a request needs; it is ready to compute when they finish."""
        prompt = np.asarray(task.request.prompt, dtype=np.int64)
        owner = f"{task.request.request_id}#{task.request.attempt}"
        blocks = self.layout.blocks_for(len(prompt))
        keys = list(task.hit_keys)
        staging: dict[str, Any] = {}
        if not task.oracle:
            de_reader = self.directory.get(f"reader/{task.decode_node}")
            if task.path == "pe":
                if keys:
                    staging["pe"] = self.directory.get(self.id.reader).read_blocks.remote(owner, keys, len(keys), "pe")
                staging["de"] = de_reader.lease.remote(owner, blocks)
            else:
                staging["de"] = de_reader.read_blocks.remote(owner, keys, blocks, "de")
        return PrefillJob(task=task, prompt=prompt, staging=staging)

    def _ready_jobs(self) -> list[PrefillJob]:
        with self.lock:
            jobs = list(self.jobs)
        ready = []
        for job in jobs:
            if job.staging:
                refs = list(job.staging.values())
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                if len(done) < len(refs):
                    continue
                try:
                    extents = dict(zip(job.staging, ray.get(refs)))
                except Exception as exc:  # noqa: BLE001 - a failed read fails this request only
                    self._fail_staging(job, exc)
                    continue
                job.pe_extent, job.de_extent = extents.get("pe"), extents.get("de")
                job.staging = {}
            if job.hbm is None:
                job.hbm = torch.empty((self.layout.n_layer, len(job.prompt), self.layout.bytes_per_token_per_layer), dtype=torch.uint8)
                job.computed = job.task.hit_tokens
            ready.append(job)
        return ready

    def _main_loop(self) -> None:
        try:
            while not self.stopped.is_set():
                ready = self._ready_jobs()
                if not ready:
                    self.stopped.wait(0.002)
                    continue
                queue = [(job.request_id, job.computed, len(job.prompt) - job.computed) for job in ready]
                batch = pack_prefill_batch(queue, self.predict_ms, self.cfg.scheduler.compute_quota_ms)
                by_id = {job.request_id: job for job in ready}
                jobs = [(by_id[rid], cached, bsz) for rid, cached, bsz in batch]
                try:
                    self._run_batch(jobs)
                except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving others
                    LOG.exception("%s: batch failed", self.id.engine_id)
                    self._fail([job for job, _, _ in jobs], exc)
        except BaseException as exc:  # noqa: BLE001 - reported by health()
            LOG.exception("%s: worker loop died", self.id.engine_id)
            self.error = exc
            with self.lock:
                pending = list(self.jobs)
            self._fail(pending, exc)

    def _fail(self, jobs: list[PrefillJob], exc: BaseException) -> None:
        scheduler = self.directory.get("scheduler")
        for job in jobs:
            scheduler.complete.remote(failed_result(job.task.request, self.id.engine_id, exc))
            self._release_extents(job)
            with self.lock:
                if job in self.jobs:
                    self.jobs.remove(job)

    def _fail_staging(self, job: PrefillJob, exc: Exception) -> None:
        """Free whichever staging extents did get leased, then fail the request."""
        for side, ref in job.staging.items():
            try:
                extent = ray.get(ref)
            except Exception:  # noqa: BLE001 - that side never leased anything
                continue
            if side == "pe":
                job.pe_extent = extent
            else:
                job.de_extent = extent
        job.staging = {}
        self._fail([job], exc)

    def _release_extents(self, job: PrefillJob) -> None:
        if job.pe_extent is not None:
            self.directory.get(self.id.reader).free.remote(job.pe_extent)
        if job.de_extent is not None:
            self.directory.get(f"reader/{job.task.decode_node}").free.remote(job.de_extent)

    def _run_batch(self, batch: list[tuple[PrefillJob, int, int]]) -> None:
        states = [self.compute.begin_chunk(job.prompt, cached, cached + bsz) for job, cached, bsz in batch]
        pairs = [(cached, bsz) for _, cached, bsz in batch]
        for layer in range(self.layout.n_layer):
            self.compute.batch_pause(pairs)
            for (job, cached, bsz), state in zip(batch, states):
                self._prefill_layer(job, state, layer, cached, bsz)
        for (job, cached, bsz), state in zip(batch, states):
            job.hits_loaded = True
            job.computed = cached + bsz
            if job.computed == len(job.prompt):
                self._hand_off(job, state)

    def _prefill_layer(self, job: PrefillJob, state: PrefillState, layer: int, cached: int, bsz: int) -> None:
        hbm = job.hbm
        assert hbm is not None
        hit = job.task.hit_tokens
        if not job.hits_loaded and hit:
            self._load_hits(job, layer)
        hbm[layer, cached : cached + bsz] = self.compute.layer(state, layer, hbm[layer, :cached])
        if job.task.oracle:
            return
        first = 0 if (job.task.path == "pe" and not job.hits_loaded) else cached
        self._send(job, layer, first, cached + bsz)

    def _load_hits(self, job: PrefillJob, layer: int) -> None:
        hit = job.task.hit_tokens
        target = job.hbm[layer, :hit]  # type: ignore[index]
        if job.task.oracle:
            block = self.layout.empty_full_block()
            for i, key in enumerate(job.task.hit_keys):
                self.store.get_into(key, block)
                target[i * self.layout.block_size : (i + 1) * self.layout.block_size] = block[layer]
            return
        path = job.task.path
        if path == "pe":
            reader, extent = self.directory.get(self.id.reader), job.pe_extent
        else:
            reader, extent = self.directory.get(f"reader/{job.task.decode_node}"), job.de_extent
        ticket = ray.get(reader.offer.remote(extent, layer, 0, hit, path))
        self.cnic_in.take(ticket.nbytes)
        moved = self.transport.pull(ticket, split_by_blocks(target, 0, self.layout.block_size))
        ray.get(reader.release.remote(ticket))
        self.counters.cnic_in[path] += moved

    def _send(self, job: PrefillJob, layer: int, first: int, end: int) -> None:
        """Send KV of tokens [first, end) of one layer into the decode node's buffer extent."""
        pieces = split_by_blocks(job.hbm[layer, first:end], first, self.layout.block_size)  # type: ignore[index]
        ticket = self.transport.offer(pieces)
        self.cnic_out.take(ticket.nbytes)
        reader = self.directory.get(f"reader/{job.task.decode_node}")
        try:
            ray.get(reader.receive.remote(job.de_extent, layer, first, ticket, job.task.path))
        finally:
            self.transport.release(ticket)
        self.counters.cnic_out[job.task.path] += ticket.nbytes

    def _hand_off(self, job: PrefillJob, state: PrefillState) -> None:
        sampled = self.compute.first_token(state, job.task.request.sampling.rule())
        if job.pe_extent is not None:
            self.directory.get(self.id.reader).free.remote(job.pe_extent)
        handoff = DecodeHandoff(job.task, job.de_extent, sampled.token, sampled.log_prob, time.time())
        self.directory.get(job.task.decode_engine).handoff.remote(handoff)
        with self.lock:
            self.jobs.remove(job)
