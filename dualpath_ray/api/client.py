"""The caller's side of the scheduler: many turns from one event loop, in two calls for many.

`await client.generate(spec)` serves one turn, like `scheduler.generate.remote(spec)`, but a
busy caller (a rollout of many trajectories, the rollout server under an RL trainer) does not
pay one actor call per turn: the turns submitted in one pass of its event loop leave in one
`submit` call, and one long-poll `collect` call brings back every result that finished (it
returns as soon as there is one). The scheduler's cost per turn then falls with the load.

A restarted scheduler (Ray restarts it; its new incarnation has another epoch) knows nothing of
what was submitted to the one that died: the client notices the new epoch in an answer and
submits again every turn it still waits for. The new incarnation takes over attempts the
engines still hold (runtime/control/adoption.py), so nothing runs twice.

A turn the scheduler refused because its queue was full (scheduler.max_queued_turns) ends with
ErrorKind.QUEUE_FULL; `generate_admitted` submits it again after growing pauses, within a bound.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dualpath_ray.protocol.messages import Collected, RequestSpec, TurnResult

LOG = logging.getLogger("dualpath_ray.client")


@dataclass(frozen=True)
class Backoff:
    """Pauses before submitting a refused turn again: from `first_s`, times `factor` each time,
    at most `max_s`, each drawn within +-`jitter` of that (so the trajectories a full queue
    refused together do not all come back in the same instant)."""

    first_s: float = 0.05
    factor: float = 2.0
    max_s: float = 1.0
    jitter: float = 0.5
    seed: int | None = None

    def __iter__(self) -> Iterator[float]:
        rng = random.Random(self.seed)
        pause = self.first_s
        while True:
            yield pause * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)
            pause = min(self.max_s, pause * self.factor)


@dataclass
class _Waiting:
    spec: RequestSpec
    future: asyncio.Future[TurnResult]
    epoch: int | None = None  # the scheduler incarnation that accepted it (None: not answered yet)


class SchedulerClient:
    """Use from one event loop (one per process or actor). `scheduler` is the Scheduler actor's
    handle."""

    def __init__(self, scheduler: Any, name: str | None = None) -> None:
        self.scheduler = scheduler
        self.name = name or f"client-{uuid.uuid4().hex[:12]}"
        self.epoch: int | None = None  # the newest scheduler incarnation heard from
        self.submits = 0  # calls made, for benchmarks
        self.collects = 0
        self.resubmits = 0  # turns submitted again after a full queue refused them (generate_admitted)
        self._waiting: dict[str, _Waiting] = {}
        self._outgoing: list[RequestSpec] = []
        self._flush_due = False
        self._collector: asyncio.Task[None] | None = None

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result (a failed one once retries or the deadline ran out), or
        the scheduler's refusal raised (a request id already in flight, the cluster asleep)."""
        if spec.request_id in self._waiting:
            raise ValueError(f"request id {spec.request_id!r} is already in flight; ids must be unique")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(spec, loop.create_future())
        self._waiting[spec.request_id] = waiting
        self._send(spec)
        if self._collector is None or self._collector.done():
            self._collector = loop.create_task(self._collect())
        try:
            return await waiting.future
        finally:
            self._waiting.pop(spec.request_id, None)

    async def generate_admitted(
        self, spec: RequestSpec, within_s: float, pauses: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> TurnResult:
        """`generate`, but a turn the scheduler refused because its queue was full
        (ErrorKind.QUEUE_FULL: nothing of it ran) is submitted again after a pause, growing
        (`pauses`), for at most `within_s` after the first submit; then its last refusal is
        returned. The scheduler never retries a refusal itself: waiting is the caller's choice."""
        waits = iter(pauses or Backoff())
        give_up_at = clock() + within_s
        while True:
            result = await self.generate(spec)
            kind, pause = result.error_kind, next(waits)
            if kind is None or not kind.resubmittable or clock() + pause > give_up_at:
                return result
            self.resubmits += 1
            await asyncio.sleep(pause)

    def _send(self, spec: RequestSpec) -> None:
        self._outgoing.append(spec)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        specs, self._outgoing = self._outgoing, []
        if specs:
            asyncio.get_running_loop().create_task(self._submit(specs))

    async def _submit(self, specs: list[RequestSpec]) -> None:
        self.submits += 1
        try:
            epoch, refusals = await self.scheduler.submit.remote(self.name, specs)
        except Exception as exc:  # noqa: BLE001 - the scheduler is gone: every turn sent gets the error
            for spec in specs:
                self._settle_error(spec.request_id, exc)
            return
        self._heard(epoch)
        for spec, refusal in zip(specs, refusals):
            waiting = self._waiting.get(spec.request_id)
            if waiting is None:
                continue
            if refusal is not None:
                self._settle_error(spec.request_id, refusal.error(spec.request_id))
            else:
                waiting.epoch = epoch

    async def _collect(self) -> None:
        """While turns are in flight: bring their results back, one long-poll at a time."""
        while self._waiting:
            self.collects += 1
            try:
                collected: Collected = await self.scheduler.collect.remote(self.name, self.epoch)
            except Exception as exc:  # noqa: BLE001 - the scheduler is gone for good
                for rid in list(self._waiting):
                    self._settle_error(rid, exc)
                return
            self._heard(collected.epoch)
            for result in collected.results:
                # Forgotten here, not when its caller resumes, so the last result ends the loop
                # without one more long-poll left waiting at the scheduler.
                waiting = self._waiting.pop(result.request_id, None)
                if waiting is not None and not waiting.future.done():
                    waiting.future.set_result(result)

    def _heard(self, epoch: int) -> None:
        """An answer from incarnation `epoch`: a new one restarted, and the turns accepted by
        the one before are submitted again."""
        if self.epoch is not None and epoch <= self.epoch:
            return  # the same incarnation, or a late answer of a dead one (epochs grow)
        previous, self.epoch = self.epoch, epoch
        if previous is None:
            return
        lost = [w.spec for w in self._waiting.values() if w.epoch is not None and w.epoch != epoch]
        if lost:
            LOG.warning("%s: the scheduler restarted; submitting %d turns again", self.name, len(lost))
        for spec in lost:
            self._waiting[spec.request_id].epoch = None
            self._send(spec)

    def _settle_error(self, request_id: str, error: BaseException) -> None:
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_exception(error)

    def in_flight(self) -> int:
        return len(self._waiting)
