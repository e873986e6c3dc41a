"""When the scheduler decides: the event-driven rounds both the runtime and the simulator run.

The scheduler core (scheduling/scheduler.py) decides *what* a decode or prefill group gets when
it is asked with the group's report; this module decides *when* each group is asked. Nothing
polls: a group is asked only when something happened that can change its answer, so an idle
cluster costs nothing and a busy one is asked exactly as often as decisions are possible.

- submit: a decode round (after `pull_delay_s`) places what waits. One group, in rotation,
  drains the global decode queue into the groups' private queues (phase 1); every group whose
  private queue grew or whose HBM was freed while requests wait for it then places (phase 2).
- a decode placement, a handoff (a prefill engine lightened) or a finished turn with requests
  still queued for prefill: a prefill round asks the prefill groups in rotation while requests
  remain; a group none of whose engines is at or under beta is skipped (the core would give it
  nothing: class C1).
- a decode group whose loads or node read queue changed is asked again at most
  `report_interval_s` after its last report, so the read-path choice compares fresh queues.

Reports come from `GroupView`s (the runtime: the scheduler's records of its own assignments and
the readers' queue reports; the simulator: its simulated engines and nodes), and time from a
`Timers` port (the runtime: the actor's event loop; the simulator: its discrete-event clock).
An action scheduled with `Timers.at` runs after everything else due at that moment, so a round
sees every event of its moment at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from dualpath_ray.protocol.messages import DecodeReservation, GroupReport, PeerState, PrefillTask, RequestSpec, TurnResult
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import SchedulerCore


class Timers(Protocol):
    def now(self) -> float:
        """The clock the rounds' times are on (seconds)."""

    def at(self, when: float, action: Callable[[Any], None], argument: Any) -> None:
        """Run action(argument) at `when` (now if it is past), after everything else due then."""


class GroupView(Protocol):
    """One engine group (one node) as the rounds report it to the core."""

    group_id: str
    node_id: str

    def loads(self) -> tuple[EngineLoad, ...]:
        """Its engines' loads now."""

    def read_q(self, now: float) -> int | None:
        """Its node's storage read queue in tokens; None when nothing new is known since the
        last report (the core then keeps its own count, which includes what it assigned since)."""

    def reader_state(self) -> PeerState:
        """What is known of its node's storage reader."""


@dataclass
class RoundStats:
    cpu_s: float = 0.0  # process time inside the scheduler core's calls
    calls: int = 0
    decode_pulls: int = 0
    prefill_pulls: int = 0


@dataclass(eq=False)
class _Pulls:
    """The rounds' bookkeeping of one group."""

    view: GroupView
    last_report: float = -1.0
    refresh_at: float | None = None  # a report is due then (its loads or read queue changed)
    work: bool = False  # it may place something now (decode: HBM freed or its private queue grew)
    private: int = 0  # its private queue's length after its last pull (decode)


@dataclass
class Outputs:
    """Where decisions go: each reservation as it is made, each prefill group's tasks at once,
    and how long each ask of the core took (role, seconds; for the decision-time metric)."""

    on_reservation: Callable[[DecodeReservation], None] = lambda reservation: None
    on_tasks: Callable[[list[PrefillTask], float], None] = lambda tasks, now: None
    on_decided: Callable[[str, float], None] | None = None


class Rounds:
    def __init__(
        self, timers: Timers, core: SchedulerCore, prefill: Sequence[GroupView], decode: Sequence[GroupView],
        pull_delay_s: float, report_interval_s: float, beta: int, outputs: Outputs | None = None,
    ) -> None:
        self.timers = timers
        self.core = core
        self.prefill = [_Pulls(view) for view in prefill]
        self.decode = [_Pulls(view) for view in decode]
        self._decode_by_group = {pulls.view.group_id: pulls for pulls in self.decode}
        self._decode_by_node = {pulls.view.node_id: pulls for pulls in self.decode}
        self.pull_delay_s = pull_delay_s
        self.report_interval_s = report_interval_s
        self.beta = beta
        self.outputs = outputs or Outputs()
        self.stats = RoundStats()
        self._decode_round_at: float | None = None
        self._prefill_round_at: float | None = None
        self._decode_turn = 0
        self._prefill_turn = 0

    # --- calls into the core, timed --------------------------------------------------------

    def _timed(self, call: Callable[..., Any], *args: object) -> Any:
        started = time.process_time()
        try:
            return call(*args)
        finally:
            self.stats.cpu_s += time.process_time() - started
            self.stats.calls += 1

    def _decide(self, role: str, call: Callable[..., Any], report: GroupReport) -> Any:
        """One ask of the core for a group (timed as `_timed`; its wall time to on_decided)."""
        if self.outputs.on_decided is None:
            return self._timed(call, report)
        started = time.perf_counter()
        decided = self._timed(call, report)
        self.outputs.on_decided(role, time.perf_counter() - started)
        return decided

    def start(self) -> None:
        """Ask every group once, before any request arrives: phase 1 spreads the queue over the
        decode groups that have reported, so without it a burst at t=0 all went to the first
        group asked (48P96D: every agent's first turn on one decode node, the last of them
        placed after 354 s)."""
        for pulls in self.decode:
            self._pull_decode(pulls)
        for pulls in self.prefill:
            self._pull_prefill(pulls)

    def submit(self, spec: RequestSpec) -> Request:
        request = self._timed(self.core.submit, spec)
        self._decode_round(self.timers.now() + self.pull_delay_s)
        return request

    def handed_off(self, request_id: str) -> bool:
        """A prefill engine handed the request to its decode engine; prefill groups are asked
        again while requests wait for them (that engine is lighter now)."""
        changed = self._timed(self.core.handed_off, request_id)
        if changed and self.core.dispatcher.prefill_queue:
            self.prefill_round()
        return changed

    def finish(self, result: TurnResult, group_id: str | None) -> tuple[str, ...]:
        """Record a finished turn (see SchedulerCore.finish; its answer is returned). Its decode
        group (when known) reports again, and places at once if requests wait for its HBM."""
        holders = self._timed(self.core.finish, result)
        pulls = self._decode_by_group.get(group_id) if group_id is not None else None
        if pulls is not None:
            if self.core.dispatcher.decode_private.get(pulls.view.group_id):
                pulls.work = True  # its HBM was freed and requests wait for it
            self._report_changed(pulls)
        self._decode_round(self.timers.now() + self.pull_delay_s)
        if self.core.dispatcher.prefill_queue:
            self.prefill_round()  # waiters it released (scheduling/sharing.py), or what an engine freed
        return holders

    def prompt_persisted(self, request_id: str) -> None:
        """A request's prompt blocks are stored before its turn ends (SchedulerCore.prompt_persisted):
        the requests that waited for them are placed."""
        self._timed(self.core.prompt_persisted, request_id)
        if self.core.dispatcher.prefill_queue:
            self.prefill_round()

    def everything_changed(self) -> None:
        """Engines or readers came or went (a death, a restart, a reader routed around): every
        group is asked again, decode first."""
        for pulls in self.decode:
            pulls.work = True
        self._decode_round(self.timers.now() + self.pull_delay_s)
        self.prefill_round()

    # --- when groups are asked -------------------------------------------------------------

    def read_queue_changed(self, node_id: str) -> None:
        pulls = self._decode_by_node.get(node_id)
        if pulls is not None:
            self._report_changed(pulls)

    def report_changed(self, group_id: str) -> None:
        """A decode group's loads changed: it reports again within the interval."""
        self._report_changed(self._decode_by_group[group_id])

    def _report_changed(self, pulls: _Pulls) -> None:
        if pulls.refresh_at is not None:
            return
        pulls.refresh_at = max(self.timers.now() + self.pull_delay_s, pulls.last_report + self.report_interval_s)
        self.timers.at(pulls.refresh_at, self._refresh, pulls)

    def _refresh(self, pulls: _Pulls) -> None:
        if pulls.refresh_at is not None and pulls.refresh_at <= self.timers.now():
            self._pull_decode(pulls)

    def _decode_round(self, when: float) -> None:
        if self._decode_round_at is None or self._decode_round_at > when:
            self._decode_round_at = when
            self.timers.at(when, self._run_decode_round, when)

    def _run_decode_round(self, when: float) -> None:
        if self._decode_round_at != when:
            return
        self._decode_round_at = None
        # Phase 1 is run by the next group in rotation; one that takes no work (its reader is
        # down) drains nothing, so the next one is asked in the same round. Asking only one left
        # the queue waiting for a trigger that, once the last turn in flight ended, never came
        # (a decode node's reader killed mid-rollout: the CI hang of 727ecd8).
        for _ in range(len(self.decode)):
            if not self.core.dispatcher.decode_global:
                break
            self._pull_decode(self.decode[self._decode_turn % len(self.decode)])
            self._decode_turn += 1
        for pulls in self.decode:
            if pulls.work:
                self._pull_decode(pulls)

    def _report(self, pulls: _Pulls, now: float) -> GroupReport:
        view = pulls.view
        return GroupReport(view.group_id, view.node_id, view.loads(), view.read_q(now), view.reader_state())

    def _pull_decode(self, pulls: _Pulls) -> None:
        now = self.timers.now()
        dispatcher = self.core.dispatcher
        drains = bool(dispatcher.decode_global)
        pulls.work = False
        pulls.refresh_at = None
        pulls.last_report = now
        report = self._report(pulls, now)
        self.stats.decode_pulls += 1
        reservations = self._decide("decode", self.core.fetch_decode, report)
        pulls.private = len(dispatcher.decode_private.get(pulls.view.group_id, ()))
        for reservation in reservations:
            self.outputs.on_reservation(reservation)
        if reservations:
            self.prefill_round()
        if drains:
            self._note_private_growth()
        if reservations or pulls.view.read_q(now):
            self._report_changed(pulls)  # it reports again while anything changes

    def _note_private_growth(self) -> None:
        """Phase 1 drained the global queue: the groups whose private queue grew place next."""
        private = self.core.dispatcher.decode_private
        grew = False
        for pulls in self.decode:
            queue = private.get(pulls.view.group_id)
            if queue is not None and len(queue) > pulls.private:
                pulls.work = grew = True
        if grew:
            self._decode_round(self.timers.now() + self.pull_delay_s)

    def prefill_round(self) -> None:
        """Prefill groups are asked now (or after the pull delay): work appeared, or an engine lightened."""
        when = self.timers.now() + self.pull_delay_s
        if self._prefill_round_at is None or self._prefill_round_at > when:
            self._prefill_round_at = when
            self.timers.at(when, self._run_prefill_round, when)

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
            pulls = self.prefill[(start + offset) % count]
            if any(load.tok <= self.beta for load in pulls.view.loads()):
                self._pull_prefill(pulls)

    def _pull_prefill(self, pulls: _Pulls) -> None:
        now = self.timers.now()
        self.stats.prefill_pulls += 1
        tasks = self._decide("prefill", self.core.fetch_prefill, self._report(pulls, now))
        if tasks:
            self.outputs.on_tasks(tasks, now)


@dataclass
class EventTimers:
    """`Timers` on a discrete-event loop with `now` and `at(when, action, argument, late=...)`."""

    loop: Any
    late: bool = field(default=True)

    def now(self) -> float:
        return self.loop.now

    def at(self, when: float, action: Callable[[Any], None], argument: Any) -> None:
        self.loop.at(when, action, argument, late=self.late)
