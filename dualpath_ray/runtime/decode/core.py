"""The decode engine's logic, without Ray: reservations, H2D, batched decode, persistence.

A request's life here (runtime/decode/job.py, one transition function): RESERVED (its handoff
arrived and its pages are reserved) -> LOADING (its prompt's KV moves from the decode node's
buffer extent into its pages: one read of whole Full Blocks) -> RUNNING (decoded in one batched
step with every other running request) -> FINISHING -> DONE; or FAILED from any of them. Oracle
mode skips LOADING: the prompt's KV is materialised in the pages directly (hits from the store,
the rest computed here). The core holds one object per stage around its batched decode: the
intake (runtime/decode/intake.py) takes handoffs and loads their KV, the persistence
(runtime/decode/persistence.py) moves every filled block to the store; both share the job table
(`DecodeJobTable`) and hand failures back to the core, which frees what a request holds and
reports it. What a step produced for the scheduler (turns ended, streamed tokens) leaves in one
report at its end, and a turn ends only once every block it filled is published.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.engine.cancelled import CancelledAttempts
from dualpath_ray.runtime.compute.engine_compute import DecodeSeq, EngineCompute
from dualpath_ray.runtime.decode.job import (
    DecodeJob,
    DecodeJobTable,
    DecodePorts,
    DecodeSettings,
    DecodeState,
    DecodeStats,
    StepLimits,
    transition,
)
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.decode.filled_blocks import FilledBlocks, PagePulls
from dualpath_ray.runtime.decode.intake import DecodeIntake, IntakeHooks
from dualpath_ray.runtime.decode.persistence import DecodePersistence
from dualpath_ray.runtime.engine.failures import failure_of, log_failure
from dualpath_ray.protocol.messages import (
    DecodeHandoff,
    Holding,
    TokenChunk,
    TurnResult,
    newest_holdings,
)
from dualpath_ray.runtime.engine.outbox import Outbox
from dualpath_ray.runtime.engine.ports import Pending
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.protocol.types import StopReason

LOG = logging.getLogger("dualpath_ray.decode")


class DecodeCore:
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
        filled: FilledBlocks | None = None,
    ) -> None:
        """`filled`: where the reader pulls filled blocks from (runtime/decode/filled_blocks.py);
        the pages themselves unless the compute keeps the KV (HeldKV)."""
        if compute.held_kv is not None and filled is None:
            raise ValueError(
                "the compute keeps the decode KV in its own pages: pass `filled`, how the reader pulls filled "
                "blocks from them (runtime/decode/actor.py builds a HeldPulls)"
            )
        self.settings = settings
        self.layout = layout
        self.compute = compute
        self.pages = pages
        self._ports = ports
        self.store = store
        self.cnic_in, self.cnic_out = links
        self.counters = NodeCounters()
        self.stats = DecodeStats()
        self.jobs: dict[str, DecodeJob] = {}
        self._lock = threading.Lock()
        self._cancelled = CancelledAttempts(settings.cancel_horizon_s, ports.clock)
        self._table = DecodeJobTable(self.jobs, self._lock, self._cancelled)
        self._aborting: set[str] = set()
        # Pages of failed jobs that a page pull (persist_pages: the reader's D2H of filled pages)
        # may still be reading, by owner, with the job's compute state: kept reserved, and the
        # compute's own pages (vLLM's: a HeldKV) kept by not releasing that state, until every
        # such pull replied, so no other request's KV lands in a page the reader is copying
        # into a block under this job's key. Each pull ends on its own (the reader's lease and
        # transfer timeouts, or its death fails the call). A job that finishes has no pull left
        # (its turn waits for every persist), so only failed ones wait here.
        self._pulled: dict[str, tuple[list[Pending[int]], Any]] = {}
        self.intake = DecodeIntake(
            settings, layout, compute, pages, ports, store, self._table,
            IntakeHooks(run=self._run, fail=self._fail, report=self._report),
            (self.cnic_in, self.counters, self.stats),
        )
        self.persistence = DecodePersistence(
            settings, layout, filled or PagePulls(pages), ports.readers, store, (self.cnic_out, self.counters, self.stats)
        )
        # This step's report (sent at its end, when not empty): turns ended, tokens sampled by
        # streamed requests.
        self._results: list[TurnResult] = []
        self._streamed: list[TokenChunk] = []
        self.outbox = Outbox()  # results not yet delivered to the scheduler

    @property
    def ports(self) -> DecodePorts:
        return self._ports

    @ports.setter
    def ports(self, ports: DecodePorts) -> None:
        """Swap the ports between steps (a test wraps them with the fault plan once the engine is
        built): the intake and the persistence use the new ones from then on too."""
        self._ports = ports
        self.intake.ports = ports
        self.persistence.readers = ports.readers

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
            entries += self.intake.holdings_locked()
        entries += self.outbox.holdings()
        return newest_holdings(entries)

    def hand_off(self, handoffs: Sequence[DecodeHandoff]) -> None:
        self.intake.arrive(handoffs)

    def polling(self) -> bool:
        """Whether the worker must look again without being woken: a prompt load is a transport
        transfer (polled, it signals nothing), and a handoff waiting for pages has a deadline.
        Everything else that finishes wakes the worker (runtime/engine/ray_ports.py RefPending)."""
        with self._lock:
            loading = any(job.state is DecodeState.LOADING for job in self.jobs.values())
            return self.intake.has_arrivals_locked() or loading

    def busy(self) -> bool:
        """Whether the engine holds any request, or pages a reader may still pull (its memory
        must not be released under them)."""
        with self._lock:
            return bool(self.jobs) or self.intake.has_arrivals_locked() or bool(len(self.outbox)) or bool(self._pulled)

    # --- the worker thread ----------------------------------------------------------------

    def step(self) -> bool:
        """One round: take handoffs, finish loads, one decode step, persists, finished turns."""
        self.outbox.settle()
        did = self._drop_aborted()
        did |= self.intake.take_handoffs()
        did |= self.intake.poll_loads()
        did |= self._decode_once()
        did |= self._advance_persists()
        did |= self._finish_ready()
        did |= self._release_pulled()
        self._send_report()
        return did

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs = [j for j in self.jobs.values() if j.handoff is not None]
        for job in jobs:
            self._fail(job, error)
        self._send_report()

    def _run(self, job: DecodeJob) -> None:
        """The intake loaded and checked the job's prompt KV: its prompt blocks start on their way
        to the store, and it joins the decode batch from the next step."""
        self.persistence.persist_prompt(job)
        job.limits = StepLimits.of(job, self.settings.max_context)
        transition(job, DecodeState.RUNNING)
        self._stream(job, 0)  # the first token, sampled by the prefill engine

    # --- decode -------------------------------------------------------------------------

    def _decode_once(self) -> bool:
        running = self._jobs_in(DecodeState.RUNNING)
        batch: list[DecodeJob] = []
        for job in running:
            job.stop_reason = self._stop_reason(job)
            if job.stop_reason is None:
                batch.append(job)
            else:
                transition(job, DecodeState.FINISHING)
        if not batch:
            return bool(running)
        try:
            seqs = [DecodeSeq(job.tokens[-1], job.kv_len, self._page_table(job), job.compute_state) for job in batch]
            params = [job.handoff.task.request.sampling for job in batch]  # type: ignore[union-attr]
            started = time.perf_counter()
            sampled = self.compute.decode_step(seqs, self.pages.tensor, params)
            self.stats.compute_s += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log_failure(LOG, f"{self.settings.engine_id}: decode step of {len(batch)}", exc)
            for job in batch:
                self._fail(job, exc)
            return True
        computed = len(sampled) - sampled.count(None)
        if not computed:
            # The compute waits for pages that ending sequences hold (vLLM preempted these):
            # the persists and finishes of this round release them, and a later round steps
            # again. Nothing changed, so the worker waits to be woken rather than spin.
            return False
        stats = self.stats
        stats.steps += 1
        stats.tokens += computed
        stats.max_batch = max(stats.max_batch, computed)
        size = self.layout.block_size
        for job, token in zip(batch, sampled):
            if token is None:
                continue  # not computed this step: it stays RUNNING at its position, stepped again next round
            job.kv_len += 1
            job.tokens.append(token.token)
            job.log_probs.append(token.log_prob)
            if job.limits.stream:
                self._stream(job, len(job.tokens) - job.limits.prompt_len - 1)
            if job.kv_len % size == 0:
                self.persistence.block_filled(job, job.kv_len // size - 1)
        return True

    def _page_table(self, job: DecodeJob) -> tuple[int, ...]:
        """The job's page table, covering its next token: the engine's books are asked only
        when it grows past its last page (every block_size steps), the table kept on the job
        otherwise (only `ensure` adds pages to a running job's table, and nothing takes any
        until the job leaves)."""
        if len(job.page_table) * self.layout.block_size <= job.kv_len:
            job.page_table = self.pages.ensure(job.owner, job.kv_len + 1)
        return job.page_table

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

    @staticmethod
    def _stop_reason(job: DecodeJob) -> StopReason | None:
        """Why the job stops before its next step (None: it runs on): its last token is a stop
        id, its output is max_new_tokens long, its tokens fill the context, in that order."""
        limits = job.limits
        tokens = job.tokens
        if limits.stop_ids and len(tokens) > limits.prompt_len and tokens[-1] in limits.stop_ids:
            return StopReason.STOP
        if len(tokens) < limits.stop_at:
            return None  # every step but a sequence's last
        return StopReason.LENGTH if len(tokens) - limits.prompt_len >= limits.max_new_tokens else StopReason.CONTEXT

    # --- persistence --------------------------------------------------------------------

    def _advance_persists(self) -> bool:
        """Collect finished persists (a failed one fails its request; blocks the store refused
        only go unpublished), then post queued blocks."""
        did = False
        jobs = self._jobs_in(DecodeState.RUNNING, DecodeState.FINISHING)
        for job in jobs:
            if not self.persistence.in_flight(job):
                continue  # nothing on its way (every running job, nearly every step: the common case)
            settled, error = self.persistence.settle(job)
            if error is not None:
                self._fail(job, error)
                settled = True
            did |= settled
        live = [job for job in jobs if job.state is DecodeState.RUNNING or job.state is DecodeState.FINISHING]
        did |= self.persistence.post(live)
        return did

    def _finish_ready(self) -> bool:
        did = False
        for job in self._jobs_in(DecodeState.FINISHING):
            if self.persistence.pending(job):
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
            persisted=self.persistence.publish(job), epoch=spec.epoch, recomputed_tokens=task.recomputed_tokens,
        )
        transition(job, DecodeState.DONE)
        self._forget(job)
        self.stats.finished += 1
        self._report(result)

    # --- failures and bookkeeping -------------------------------------------------------

    def _fail(self, job: DecodeJob, error: BaseException, report: bool = True) -> None:
        """Wait out the request's transfers (the reader may still read its pages), free all it
        holds, report the error (unless it was aborted: its caller has its answer). A page pull
        still running after its wait timed out keeps the job's pages reserved until it ends
        (`_release_pulled`): a timed-out wait says nothing about the reader having stopped. (The
        prompt load is a transport transfer, which a timed-out wait aborts: no byte of it lands
        after.)"""
        if job.state in (DecodeState.DONE, DecodeState.FAILED):
            return
        for pending in [job.load, job.extent_persist] + [p for p, _ in job.persists]:
            if pending is None:
                continue
            try:
                pending.wait(self.settings.transfer_timeout_s)
            except Exception:  # noqa: BLE001 - only that it ended matters now
                pass
        pulls = [pending for pending, _ in job.persists if not _ended(pending)]
        self.persistence.abandon(job)
        job.load = None
        if job.handoff is not None and job.handoff.extent is not None:
            if job.state in (DecodeState.RESERVED, DecodeState.LOADING):
                self.ports.readers.free(job.handoff.extent)
            else:
                # Its persist may never have reached the reader (a lost call): reclaim frees the
                # extent then, and leaves it to the write that is using it otherwise.
                self.ports.readers.reclaim(job.handoff.extent.node_id, job.owner)
        transition(job, DecodeState.FAILED)
        self._forget(job, pulls)
        spec = job.handoff.task.request if job.handoff else None
        if spec is not None and report:
            self.stats.failures += 1
            self._report(failure_of(spec, self.settings.engine_id, error))

    def _forget(self, job: DecodeJob, pulls: Sequence[Pending[int]] = ()) -> None:
        """The job leaves the engine; its pages (the engine's books and the compute's state,
        which holds the compute's pages) are released now, or once `pulls` (page pulls that may
        still read them) ended."""
        with self._lock:
            self.jobs.pop(job.owner, None)
            if pulls:
                self._pulled[job.owner] = (list(pulls), job.compute_state)
                return
            self.pages.release(job.owner)
        self.compute.release(job.compute_state)

    def _release_pulled(self) -> bool:
        """Release the pages of failed jobs whose page pulls have all ended (a pull's reply wakes
        the worker: RefPending)."""
        with self._lock:
            held = list(self._pulled.items())
        ended = [owner for owner, (pulls, _) in held if all(_ended(p) for p in pulls)]
        if not ended:
            return False
        states = []
        with self._lock:
            for owner in ended:
                states.append(self._pulled.pop(owner)[1])
                self.pages.release(owner)
        for state in states:
            self.compute.release(state)
        return True

    def _report(self, result: TurnResult) -> None:
        """The turn ended: its result leaves with this step's report."""
        self._results.append(result)

    def _jobs_in(self, *states: DecodeState) -> list[DecodeJob]:
        return self._table.in_states(*states)


def _ended(pending: Pending[int]) -> bool:
    """Whether a call or transfer is over, either way (an error is an end too)."""
    try:
        return pending.done()
    except Exception:  # noqa: BLE001 - it failed: it ended
        return True
