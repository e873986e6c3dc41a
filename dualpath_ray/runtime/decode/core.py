"""The decode engine's logic, without Ray: reservations, H2D, batched decode, persistence.

A request's life here (runtime/decode/job.py, one transition function): RESERVED (its handoff
arrived and its pages are reserved) -> LOADING (its prompt's KV moves from the decode node's
buffer extent into its pages: one read of whole Full Blocks) -> RUNNING (decoded in one batched step with every other running request) -> FINISHING
-> DONE; or FAILED from any of them. Oracle mode skips LOADING: the prompt's KV is materialised
in the pages directly (hits from the store, the rest computed here). Taking handoffs and
loading their KV is runtime/decode/intake.py's (a mixin of this class). What a step produced for
the scheduler (turns ended, streamed tokens) leaves in one report at its end.

Persistence has one owner per block: the request that filled it. Prompt blocks that were not hits
are written by the node's reader straight from the extent (they are already in the buffer), which
is freed after; a block that fills up while decoding is pulled from its page by the reader (D2H)
and written. At most `max_persists_in_flight` blocks are on their way at once; more wait in the
request's queue (back-pressure, never a failure), and a turn is reported only after every one of
its blocks is published, so the next turn never misses a block this one produced. Keys extend
the chain block by block (`next_block_key`), O(n) per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Sequence

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.index import next_block_key
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.engine.cancelled import CancelledAttempts
from dualpath_ray.runtime.engine.compute import DecodeSeq, EngineCompute, PageFill
from dualpath_ray.runtime.decode.job import (
    DecodeJob,
    DecodePorts,
    DecodeSettings,
    DecodeState,
    DecodeStats,
    transition,
)
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.decode.intake import BUFFER_POOL, HBM_POOL, DecodeIntake
from dualpath_ray.runtime.engine.failures import failure_of, log_failure
from dualpath_ray.protocol.messages import (
    DecodeHandoff,
    Holding,
    PersistedBlock,
    TokenChunk,
    TurnResult,
    newest_holdings,
)
from dualpath_ray.runtime.engine.outbox import Outbox
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.types import ReadPath, StopReason

LOG = logging.getLogger("dualpath_ray.decode")
__all__ = ["BUFFER_POOL", "HBM_POOL", "DecodeCore"]


class DecodeCore(DecodeIntake):
    """Every decision and state change of one decode engine; the actor only runs `step`."""

    def __init__(
        self,
        settings: DecodeSettings,
        layout: KVLayout,
        compute: EngineCompute,
        pages: PagedKVPool,
        ports: DecodePorts,
        store: BlockStore | None,
        links: tuple[Link, Link],
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.compute = compute
        self.pages = pages
        self.ports = ports
        self.store = store
        self.cnic_in, self.cnic_out = links
        self.counters = NodeCounters()
        self.stats = DecodeStats()
        self.jobs: dict[str, DecodeJob] = {}
        self._arrived: deque[DecodeHandoff] = deque()
        self._taking: dict[str, tuple[str, Holding]] = {}  # owner -> what holds() names while it is claimed
        self._waiting_since: dict[str, float] = {}  # owner -> since when its handoff waits for pages
        self._filling: list[tuple[DecodeJob, PageFill]] = []  # oracle handoffs of this step, to compute at once
        self._cancelled = CancelledAttempts(settings.cancel_horizon_s, ports.clock)
        self._aborting: set[str] = set()
        # This step's report (sent at its end, when not empty): turns ended, tokens sampled by
        # streamed requests.
        self._results: list[TurnResult] = []
        self._streamed: list[TokenChunk] = []
        self.outbox = Outbox()  # results not yet delivered to the scheduler
        self._lock = threading.Lock()
        self._in_flight = 0

    # --- what the actor's control and io threads call -----------------------------------

    def load(self) -> EngineLoad:
        with self._lock:
            tokens = sum(job.reserved_tokens for job in self.jobs.values())
            free = self.pages.unreserved_pages * self.layout.block_size
            return EngineLoad(self.settings.engine_id, self.settings.node_id, len(self.jobs), tokens, free)

    def cancel(self, owner: str) -> None:
        """The scheduler gave up on an attempt ("request#attempt") before its decode started: a
        handoff of it that arrives (or waits here) is dropped and its extent freed. One already
        taken finishes on its own (the scheduler ignores its result)."""
        with self._lock:
            if owner not in self.jobs:
                self._cancelled.add(owner)

    def abort(self, owner: str) -> None:
        """The caller gave up on this attempt: drop it whatever its state. Nothing more of it is
        decoded or persisted (blocks already on their way finish), its pages and extent are
        freed, and it reports nothing (the scheduler answered its caller already). Remembered,
        so a handoff still on its way (or waiting for pages) is dropped."""
        with self._lock:
            self._cancelled.add(owner)
            if owner in self.jobs:
                self._aborting.add(owner)

    def _drop_aborted(self) -> bool:
        with self._lock:
            owners, self._aborting = self._aborting, set()
            jobs = [self.jobs[o] for o in owners if o in self.jobs]
        for job in jobs:
            self.stats.aborted += 1
            self._fail(job, RuntimeError("aborted by its caller"), report=False)
        return bool(jobs)

    def holds(self) -> dict[str, Holding]:
        """Each request this engine holds an attempt of: its newest attempt here, handed off (a
        decode engine holds only what was handed to it). A handoff waiting for pages or being
        taken, and a result on its way to the scheduler (runtime/engine/outbox.py), count as held."""
        with self._lock:
            entries = [(job.request_id, Holding(job.attempt, True, job.epoch)) for job in self.jobs.values()]
            entries += [(h.task.request_id, Holding.of(h.task.request, True))
                        for h in self._arrived if h.task.request.owner not in self.jobs]
            entries += [entry for owner, entry in self._taking.items() if owner not in self.jobs]
        entries += self.outbox.holdings()
        return newest_holdings(entries)

    def hand_off(self, handoffs: Sequence[DecodeHandoff]) -> None:
        with self._lock:
            self._arrived.extend(handoffs)

    def polling(self) -> bool:
        """Whether the worker must look again without being woken: a prompt load is a transport
        transfer (polled, it signals nothing), and a handoff waiting for pages has a deadline.
        Everything else that finishes wakes the worker (runtime/engine/ray_ports.py RefPending)."""
        with self._lock:
            return bool(self._arrived) or any(job.state is DecodeState.LOADING for job in self.jobs.values())

    def busy(self) -> bool:
        with self._lock:
            return bool(self.jobs) or bool(self._arrived) or bool(len(self.outbox))

    # --- the worker thread ----------------------------------------------------------------

    def step(self) -> bool:
        """One round: take handoffs, finish loads, one decode step, persists, finished turns."""
        self.outbox.settle()
        did = self._drop_aborted()
        did |= self._take_handoffs()
        did |= self._poll_loads()
        did |= self._decode_once()
        did |= self._advance_persists()
        did |= self._finish_ready()
        self._send_report()
        return did

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs = [j for j in self.jobs.values() if j.handoff is not None]
        for job in jobs:
            self._fail(job, error)
        self._send_report()

    def _persist_prompt(self, job: DecodeJob) -> None:
        """Prompt blocks that were not hits: written from the extent, which is then freed."""
        assert job.handoff is not None
        task = job.handoff.task
        size = self.layout.block_size
        first = task.hit_tokens // size
        blocks = []
        for block in range(first, job.prompt_len // size):
            blocks.append((block, self._next_key(job, block)))
        if task.oracle:
            for block, persisted in blocks:
                self._oracle_write(job, block, persisted)
            return
        extent = job.handoff.extent
        assert extent is not None
        if not blocks:
            self.ports.readers.free(extent)
            return
        # Not counted against max_persists_in_flight: these blocks already sit in a leased extent
        # and need no staging slot; the budget bounds the D2H staging of filled pages.
        job.extent_persist = self.ports.readers.persist_extent(extent, blocks)
        job.extent_blocks = tuple(p for _, p in blocks)

    def _next_key(self, job: DecodeJob, block: int) -> PersistedBlock:
        assert job.handoff is not None
        size = self.layout.block_size
        key = next_block_key(job.parent_key, job.tokens[block * size : (block + 1) * size], job.handoff.task.request.namespace)
        persisted = PersistedBlock(key, job.parent_key)
        job.parent_key = key
        return persisted

    def _oracle_write(self, job: DecodeJob, block: int, persisted: PersistedBlock) -> None:
        assert self.store is not None
        page = self.pages.page(self.pages.table(job.owner)[block])
        self.store.put(persisted.key, page.cpu() if page.device.type != "cpu" else page, parent=persisted.parent)
        job.persisted.append(persisted)

    # --- decode -------------------------------------------------------------------------

    def _decode_once(self) -> bool:
        running = self._jobs_in(DecodeState.RUNNING)
        for job in running:
            job.stop_reason = self._stop_reason(job)
            if job.stop_reason is not None:
                transition(job, DecodeState.FINISHING)
        batch = [job for job in running if job.state is DecodeState.RUNNING]
        if not batch:
            return bool(running)
        try:
            seqs = [
                DecodeSeq(job.tokens[-1], job.kv_len, self.pages.ensure(job.owner, job.kv_len + 1), job.compute_state)
                for job in batch
            ]
            params = [job.handoff.task.request.sampling for job in batch]  # type: ignore[union-attr]
            started = time.perf_counter()
            sampled = self.compute.decode_step(seqs, self.pages.tensor, params)
            self.stats.compute_s += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log_failure(LOG, f"{self.settings.engine_id}: decode step of {len(batch)}", exc)
            for job in batch:
                self._fail(job, exc)
            return True
        self.stats.steps += 1
        self.stats.tokens += len(batch)
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        size = self.layout.block_size
        for job, token in zip(batch, sampled):
            job.kv_len += 1
            job.tokens.append(token.token)
            job.log_probs.append(token.log_prob)
            self._stream(job, len(job.tokens) - job.prompt_len - 1)
            if job.kv_len % size == 0:
                block = job.kv_len // size - 1
                persisted = self._next_key(job, block)
                if job.handoff.task.oracle:  # type: ignore[union-attr]
                    self._oracle_write(job, block, persisted)
                else:
                    job.queued.append((self.pages.table(job.owner)[block], persisted))
        return True

    def _stream(self, job: DecodeJob, start: int) -> None:
        """Queue the output tokens of a streamed request from position `start` on."""
        spec = job.handoff.task.request  # type: ignore[union-attr]
        if spec.stream:
            tokens = tuple(job.tokens[job.prompt_len + start :])
            self._streamed.append(TokenChunk(spec.request_id, spec.attempt, spec.epoch, start, tokens,
                                             tuple(job.log_probs[start:])))

    def _send_report(self) -> None:
        """One call per step carries what the scheduler must know of it: the turns that ended
        (each held by the outbox until the call is delivered) and the tokens streamed requests
        sampled."""
        results, chunks = self._results, self._streamed
        if not (results or chunks):
            return
        self._results, self._streamed = [], []
        call = self.ports.scheduler.report({}, results, chunks)
        for result in results:
            self.outbox.sent(result.owner, result.request_id, Holding.of(result, True), call)

    def _stop_reason(self, job: DecodeJob) -> StopReason | None:
        sampling = job.handoff.task.request.sampling  # type: ignore[union-attr]
        generated = len(job.tokens) - job.prompt_len
        if generated and job.tokens[-1] in sampling.stop_token_ids:
            return StopReason.STOP
        if generated >= sampling.max_new_tokens:
            return StopReason.LENGTH
        if len(job.tokens) >= self.settings.max_context:
            return StopReason.CONTEXT
        return None

    # --- persistence --------------------------------------------------------------------

    def _advance_persists(self) -> bool:
        did = False
        for job in self._jobs_in(DecodeState.RUNNING, DecodeState.FINISHING):
            did |= self._settle(job)
        for job in self._jobs_in(DecodeState.RUNNING, DecodeState.FINISHING):
            if not job.queued:
                continue
            room = self.settings.max_persists_in_flight - self._in_flight
            if room <= 0:
                self.stats.persist_waits += 1
                break
            blocks = [job.queued.popleft() for _ in range(min(room, len(job.queued)))]
            nbytes = len(blocks) * self.layout.full_block_bytes
            self.cnic_out.take(nbytes)
            self.counters.cnic_out[ReadPath(job.handoff.task.path).side.value] += nbytes  # type: ignore[union-attr]
            pending = self.ports.readers.persist_pages(self.settings.node_id, job.owner, blocks)
            job.persists.append((pending, tuple(p for _, p in blocks)))
            self._in_flight += len(blocks)
            self.stats.max_persists_in_flight = max(self.stats.max_persists_in_flight, self._in_flight)
            did = True
        return did

    def _settle(self, job: DecodeJob) -> bool:
        """Collect the job's finished persists; a failed one fails the request."""
        still, settled, error = [], False, None
        if job.extent_persist is not None:
            try:
                if job.extent_persist.done():
                    job.extent_persist.wait(0)
                    job.persisted[:0] = job.extent_blocks
                    self.stats.persisted_blocks += len(job.extent_blocks)
                    job.extent_persist, settled = None, True
            except Exception as exc:  # noqa: BLE001 - the turn cannot be reported without its blocks
                job.extent_persist, error = None, exc
        for pending, blocks in job.persists:
            try:
                done = pending.done()
                if done:
                    pending.wait(0)
            except Exception as exc:  # noqa: BLE001 - the turn cannot be reported without its blocks
                self._in_flight -= len(blocks)
                error = exc
                continue
            if done:
                self._in_flight -= len(blocks)
                job.persisted.extend(blocks)
                self.stats.persisted_blocks += len(blocks)
                settled = True
            else:
                still.append((pending, blocks))
        job.persists = still
        if error is not None:
            self._fail(job, error)
            return True
        return settled

    def _finish_ready(self) -> bool:
        did = False
        for job in self._jobs_in(DecodeState.FINISHING):
            if job.persists or job.queued or job.extent_persist is not None:
                continue
            self._finish(job)
            did = True
        return did

    def _finish(self, job: DecodeJob) -> None:
        assert job.handoff is not None
        task = job.handoff.task
        spec = task.request
        finished = self.ports.clock.now()
        output = tuple(job.tokens[job.prompt_len :])
        tpot = (finished - job.handoff.first_token_at) / (len(output) - 1) if len(output) > 1 else 0.0
        result = TurnResult(
            request_id=spec.request_id, attempt=spec.attempt, output_tokens=output,
            log_probs=tuple(job.log_probs), stop_reason=job.stop_reason or StopReason.LENGTH, prompt_tokens=job.prompt_len,
            hit_tokens=task.hit_tokens, path=task.path, prefill_engine=task.prefill_engine,
            decode_engine=self.settings.engine_id, ttft_s=job.handoff.first_token_at - spec.submitted_at,
            tpot_s=tpot, kv_bytes_verified=job.check.bytes_verified, kv_mismatches=job.check.mismatches,
            persisted=tuple(job.persisted), epoch=spec.epoch,
        )
        transition(job, DecodeState.DONE)
        self._forget(job)
        self.stats.finished += 1
        self._report(result)

    # --- failures and bookkeeping -------------------------------------------------------

    def _fail(self, job: DecodeJob, error: BaseException, report: bool = True) -> None:
        """Wait out the request's transfers (the reader may still read its pages), free all it
        holds, report the error (unless it was aborted: its caller has its answer)."""
        if job.state in (DecodeState.DONE, DecodeState.FAILED):
            return
        for pending in [job.load, job.extent_persist] + [p for p, _ in job.persists]:
            if pending is None:
                continue
            try:
                pending.wait(self.settings.transfer_timeout_s)
            except Exception:  # noqa: BLE001 - only that it ended matters now
                pass
        self._in_flight -= sum(len(blocks) for _, blocks in job.persists)
        job.persists, job.queued, job.load, job.extent_persist = [], deque(), None, None
        if job.handoff is not None and job.handoff.extent is not None:
            if job.state in (DecodeState.RESERVED, DecodeState.LOADING):
                self.ports.readers.free(job.handoff.extent)
            else:
                # Its persist may never have reached the reader (a lost call): reclaim frees the
                # extent then, and leaves it to the write that is using it otherwise.
                self.ports.readers.reclaim(job.handoff.extent.node_id, job.owner)
        transition(job, DecodeState.FAILED)
        self._forget(job)
        spec = job.handoff.task.request if job.handoff else None
        if spec is not None and report:
            self.stats.failures += 1
            self._report(failure_of(spec, self.settings.engine_id, error))

    def _forget(self, job: DecodeJob) -> None:
        with self._lock:
            self.jobs.pop(job.owner, None)
            self.pages.release(job.owner)

    def _report(self, result: TurnResult) -> None:
        """The turn ended: its result leaves with this step's report."""
        self._results.append(result)

    def _jobs_in(self, *states: DecodeState) -> list[DecodeJob]:
        with self._lock:
            return [job for job in self.jobs.values() if job.state in states]
