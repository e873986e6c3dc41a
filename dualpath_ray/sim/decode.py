"""Simulated decode engines: reservations, H2D, batched decode steps in closed form, persistence.

As the runtime's DecodeCore (runtime/decode/core.py): a reservation sets pages aside when the
scheduler places a request; its handoff moves the prompt's KV from the decode node's buffer into
HBM (H2D through the engine's CNIC); then every running request decodes one token per batched
step, `gen - 1` steps (the first token came from prefill). Prompt blocks that were not hits are
persisted from the buffer extent (which is then freed), blocks filled while decoding are pulled
D2H and persisted when the turn ends; the turn is reported once all are written, and only then
are its pages released.

Decode steps are not events. Between two changes of the running set (a request joins or
leaves) a step over B requests with C cached tokens in all takes step(B, C) ms, and every step
adds B tokens, so with the engine-time model linear in C the k-th step of an epoch takes
A + k * D and n steps take S(n) = n * A + D * n * (n - 1) / 2: the next finish is one event at
S(min remaining steps), and a request whose KV landed joins at the first step boundary after
it. An engine with B requests costs O(B) per join or leave, not O(B) per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dualpath_ray.protocol.messages import DecodeReservation
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.links import take_all
from dualpath_ray.sim.nodes import EngineLinks, SimNode
from dualpath_ray.sim.prefill import SimPrefillJob
from dualpath_ray.sim.settings import SimSettings


@dataclass(eq=False)
class SimDecodeJob:
    request_id: str
    reserved_tokens: int
    pages: int
    job: SimPrefillJob | None = None
    remaining: int = 0  # decode steps still to run
    kv_len: int = 0  # tokens whose KV is in HBM (the step's position)
    ready_at: float = 0.0  # its prompt KV is in HBM
    persist_done: float = 0.0  # its prompt blocks are in the store


@dataclass
class SimDecodeStats:
    steps: int = 0
    tokens: int = 0
    max_batch: int = 0


Finished = Callable[["SimDecodeEngine", SimDecodeJob, float], None]


class SimDecodeEngine:
    def __init__(
        self, engine_id: str, node: SimNode, settings: SimSettings, loop: EventLoop, finished: Finished,
        stats: SimDecodeStats, prompt_stored: Callable[[str], None] | None = None,
    ) -> None:
        self.engine_id = engine_id
        # Told when a request's computed prompt blocks are in the store, before its turn ends
        # (in-flight sharing publishes them then: SchedulerCore.prompt_persisted); None: not told.
        self.prompt_stored = prompt_stored
        self.node = node
        self.settings = settings
        self.loop = loop
        self.finished = finished
        self.stats = stats
        self.links = EngineLinks(engine_id, settings)
        self.jobs: dict[str, SimDecodeJob] = {}
        self.tok = 0
        self.free_pages = settings.hbm_pages
        self.running: list[SimDecodeJob] = []
        self.waiting: list[SimDecodeJob] = []  # loaded, joining at the next step boundary
        self.epoch_start = 0.0
        self.step_a = 0.0  # seconds of the epoch's first step
        self.step_d = 0.0  # seconds each later step adds
        self.version = 0
        self._load: EngineLoad | None = None  # the report, kept until the load changes

    # --- the scheduler's view -------------------------------------------------------------

    def load(self) -> EngineLoad:
        if self._load is None:
            self._load = EngineLoad(
                self.engine_id, self.node.node_id, len(self.jobs), self.tok, self.free_pages * self.settings.block_size
            )
        return self._load

    def accept(self, reservation: DecodeReservation) -> None:
        pages = -(-reservation.tokens // self.settings.block_size)
        if pages > self.free_pages:
            raise AssertionError(
                f"{self.engine_id}: the scheduler placed {reservation.request_id} ({pages} pages) "
                f"on {self.free_pages} free pages"
            )
        self.free_pages -= pages
        self.tok += reservation.tokens
        self._load = None
        self.jobs[reservation.request_id] = SimDecodeJob(reservation.request_id, reservation.tokens, pages)

    # --- handoff and load ---------------------------------------------------------------

    def hand_off(self, job: SimPrefillJob, now: float) -> None:
        decode = self.jobs[job.request_id]
        decode.job = job
        decode.kv_len = job.prompt
        decode.remaining = job.task.request.sampling.max_new_tokens - 1
        if job.task.oracle:
            self._loaded(decode)
            return
        nbytes = job.prompt * self.settings.kv_bytes_per_token
        done = take_all(now, ((self.links.cnic_in, nbytes), (self.node.dram, nbytes)))
        self.loop.at(done, self._loaded, decode)

    def _loaded(self, decode: SimDecodeJob) -> None:
        now = self.loop.now
        job = decode.job
        assert job is not None
        size = self.settings.block_size
        decode.ready_at = decode.persist_done = now
        if not job.task.oracle:
            extent = -(-job.prompt // size)
            blocks = job.prompt // size - job.task.stored_tokens // size
            if blocks > 0:
                decode.persist_done = self.node.write(now, blocks * self.settings.block_bytes)
                if self.prompt_stored is not None:
                    self.loop.at(decode.persist_done, self.prompt_stored, decode.request_id)
            self.loop.at(decode.persist_done, self._free_extent, extent)
        if decode.remaining <= 0:
            self._end(decode, now)
            return
        self.waiting.append(decode)
        if not self.running:
            self._new_epoch(now)
        else:
            self._schedule_join()

    def _free_extent(self, blocks: int) -> None:
        self.node.buffer.release(self.loop.now, blocks)

    # --- the batch in closed form ---------------------------------------------------------

    def _elapsed(self, steps: int) -> float:
        return steps * self.step_a + self.step_d * steps * (steps - 1) / 2

    def _steps_within(self, seconds: float) -> int:
        """The number of whole steps of the epoch that end by `seconds` after its start."""
        a, d = self.step_a, self.step_d
        if d <= 1e-15:
            n = int(seconds / a) if a > 0 else 0
        else:
            half = a - d / 2
            n = int((-half + math.sqrt(half * half + 2 * d * seconds)) / d)
        while n > 0 and self._elapsed(n) > seconds + 1e-9:
            n -= 1
        while self._elapsed(n + 1) <= seconds + 1e-9:
            n += 1
        return n

    def _advance(self, now: float) -> None:
        """Account the steps run since the epoch started (now is one of its step boundaries)."""
        if not self.running:
            return
        steps = self._steps_within(now - self.epoch_start)
        for job in self.running:
            job.remaining -= steps
            job.kv_len += steps
        self.stats.steps += steps
        self.stats.tokens += steps * len(self.running)

    def _new_epoch(self, now: float) -> None:
        """Start a new epoch at `now` (a step boundary): admit what has landed, schedule what follows."""
        joining = [job for job in self.waiting if job.ready_at <= now]
        if joining:
            self.waiting = [job for job in self.waiting if job.ready_at > now]
            self.running.extend(joining)
        self.version += 1
        self.epoch_start = now
        if not self.running:
            return
        batch = len(self.running)
        context = sum(job.kv_len for job in self.running)
        step_ms = self.settings.cost.decode_step_ms
        self.step_a = step_ms(batch, context) / 1000.0
        self.step_d = step_ms(batch, context + batch) / 1000.0 - self.step_a
        self.stats.max_batch = max(self.stats.max_batch, batch)
        fewest = min(job.remaining for job in self.running)
        self.loop.at(now + self._elapsed(fewest), self._boundary, self.version)
        self._schedule_join()

    def _schedule_join(self) -> None:
        if not self.waiting:
            return
        first = min(job.ready_at for job in self.waiting) - self.epoch_start
        steps = self._steps_within(first)
        if self._elapsed(steps) < first - 1e-12:
            steps += 1
        self.loop.at(self.epoch_start + self._elapsed(steps), self._boundary, self.version)

    def _boundary(self, version: int) -> None:
        if version != self.version:
            return
        now = self.loop.now
        self._advance(now)
        done = [job for job in self.running if job.remaining <= 0]
        if done:
            self.running = [job for job in self.running if job.remaining > 0]
        for job in done:
            self._end(job, now)
        self._new_epoch(now)

    # --- the end of a turn ----------------------------------------------------------------

    def _end(self, decode: SimDecodeJob, now: float) -> None:
        """Its last step ran: persist the blocks decode filled, then report."""
        job = decode.job
        assert job is not None
        size = self.settings.block_size
        finish = max(now, decode.persist_done)
        filled = (job.prompt + job.task.request.sampling.max_new_tokens - 1) // size - job.prompt // size
        if filled > 0 and not job.task.oracle:
            nbytes = filled * self.settings.block_bytes
            pulled = take_all(now, ((self.links.cnic_out, nbytes), (self.node.dram, nbytes)))
            finish = max(finish, pulled, self.node.write(now, nbytes))
        self.loop.at(finish, self._report, decode)

    def _report(self, decode: SimDecodeJob) -> None:
        del self.jobs[decode.request_id]
        self.free_pages += decode.pages
        self.tok -= decode.reserved_tokens
        self._load = None
        self.finished(self, decode, self.loop.now)
