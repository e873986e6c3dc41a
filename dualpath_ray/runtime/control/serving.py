"""The serving of turns, attempt by attempt.

One turn is served by attempts: a restarted incarnation first adopts the attempt a dead
incarnation left at an engine (runtime/control/adoption.py), then each attempt is handed to the
decision rounds (runtime/control/decisions.py) and awaited until its result is reported or its
deadline (runtime.request_timeout_s, over every attempt) passes; a result the core judges
retryable is retried as the next attempt, unless the request was aborted meanwhile. How an
attempt ends (its result, a peer's death, an abort) is `Attempts`' (runtime/control/attempts.py):
this object only awaits it, so it is built last, over the rounds, the attempts and the watchdog
(runtime/control/plane.py), and none of them needs it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, TurnResult, aborted_result, failed_result
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.attempts import Attempts
from dualpath_ray.runtime.control.decisions import Decisions
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.scheduling.admission import QueueFull
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.scheduler import SchedulerCore


class Serving:
    """Every turn this incarnation serves, from its acceptance to its answer."""

    def __init__(
        self, cfg: DualPathConfig, core: SchedulerCore, attempts: Attempts, decisions: Decisions, watchdog: Watchdog,
        liveness: Liveness, aborts: Aborts, adoptions: Adoptions, calls: SchedulerCounts,
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.attempts = attempts
        self.decisions = decisions
        self.watchdog = watchdog
        self.liveness = liveness
        self.aborts = aborts
        self.adoptions = adoptions
        self.calls = calls
        self.servings = 0  # requests this incarnation began serving (RequestSpec.epoch)
        self.refused = 0  # new turns refused because the queue was full (scheduler.max_queued_turns)

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn (already accepted by the actor): its result, an aborted result, or a
        failed one once its retries or its deadline are used up."""
        self.calls.generate += 1
        if not self.aborts.start(spec.request_id):
            return aborted_result(spec)  # its trajectory was aborted
        self.watchdog.work.set()
        try:
            return await self._serve(spec)
        finally:
            self.aborts.end(spec.request_id)

    async def _serve(self, spec: RequestSpec) -> TurnResult:
        deadline = time.monotonic() + self.cfg.runtime.request_timeout_s
        adopted = await self._adopt(spec.request_id, deadline)
        if adopted is not None and not self.core.should_retry(adopted):
            return adopted
        self.servings += 1
        spec = dataclasses.replace(spec, epoch=self.core.epoch + self.servings)  # see RequestSpec.epoch
        while not self.aborts.is_aborted(spec.request_id):
            result = await self._attempt(spec, deadline)
            suspects = self.attempts.suspects.pop(spec.owner, set())
            if not self.core.should_retry(result) or self.aborts.is_aborted(spec.request_id):
                break
            if suspects:
                # A peer of the attempt died: learn which before the retry is placed, or it may
                # land on the same dead peer (the heartbeat would tell only a beat later).
                await self.watchdog.probe(suspects)
            self.calls.retries += 1
            spec, unindexed = self.core.next_attempt(result, spec)
            self.calls.unindexed_blocks += unindexed
        return aborted_result(spec) if self.aborts.is_aborted(spec.request_id) else result

    async def _adopt(self, request_id: str, deadline: float) -> TurnResult | None:
        """The result of a dead incarnation's attempt that an engine still holds (None: there
        is none, or it was dropped; the request is then dispatched afresh)."""
        result = self.adoptions.claim(request_id)
        if result is not None or request_id not in self.adoptions.holders:
            return result
        try:
            return await asyncio.wait_for(self.adoptions.wait_for(request_id), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        finally:
            self.adoptions.forget(request_id)

    async def _attempt(self, spec: RequestSpec, deadline: float) -> TurnResult:
        future = self.attempts.awaiting(spec.request_id)
        try:
            self.decisions.rounds.submit(spec)
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except QueueFull as full:
            # Answered, not retried (ErrorKind.QUEUE_FULL is not retryable): nothing of it was
            # queued, and its caller decides whether to submit it again.
            self.refused += 1
            return failed_result(spec, SCHEDULER, str(full), ErrorKind.QUEUE_FULL)
        except asyncio.TimeoutError:
            self.calls.timeouts += 1
            self.attempts.cancel_at(self.core.abandon(spec.request_id), spec.owner)
            self.decisions.rounds.everything_changed()  # what it held is free again
            return failed_result(
                spec, SCHEDULER, f"no result within runtime.request_timeout_s={self.cfg.runtime.request_timeout_s}",
                ErrorKind.TIMEOUT,
            )
        finally:
            self.attempts.forget(spec.request_id)
            self.liveness.forget(spec.owner)
