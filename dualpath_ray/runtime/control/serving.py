"""The serving of turns, held by the Scheduler actor (runtime/control/scheduler.py).

One turn is served by attempts: a restarted incarnation first adopts the attempt a dead
incarnation left at an engine (runtime/control/adoption.py), then each attempt is handed to the
decision rounds (runtime/control/decisions.py) and awaited until its result is reported or its
deadline (runtime.request_timeout_s, over every attempt) passes; a result the core judges
retryable is retried as the next attempt, unless the request was aborted meanwhile. Results reach
this object from the engines' reports (`complete`), from the watchdog (`fail`, a peer died) and
from an abort (`abort`); a result of an attempt no longer current is counted and dropped (or,
from an earlier incarnation, handed to its adoption).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, TurnResult, aborted_result, failed_result
from dualpath_ray.protocol.names import SCHEDULER, reader_name
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.decisions import Decisions
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.scheduling.admission import QueueFull
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import StopReason


class Serving:
    """Every turn this incarnation serves: the futures its attempts await and what their
    failures suspect. The decisions and the watchdog need the actor's running event loop, so
    they are bound by its first call (`bind`); only the size views run before that."""

    def __init__(
        self, cfg: DualPathConfig, core: SchedulerCore, control: ClusterControl, liveness: Liveness, aborts: Aborts,
        adoptions: Adoptions, calls: SchedulerCounts, metrics: SchedulerMetrics,
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.control = control
        self.liveness = liveness
        self.aborts = aborts
        self.adoptions = adoptions
        self.calls = calls
        self.metrics = metrics
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        self.servings = 0  # requests this incarnation began serving (RequestSpec.epoch)
        self.refused = 0  # new turns refused because the queue was full (scheduler.max_queued_turns)
        # Failed attempts whose peer died -> the peers to ask before their retry is placed.
        self.suspects: dict[str, set[str]] = {}
        self.decisions: Decisions | None = None
        self.watchdog: Watchdog | None = None

    def bind(self, decisions: Decisions, watchdog: Watchdog) -> None:
        """The decision rounds that place attempts and the watchdog that probes suspects."""
        self.decisions = decisions
        self.watchdog = watchdog

    # --- one turn, attempt by attempt ----------------------------------------------------

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn (already accepted by the actor): its result, an aborted result, or a
        failed one once its retries or its deadline are used up."""
        self.calls.generate += 1
        if not self.aborts.start(spec.request_id):
            return aborted_result(spec)  # its trajectory was aborted
        assert self.watchdog is not None
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
            suspects = self.suspects.pop(spec.owner, set())
            if not self.core.should_retry(result) or self.aborts.is_aborted(spec.request_id):
                break
            if suspects:
                # A peer of the attempt died: learn which before the retry is placed, or it may
                # land on the same dead peer (the heartbeat would tell only a beat later).
                assert self.watchdog is not None
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
        assert self.decisions is not None
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[spec.request_id] = future
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
            self._cancel_at(self.core.abandon(spec.request_id), spec.owner)
            self.decisions.rounds.everything_changed()  # what it held is free again
            return failed_result(
                spec, SCHEDULER, f"no result within runtime.request_timeout_s={self.cfg.runtime.request_timeout_s}",
                ErrorKind.TIMEOUT,
            )
        finally:
            self.pending.pop(spec.request_id, None)
            self.liveness.forget(spec.owner)

    def _cancel_at(self, engines: tuple[str, ...], owner: str) -> None:
        """Drop what one attempt ("request#attempt") holds at these engines and has not started
        (a queued prefill, a handoff not taken yet); one that already started finishes on its own."""
        for engine in engines:
            self.control.cancel(engine, owner)

    # --- how an attempt ends -------------------------------------------------------------

    def fail(self, spec: RequestSpec, by: str, why: str) -> None:
        """A peer of the attempt `spec` died (the watchdog's verdict)."""
        self.complete(failed_result(spec, by, why, ErrorKind.PEER_DIED))

    def complete(self, result: TurnResult) -> None:
        """An attempt ended: free what it held and answer its turn, if it is still current."""
        assert self.decisions is not None
        self.calls.complete += 1
        current = self.core.is_current(result)
        request = self.core.requests.get(result.request_id)
        if current and request is not None and result.error_kind is ErrorKind.PEER_DIED:
            self.suspects[result.owner] = self._peers_of(request)
        decode_engine = result.decode_engine or (request.decode_engine if request is not None else "")
        holders = self.decisions.rounds.finish(result, self.decisions.decode_group_of.get(decode_engine))
        self._cancel_at(holders, result.owner)
        orders = self.core.take_stage_orders()
        if orders:
            self.decisions.stage_ahead(orders)
        if not current:
            if result.epoch < self.core.epoch and self.adoptions.deliver(result, time.monotonic()):
                self.calls.adopted = self.adoptions.adopted
                return
            self.calls.stale_results += 1
            return
        self.liveness.forget(result.owner)
        self.metrics.finished(result)
        future = self.pending.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)

    def answer_failed(self, result: TurnResult, error: BaseException) -> None:
        """`complete` raised on `result` (a bug): its turn, if it still waits for this attempt,
        gets an INTERNAL failure now rather than its deadline's TIMEOUT."""
        request = self.core.requests.get(result.request_id)
        if request is not None and not self.core.is_current(result):
            return  # a late result of an earlier attempt: the current one is still served
        future = self.pending.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(dataclasses.replace(
                result, output_tokens=(), log_probs=(), stop_reason=StopReason.ERROR, persisted=(),
                error=f"{SCHEDULER}: {error!r}", error_kind=ErrorKind.INTERNAL,
            ))

    @staticmethod
    def _peers_of(request: Request) -> set[str]:
        """The engines an attempt used and the readers of their nodes."""
        engines = {e for e in (request.prefill_engine, request.decode_engine) if e}
        nodes = {n for n in (request.prefill_node, request.decode_node) if n}
        return engines | {reader_name(node) for node in nodes}

    def abort(self, request_id: str) -> bool:
        """Stop one request now (see Scheduler.abort); False when none of that id is in flight."""
        if not self.aborts.abort(request_id):
            return False
        self.calls.aborted = self.aborts.count
        request = self.core.requests.get(request_id)
        if request is not None:
            self.liveness.forget(request.spec.owner)
            for engine in self.core.abandon(request_id):
                self.control.abort(engine, request.spec.owner)
            assert self.decisions is not None
            self.decisions.rounds.everything_changed()  # what it held is free again
            future = self.pending.get(request_id)
            if future is not None and not future.done():
                future.set_result(aborted_result(request.spec))
        waiting = self.adoptions.waiting.get(request_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)  # stop waiting for a dead incarnation's attempt
        return True
