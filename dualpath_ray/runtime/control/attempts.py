"""How an attempt ends: the futures the turns being served await, and the results that answer them.

Results reach this object from the engines' reports (`complete`, through the report intake), from
the watchdog (`fail`, a peer died) and from an abort (`abort`); a result of an attempt no longer
current is counted and dropped (or, from an earlier incarnation, handed to its adoption). The
serving of turns (runtime/control/serving.py) registers each attempt's future here and awaits
it. Built before the watchdog, which fails attempts through it, and after the decision rounds,
which every end of an attempt frees (runtime/control/plane.py builds them in that order).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, TurnResult, aborted_result, failed_result
from dualpath_ray.protocol.names import SCHEDULER, reader_name
from dualpath_ray.protocol.types import StopReason
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.decisions import Decisions
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import SchedulerCore


class Attempts:
    """The current attempts' futures (`pending`) and what their failures suspect (`suspects`)."""

    def __init__(
        self, core: SchedulerCore, decisions: Decisions, control: ClusterControl, liveness: Liveness, aborts: Aborts,
        adoptions: Adoptions, calls: SchedulerCounts, metrics: SchedulerMetrics,
    ) -> None:
        self.core = core
        self.decisions = decisions
        self.control = control
        self.liveness = liveness
        self.aborts = aborts
        self.adoptions = adoptions
        self.calls = calls
        self.metrics = metrics
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        # Failed attempts whose peer died -> the peers to ask before their retry is placed.
        self.suspects: dict[str, set[str]] = {}

    def awaiting(self, request_id: str) -> asyncio.Future[TurnResult]:
        """A new future for the current attempt of `request_id` (its serving drops it with `forget`)."""
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def cancel_at(self, engines: tuple[str, ...], owner: str) -> None:
        """Drop what one attempt ("request#attempt") holds at these engines and has not started
        (a queued prefill, a handoff not taken yet); one that already started finishes on its own."""
        for engine in engines:
            self.control.cancel(engine, owner)

    def fail(self, spec: RequestSpec, by: str, why: str) -> None:
        """A peer of the attempt `spec` died (the watchdog's verdict)."""
        self.complete(failed_result(spec, by, why, ErrorKind.PEER_DIED))

    def complete(self, result: TurnResult) -> None:
        """An attempt ended: free what it held and answer its turn, if it is still current."""
        self.calls.complete += 1
        current = self.core.is_current(result)
        request = self.core.requests.get(result.request_id)
        if current and request is not None and result.error_kind is ErrorKind.PEER_DIED:
            self.suspects[result.owner] = self._peers_of(request)
        decode_engine = result.decode_engine or (request.decode_engine if request is not None else "")
        holders = self.decisions.rounds.finish(result, self.decisions.decode_group_of.get(decode_engine))
        self.cancel_at(holders, result.owner)
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
            self.decisions.rounds.everything_changed()  # what it held is free again
            future = self.pending.get(request_id)
            if future is not None and not future.done():
                future.set_result(aborted_result(request.spec))
        waiting = self.adoptions.waiting.get(request_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)  # stop waiting for a dead incarnation's attempt
        return True
