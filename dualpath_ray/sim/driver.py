"""The scheduler side of a simulation: the runtime's SchedulerCore, driven by simulated pulls.

Every decision (hit lookup, decode placement, prefill placement, read path) is the scheduler
core's (scheduling/scheduler.py), called exactly as the runtime's Scheduler actor calls it: a
group leader pulls with its group's engine loads and its node's read queue (runtime/leader.py),
and the core answers with reservations or tasks. What the simulator decides is only *when*
leaders pull, mirroring when the runtime's leaders would get an answer that is not empty:

- a decode group pulls at once when its private queue holds requests and its HBM was freed or
  the queue grew, and one group (in rotation) pulls when the global queue is not empty, which
  drains it into the groups' private queues (phase 1);
- a prefill round runs when the prefill queue has requests, pulling the groups in rotation
  (the runtime's leaders race for it) while requests remain; a group none of whose engines is
  at or under beta is skipped, since the core would assign it nothing (class C1);
- every decode group reports again at most `scheduler.fetch_wait_ms + fetch_interval_ms` after
  its loads or its read queue changed: the runtime's idle leaders pull that often, and those
  reports are what the read-path choice compares a decode node's read queue with.
A pull the simulator skips is one whose answer the core would make empty, so the decisions are
those of a runtime whose leaders pull without delay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dualpath_ray.runtime.messages import DecodeReservation, GroupReport, PrefillTask, RequestSpec, TurnResult
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.sim.decode import DecodeEngine
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.nodes import SimNode
from dualpath_ray.sim.prefill import PrefillEngine


@dataclass(eq=False)
class Group:
    group_id: str
    node: SimNode
    engines: Sequence[PrefillEngine] | Sequence[DecodeEngine]
    last_report: float = -1.0
    refresh_at: float | None = None  # a report is due then (the loads or read queue changed)
    work: bool = False  # it may place something now (decode: HBM freed or its private queue grew)
    private: int = 0  # its private queue's length after its last pull (decode)


@dataclass
class SchedulerStats:
    cpu_s: float = 0.0  # process time inside the scheduler core's calls
    calls: int = 0
    decode_pulls: int = 0
    prefill_pulls: int = 0


class Driver:
    def __init__(
        self, loop: EventLoop, core: SchedulerCore, prefill: list[Group], decode: list[Group],
        pull_delay_s: float, report_interval_s: float, beta: int,
    ) -> None:
        self.loop = loop
        self.core = core
        self.prefill = prefill
        self.decode = decode
        self.decode_by_node = {g.node.node_id: g for g in decode}
        self.pull_delay_s = pull_delay_s
        self.report_interval_s = report_interval_s
        self.beta = beta
        self.stats = SchedulerStats()
        self.on_reservation: Callable[[DecodeReservation], None] = lambda r: None
        self.on_tasks: Callable[[list[PrefillTask], float], None] = lambda tasks, now: None
        self._decode_round_at: float | None = None
        self._prefill_round_at: float | None = None
        self._decode_turn = 0
        self._prefill_turn = 0

    # --- calls into the core, timed --------------------------------------------------------

    def _timed(self, call: Callable, *args: object) -> object:
        started = time.process_time()
        try:
            return call(*args)
        finally:
            self.stats.cpu_s += time.process_time() - started
            self.stats.calls += 1

    def start(self) -> None:
        """Every leader's first pull, before any request arrives, as the runtime's leaders pull
        from deploy on. Phase 1 spreads the queue over the decode groups that have reported, so
        without it a burst at t=0 all went to the first group to pull (48P96D: every agent's first
        turn on one decode node, the last of them placed after 354 s)."""
        for group in self.decode:
            self._pull_decode(group)
        for group in self.prefill:
            self._pull_prefill(group)

    def submit(self, spec: RequestSpec) -> Request:
        request = self._timed(self.core.submit, spec)
        self._decode_round(self.loop.now + self.pull_delay_s)
        return request  # type: ignore[return-value]

    def handed_off(self, request_id: str) -> None:
        self._timed(self.core.handed_off, request_id)

    def finish(self, result: TurnResult, group: Group) -> None:
        self._timed(self.core.finish, result)
        if self.core.dispatcher.decode_private.get(group.group_id):
            group.work = True  # its HBM was freed and requests wait for it
        self.report_changed(group)
        self._decode_round(self.loop.now + self.pull_delay_s)

    # --- when leaders pull -----------------------------------------------------------------

    def report_changed(self, group: Group) -> None:
        """A decode group's loads or read queue changed: it reports again within the interval."""
        if group.refresh_at is not None:
            return
        group.refresh_at = max(self.loop.now + self.pull_delay_s, group.last_report + self.report_interval_s)
        self.loop.at(group.refresh_at, self._refresh, group, late=True)

    def read_queue_changed(self, node_id: str) -> None:
        group = self.decode_by_node.get(node_id)
        if group is not None:
            self.report_changed(group)

    def _refresh(self, group: Group) -> None:
        if group.refresh_at is not None and group.refresh_at <= self.loop.now:
            self._pull_decode(group)

    def _decode_round(self, when: float) -> None:
        if self._decode_round_at is None or self._decode_round_at > when:
            self._decode_round_at = when
            self.loop.at(when, self._run_decode_round, when, late=True)

    def _run_decode_round(self, when: float) -> None:
        if self._decode_round_at != when:
            return
        self._decode_round_at = None
        if self.core.dispatcher.decode_global:
            self._pull_decode(self.decode[self._decode_turn % len(self.decode)])
            self._decode_turn += 1
        for group in self.decode:
            if group.work:
                self._pull_decode(group)

    def _pull_decode(self, group: Group) -> None:
        now = self.loop.now
        dispatcher = self.core.dispatcher
        drains = bool(dispatcher.decode_global)
        group.work = False
        group.refresh_at = None
        group.last_report = now
        report = GroupReport(
            group.group_id, group.node.node_id, tuple(e.load() for e in group.engines),
            group.node.read_queue.tokens(now),
        )
        self.stats.decode_pulls += 1
        reservations = self._timed(self.core.fetch_decode, report)
        group.private = len(dispatcher.decode_private.get(group.group_id, ()))
        for reservation in reservations:  # type: ignore[union-attr]
            self.on_reservation(reservation)
        if reservations:
            self.prefill_round()
        if drains:
            self._note_private_growth()
        if reservations or group.node.read_queue.tokens(now):
            self.report_changed(group)  # as the runtime's leaders keep pulling while anything changes

    def _note_private_growth(self) -> None:
        """Phase 1 drained the global queue: the groups whose private queue grew pull next."""
        private = self.core.dispatcher.decode_private
        grew = False
        for group in self.decode:
            queue = private.get(group.group_id)
            if queue is not None and len(queue) > group.private:
                group.work = grew = True
        if grew:
            self._decode_round(self.loop.now + self.pull_delay_s)

    def prefill_round(self) -> None:
        """Prefill leaders pull now (or after the pull delay): work appeared, or an engine lightened."""
        when = self.loop.now + self.pull_delay_s
        if self._prefill_round_at is None or self._prefill_round_at > when:
            self._prefill_round_at = when
            self.loop.at(when, self._run_prefill_round, when, late=True)

    def _run_prefill_round(self, when: float) -> None:
        if self._prefill_round_at != when:
            return
        self._prefill_round_at = None
        count = len(self.prefill)
        start = self._prefill_turn
        self._prefill_turn += 1
        for offset in range(count):
            if not self.core.dispatcher.prefill_queue:
                return
            group = self.prefill[(start + offset) % count]
            if any(engine.tok <= self.beta for engine in group.engines):
                self._pull_prefill(group)

    def _pull_prefill(self, group: Group) -> None:
        now = self.loop.now
        report = GroupReport(
            group.group_id, group.node.node_id, tuple(e.load() for e in group.engines),
            group.node.read_queue.tokens(now),
        )
        self.stats.prefill_pulls += 1
        tasks = self._timed(self.core.fetch_prefill, report)
        if tasks:
            self.on_tasks(tasks, now)  # type: ignore[arg-type]
