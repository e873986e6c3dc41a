"""The prefill engine's logic, without Ray: staging, compute-quota batches, layerwise prefill.

A request (a `PrefillTask` from the scheduler) goes READING_HITS -> READY -> BATCHED -> HANDED_OFF, or back
to READY after a chunk that does not end its prompt, or FAILED (`transition`, in runtime/prefill/job.py
with the job record, the ports and the settings). A task naming other weights than the engine holds is
refused at `accept` (runtime/engine/refusals.py).
- Staging: the reader of the chosen side leases an extent and reads the hit Full Blocks into it (PE
  path: this node's reader, plus an empty extent on the decode node for the KV to send; DE path: the
  decode node's reader, one extent for hits and computed KV alike).
- A batch: READY requests in FIFO order packed by the compute quota and the window's capacity
  (`pack_prefill_batch`), laid out in the layer window (kv/window.py).
- Layer by layer with double buffering (`LayerPipeline`, runtime/prefill/pipeline.py): layer l+1's
  past KV is on its way in while layer l computes, and layer l-1's KV on its way out; one read per
  (layer, source reader) and one write per (layer, destination reader) for the whole batch. The past
  KV of a first chunk comes from the side its hits were read on; a later chunk's from the decode
  node's extent, which by then holds every token before it. A chunk sends the decode node everything
  not yet there: hits + new tokens on the PE path's first chunk, only new tokens otherwise.
- Handoff: after the last layer the first token is sampled, the PE extent is freed, and the decode
  engine gets a `DecodeHandoff` naming the decode node's extent (one call per decode engine).
- A compute that runs its own engine loop (`EngineCompute.continuous_prefill`: vLLM's continuous
  batching) gets no batches: each step collects the chunks it finished (non-final ones back to
  READY, final ones handed off, failed ones failed alone) and admits READY jobs' chunks packed by
  the quota and the window's tokens less what it still computes (`_admit`), so its steps may mix
  chunks of several admissions. A job stays BATCHED until its chunk is collected, so a prompt's
  next chunk is admitted only once the previous one's KV is on the decode node.
Oracle mode moves nothing: hit KV comes straight from the store and nothing is sent.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.window import LayerWindow, span_offsets
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.compute.continuous_prefill import ContinuousPrefill
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec, EngineCompute
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.engine.failures import ReadFailed, failure_of, log_failure, read_done
from dualpath_ray.runtime.engine.refusals import Refusals
from dualpath_ray.runtime.engine.cancelled import CancelledAttempts
from dualpath_ray.protocol.messages import DecodeHandoff, ExtentGrant, Holding, PrefillTask, TurnResult, newest_holdings
from dualpath_ray.runtime.engine.outbox import Outbox
from dualpath_ray.runtime.engine.ports import Pending
from dualpath_ray.runtime.prefill.held_batch import count_moved, with_kv
from dualpath_ray.runtime.prefill.job import PrefillJob, PrefillPorts, PrefillSettings, PrefillState, transition
from dualpath_ray.runtime.prefill.kv_ready import KVReady, kv_ready_for
from dualpath_ray.runtime.prefill.pipeline import LayerPipeline, PipelineStats, oracle_kv_for
from dualpath_ray.scheduling import EngineLoad, pack_prefill_batch, prefill_tokens
from dualpath_ray.protocol.types import ReadPath

LOG = logging.getLogger("dualpath_ray.prefill")


@dataclass
class PrefillStats:
    """What the engine did, for its `stats()`: batches, chunks, and the pipeline's figures."""

    batches: int = 0  # batches run; with a compute running its own loop, admissions into it
    chunks: int = 0
    handoffs: int = 0
    failures: int = 0
    cancelled: int = 0  # attempts the scheduler cancelled, dropped before their compute
    tokens_computed: int = 0
    port_calls: int = 0
    pipeline: PipelineStats = field(default_factory=PipelineStats)


class PrefillCore:
    """Every decision and state change of one prefill engine; the actor only runs `step`."""

    def __init__(
        self, settings: PrefillSettings, layout: KVLayout, compute: EngineCompute, window: LayerWindow,
        predict_ms: Callable[[list[tuple[int, int]]], float],
        ports: PrefillPorts,
        store: BlockStore | None,
        links: tuple[Link, Link],
        kv_ready: Callable[[], KVReady] | None = None,
    ) -> None:
        self.settings = settings
        self.kv_ready = kv_ready or kv_ready_for(window.tensor.device)  # a layer's KV done before it is sent
        self.layout = layout
        self.compute = compute
        self.window = window
        self.predict_ms = predict_ms
        self.ports = ports
        self.store = store
        self.cnic_in, self.cnic_out = links
        self.counters = NodeCounters()
        self.stats = PrefillStats()
        self.jobs: dict[str, PrefillJob] = {}
        self._orphans: list[Pending[ExtentGrant]] = []
        self._cancelled = CancelledAttempts(settings.cancel_horizon_s, ports.clock)
        self._to_cancel: list[str] = []
        self.outbox = Outbox()  # handoffs and failure reports not yet delivered
        self._failed: list[TurnResult] = []  # this step's failures, reported at its end
        self.refusals = Refusals(settings.engine_id, ports.weights)  # tasks refused at accept
        self._noted: dict[str, Holding] = {}  # this step's handoffs, reported at its end
        self._lock = threading.Lock()
        # Chunks admitted into a compute that runs its own loop, by ticket, until collected (the
        # worker thread's alone: `step` admits and collects).
        self._in_flight: dict[str, tuple[PrefillJob, ChunkSpec]] = {}

    # --- what the actor's control thread calls ------------------------------------------

    def load(self) -> EngineLoad:
        with self._lock:
            tokens = sum(prefill_tokens(len(job.prompt), job.task.hit_tokens) for job in self.jobs.values())
            return EngineLoad(self.settings.engine_id, self.settings.node_id, len(self.jobs), tokens)

    def holds(self) -> dict[str, Holding]:
        """Each request on this engine: its newest attempt here (not handed off). An earlier
        attempt still finishing is not what the scheduler waits for. A handoff on its way to its
        decode engine (named handed off) or a failure report on its way to the scheduler is held
        too (runtime/engine/outbox.py)."""
        with self._lock:
            entries = [(job.request_id, Holding.of(job.task.request, False)) for job in self.jobs.values()]
        return newest_holdings(entries + self.outbox.holdings())

    def accept(self, tasks: Sequence[PrefillTask]) -> None:
        """Stage every task, keyed by owner (request id and attempt: a retry may land here while its
        earlier attempt still runs, and each frees only its own extents); a duplicate delivery, or
        a task naming other weights than this engine holds, is refused before anything is leased."""
        fresh, refused = [], []
        with self._lock:
            for t in tasks:
                (refused if t.request.owner in self.jobs or t.request.owner in self._cancelled else fresh).append(t)
        for task in (t for t in fresh if self.refusals.admits(t.request)):
            # Held (and named by heartbeats) once staged, not after the whole batch: that can take a while.
            job = self._stage(task)
            with self._lock:
                self.jobs[job.owner] = job
                if job.owner in self._cancelled:  # its cancel came while it was being staged
                    self._to_cancel.append(job.owner)
        if refused:
            LOG.warning("%s: refused deliveries of attempts already here or cancelled: %s",
                        self.settings.engine_id, [t.request.owner for t in refused])

    def cancel(self, owner: str) -> None:
        """The scheduler gave up on this attempt ("request#attempt"): a job of it that has not
        started computing is dropped at the next step; an accept still on its way is refused."""
        with self._lock:
            self._cancelled.add(owner)
            if owner in self.jobs:
                self._to_cancel.append(owner)

    def abort(self, owner: str) -> None:
        """The caller gave up on this attempt: like a cancel, a job not yet computing is dropped
        with its extents; one in the running batch hands off, and its decode engine, which got
        the abort too, drops the handoff and frees its extent."""
        self.cancel(owner)

    def busy(self) -> bool:
        with self._lock:
            return bool(self.jobs or self._orphans or len(self.outbox) or len(self.refusals))

    # --- what the actor's worker thread calls ---------------------------------------------

    def step(self) -> bool:
        """Advance staging and run at most one batch; False when there was nothing to do."""
        self._failed.extend(self.refusals.take())  # refused at accept: reported with this step's failures
        self._reap_orphans()
        self.outbox.settle()
        self._drop_cancelled()
        self._poll_staging()
        continuous = self.compute.continuous_prefill
        if continuous is not None:
            worked = self._collect(continuous)
            worked = self._admit(continuous) or worked
            self._send_report()
            return worked
        batch = self._next_batch()
        if batch:
            self._run_batch(batch)
        self._send_report()
        return bool(batch)

    def polling(self) -> bool:
        """Whether the worker must look again without being woken: never here. Staging replies wake it
        (runtime/engine/ray_ports.py RefPending); a batch's transfers are waited for inside the batch;
        a compute running its own loop wakes it when a chunk can be collected (`bind_wake`)."""
        return False

    def fail_all(self, error: BaseException) -> None:
        """The worker is dying: every request still here gets an error result."""
        with self._lock:
            jobs = [j for j in self.jobs.values() if j.state is not PrefillState.FAILED]
        for job in jobs:
            self._fail(job, error)
        self._send_report()

    # --- staging ------------------------------------------------------------------------

    def _stage(self, task: PrefillTask) -> PrefillJob:
        prompt = np.asarray(task.request.prompt, dtype=np.int64)
        job = PrefillJob(task, prompt, computed=task.hit_tokens)
        owner = task.request.owner
        blocks = self.layout.blocks_for(len(prompt))
        keys = list(task.hit_keys)
        readers = self.ports.readers
        pe_blocks = task.pe_blocks
        if task.oracle:
            job.oracle_kv = oracle_kv_for(self.layout, len(prompt), self._read_oracle_hits(keys))
        else:
            # The first pe_blocks hits (all on the PE path, none on the DE path) into this
            # node's buffer; the rest into the decode node's extent at their own block positions,
            # so that extent ends up holding the whole prompt (with task.staged, its reader hands
            # over the chain staged in tool time and reads only the rest).
            if pe_blocks:
                job.reads[ReadPath.PE] = readers.read_hits(self.settings.node_id, owner, keys[:pe_blocks], pe_blocks, ReadPath.PE)
            if keys[pe_blocks:]:
                job.reads[ReadPath.DE] = readers.read_hits(
                    task.decode_node, owner, keys[pe_blocks:], blocks, ReadPath.DE, pe_blocks, staged=task.staged)
            else:
                job.reads[ReadPath.DE] = readers.lease(task.decode_node, owner, blocks)
        self.stats.port_calls += len(job.reads)
        return job

    def _read_oracle_hits(self, keys: list[str]) -> torch.Tensor | None:
        """Oracle mode materialises hit KV from the store in place: no SNIC, buffer or transfer."""
        if not keys:
            return None
        assert self.store is not None, "oracle mode needs the engine's store handle"
        blocks = torch.empty((len(keys), *self.layout.full_block_shape), dtype=torch.uint8)
        self.store.get_many_into(keys, list(blocks))
        return blocks

    def _reap_orphans(self) -> None:
        """Free the extents of failed requests' staging calls as their replies arrive. A lease
        may wait for free blocks longer than any bound here, and one granted after its request
        failed has no other owner: never waiting for it here is what keeps it from leaking."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        waiting = []
        for pending in orphans:
            try:
                if not pending.done():
                    waiting.append(pending)
                    continue
                grant = pending.wait(0)
            except Exception:  # noqa: BLE001 - that side never leased anything
                continue
            self.ports.readers.free(grant)
        with self._lock:
            self._orphans.extend(waiting)

    def _drop_cancelled(self) -> None:
        """Cancelled jobs still staging or ready free their extents without a result (the
        scheduler already failed the attempt); one in a batch finishes, and its decode engine
        drops the handoff."""
        with self._lock:
            owners, self._to_cancel = self._to_cancel, []
            jobs = [self.jobs[o] for o in owners if o in self.jobs]
        for job in jobs:
            if job.state in (PrefillState.READING_HITS, PrefillState.READY):
                self.stats.cancelled += 1
                self._fail(job, RuntimeError("cancelled by the scheduler"), report=False)

    def orphans(self) -> int:
        with self._lock:
            return len(self._orphans)

    def _poll_staging(self) -> None:
        with self._lock:
            staging = [j for j in self.jobs.values() if j.state is PrefillState.READING_HITS]
        for job in staging:
            try:
                nodes = {ReadPath.PE: self.settings.node_id, ReadPath.DE: job.task.decode_node}  # each side's reader
                if not all(read_done(pending, nodes[side]) for side, pending in job.reads.items()):
                    continue
            except ReadFailed as failed:  # a failed read fails this request only
                self._fail(job, failed)
                continue
            if ReadPath.PE in job.reads:
                job.pe = job.reads[ReadPath.PE].wait(0)
            if ReadPath.DE in job.reads:  # an oracle job reads nothing
                job.de = job.reads[ReadPath.DE].wait(0)
            job.reads = {}
            job.digests = self._first_digests(job)
            transition(job, PrefillState.READY)

    def _first_digests(self, job: PrefillJob) -> np.ndarray | None:
        if not self.settings.kv_digests or job.task.oracle:
            return None
        if job.task.hit_tokens == 0:
            return np.zeros((self.layout.n_layer, 0), dtype=np.int64)
        parts = [grant.digests for grant in (job.pe, job.de) if grant is not None and grant.digests is not None]
        if job.task.path != ReadPath.SPLIT:
            source = job.pe if job.task.path == ReadPath.PE else job.de
            return source.digests if source is not None else None
        return np.concatenate(parts, axis=1) if len(parts) == 2 else None

    # --- batches ------------------------------------------------------------------------

    def _next_batch(self) -> list[tuple[PrefillJob, int, int]]:
        with self._lock:
            ready = [j for j in self.jobs.values() if j.state is PrefillState.READY]
        if not ready:
            return []
        queue = [(j.owner, j.computed, len(j.prompt) - j.computed) for j in ready]
        by_id = {j.owner: j for j in ready}
        packed = pack_prefill_batch(queue, self.predict_ms, self.settings.quota_ms, self.window.capacity_tokens)
        batch = [(by_id[rid], cached, bsz) for rid, cached, bsz in packed]
        for job, _, _ in batch:
            transition(job, PrefillState.BATCHED)
        return batch

    def _admit(self, continuous: ContinuousPrefill) -> bool:
        """READY jobs' chunks into the compute's loop: packed by the quota and the window's tokens
        counting the chunks still in it (`pack_prefill_batch`'s `running`), so a demanding user's
        quota and the pages' bound hold over what computes at once."""
        with self._lock:
            ready = [j for j in self.jobs.values() if j.state is PrefillState.READY]
        if not ready or not continuous.admitting():
            return False
        running = [(chunk.start, chunk.new_tokens) for _, chunk in self._in_flight.values()]
        queue = [(j.owner, j.computed, len(j.prompt) - j.computed) for j in ready]
        by_id = {j.owner: j for j in ready}
        packed = pack_prefill_batch(queue, self.predict_ms, self.settings.quota_ms, self.window.capacity_tokens, running)
        if not packed:
            return False
        jobs = [by_id[rid] for rid, _, _ in packed]
        # Offset 0: no window slot holds these chunks (their KV lives in the compute's pages).
        chunks = [
            with_kv(job, ChunkSpec(job.prompt, cached, cached + bsz, 0, job.task.request.sampling, job.task.request.namespace),
                    self.layout.full_block_bytes)
            for job, (_, cached, bsz) in zip(jobs, packed)
        ]
        for job in jobs:
            transition(job, PrefillState.BATCHED)
        try:
            tickets = continuous.admit(chunks)
        except Exception as exc:  # noqa: BLE001 - these chunks fail, the ones in flight carry on
            log_failure(LOG, f"{self.settings.engine_id}: admitting {len(jobs)} chunks", exc)
            for job in jobs:
                self._fail(job, exc)
            return True
        self.stats.batches += 1
        self._in_flight.update(zip(tickets, zip(jobs, chunks)))
        return True

    def _collect(self, continuous: ContinuousPrefill) -> bool:
        """The chunks the compute finished: a failed one fails its job alone; a non-final one's
        job goes back to READY for its next chunk; final ones are handed off together."""
        collected = continuous.collect()
        count_moved(continuous.take_moved(), self.stats.pipeline, self.counters)
        finished: list[tuple[PrefillJob, int, float]] = []
        for done in collected:
            job, chunk = self._in_flight.pop(done.ticket)
            if job.state is PrefillState.FAILED:  # failed while in flight (`fail_all`): reported already
                continue
            if done.error is not None:
                log_failure(LOG, f"{self.settings.engine_id}: chunk of {job.request_id}", done.error)
                self._fail(job, done.error)
                continue
            self.stats.chunks += 1
            self.stats.tokens_computed += chunk.new_tokens
            job.computed = chunk.end
            job.chunks += 1
            job.digests = done.digests
            if chunk.end < len(job.prompt):
                transition(job, PrefillState.READY)
            else:
                finished.append((job, done.token, done.log_prob))
        self._hand_off(finished)
        return bool(collected)

    def _run_batch(self, batch: list[tuple[PrefillJob, int, int]]) -> None:
        offsets = span_offsets([cached + bsz for _, cached, bsz in batch])
        chunks = [
            ChunkSpec(job.prompt, cached, cached + bsz, off, job.task.request.sampling, job.task.request.namespace)
            for (job, cached, bsz), off in zip(batch, offsets)
        ]
        jobs = [job for job, _, _ in batch]
        held = self.compute.prefill_kv  # the compute moves the KV between the extents and its pages
        if held is not None:
            chunks = [with_kv(job, chunk, self.layout.full_block_bytes) for job, chunk in zip(jobs, chunks)]
        pipeline = LayerPipeline(
            self.layout, self.window, self.ports.transport, self.settings.transfer_timeout_s,
            self.stats.pipeline, self.counters, (self.cnic_in, self.cnic_out), self.settings.kv_digests, self.kv_ready,
        )
        state = None
        try:
            state = self.compute.begin_prefill(chunks)
            if held is None:
                pipeline.run(jobs, chunks, lambda layer: self.compute.prefill_layer(state, layer, self.window.slot(layer)))
            finished = [i for i, c in enumerate(chunks) if c.end == len(c.prompt)]
            # A batch of only non-final chunks (a long prompt's first chunks) samples nothing; the
            # backends' sample_last index rows by `finished`, and an empty index is no index.
            params = [jobs[i].task.request.sampling for i in finished]
            sampled = self.compute.sample_last(state, finished, params) if finished else []
            digests = pipeline.digests  # each request's KV as it left, per layer and token
            if held is not None:
                moved = held.moved(state)
                count_moved(moved, self.stats.pipeline, self.counters)
                digests = {job.owner: d for job, d in zip(jobs, moved.digests) if d is not None}
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the others
            log_failure(LOG, f"{self.settings.engine_id}: batch of {len(jobs)}", exc)
            if state is not None:
                self.compute.abandon_prefill(state)
            pipeline.drain()
            self.window.reset()
            for job in jobs:
                self._fail(job, exc)
            return
        self.stats.batches += 1
        self.stats.chunks += len(jobs)
        self.stats.tokens_computed += sum(c.new_tokens for c in chunks)
        for job, chunk in zip(jobs, chunks):
            job.computed = chunk.end
            job.chunks += 1
            job.digests = digests.get(job.owner)
            if chunk.end < len(job.prompt):
                transition(job, PrefillState.READY)
        self._hand_off([(jobs[index], token.token, token.log_prob) for index, token in zip(finished, sampled)])

    def _hand_off(self, done: list[tuple[PrefillJob, int, float]]) -> None:
        """Give the finished requests of a batch to their decode engines: one call per decode
        engine for all of the batch's that go there. Each stays named by this engine's heartbeat
        (the outbox) until its call is delivered."""
        now = self.ports.clock.now()
        by_engine: dict[str, list[tuple[PrefillJob, DecodeHandoff]]] = {}
        for job, token, log_prob in done:
            if job.pe is not None:
                self.ports.readers.free(job.pe)
                job.pe = None
            handoff = DecodeHandoff(job.task, job.de, token, log_prob, now, job.digests)
            by_engine.setdefault(job.task.decode_engine, []).append((job, handoff))
        for engine, pairs in by_engine.items():
            try:
                delivery = self.ports.decode.hand_off(engine, [handoff for _, handoff in pairs])
            except Exception as exc:  # noqa: BLE001 - e.g. the decode engine is gone: these requests fail, not the engine
                for job, _ in pairs:
                    self._fail(job, exc)
                continue
            self.stats.port_calls += 1
            for job, _ in pairs:
                self.stats.handoffs += 1
                transition(job, PrefillState.HANDED_OFF)
                with self._lock:
                    del self.jobs[job.owner]
                # On its way to its decode engine: named as handed off, no longer the prefill
                # engine's to cancel (the decode engine holds it once the call lands), and so
                # reported in this step's report: the scheduler takes its load off this engine
                # as the engine itself just did. A handoff lost on the way leaves the attempt
                # held by no one once the outbox gives up on it: the heartbeat fails it then.
                holding = Holding.of(job.task.request, True)
                self._noted[job.request_id] = holding
                self.outbox.sent(job.owner, job.request_id, holding, delivery)

    def _fail(self, job: PrefillJob, error: BaseException, report: bool = True) -> None:
        """Free what the request holds, report the error (unless cancelled), forget it."""
        with self._lock:
            self._orphans.extend(job.reads.values())
        job.reads = {}
        self._reap_orphans()
        for grant in (job.pe, job.de):
            if grant is not None:
                self.ports.readers.free(grant)
        job.pe = job.de = None
        if not job.task.oracle:
            # A staging call whose reply was lost leased an extent no grant names: the readers
            # free whatever this attempt still holds (nothing else of it is live any more).
            for node in {self.settings.node_id, job.task.decode_node}:
                self.ports.readers.reclaim(node, job.owner)
        transition(job, PrefillState.FAILED)
        with self._lock:
            self.jobs.pop(job.owner, None)
        if report:
            self.stats.failures += 1
            self._failed.append(failure_of(job.task.request, self.settings.engine_id, error))

    def _send_report(self) -> None:
        """One step's news in one call: the handoffs it sent, and its failures (each named by
        this engine's heartbeat, the outbox, until the call is delivered)."""
        noted, failed = self._noted, self._failed
        if not (noted or failed):
            return
        self._noted, self._failed = {}, []
        call = self.ports.scheduler.report(noted, failed, ())
        for result in failed:
            self.outbox.sent(result.owner, result.request_id, Holding.of(result, False), call)
