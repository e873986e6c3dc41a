"""Engine groups: one group per node, whose first live engine is the leader.

The leader pulls work for its whole group: it gathers its members' load reports and its node's
read queue, calls the scheduler's fetch, and hands each assignment to the engine it names.
Members answer `load` and take work on their `control` concurrency group, so a member busy
computing still answers at once.

Every member runs the loop; all but the leader stand by, checking that the members before them
are alive, so when g0 dies g1 takes over the pulls. A member Ray reports dead (or whose worker
loop died) is written off: left out of the reports and passed over as leader. It is still asked
at every check (a call to an actor gone for good fails at once), because Ray may restart it: its
new incarnation answers, is taken back into the reports, and takes the lead back if it is first,
so a group never has two leaders counting its free HBM. One that is only slow is left out of the
reports it misses and replaced as leader after TAKEOVER_MISSES checks in a row. A failed pull is
counted and retried: one bad item never ends a group's pulls.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

import ray
import ray.exceptions

from dualpath_ray.faults.injector import FaultInjector, InjectedFault
from dualpath_ray.faults.plan import CallPhase

from dualpath_ray.runtime.messages import GroupReport, LoadReport, PeerState
from dualpath_ray.runtime.restarts import peer_state_of
from dualpath_ray.scheduling.types import Role
from dualpath_ray.runtime.transport import PeerDiedError


# How often a standby member checks whether the members before it are still alive.
STANDBY_S = 0.5
# Checks in a row a slow (not dead) member may miss before a standby takes over from it: on a
# loaded host one answer can take longer than member_timeout_s, and two leaders of one group
# would count its free HBM twice.
TAKEOVER_MISSES = 3


class ActorDirectory:
    """Named actors of one namespace, looked up once and cached."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        """The handle of `name`; PeerDiedError when no such actor lives (any more)."""
        if name not in self._handles:
            try:
                self._handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError as exc:
                raise PeerDiedError(f"{name}: no live actor of that name in {self.namespace!r} ({exc})") from None
        return self._handles[name]


class GroupLeader:
    """The pull loop of one engine group, run on a thread of the leader engine."""

    def __init__(
        self,
        role: Role,
        node_id: str,
        members: list[str],
        reader: str,
        directory: ActorDirectory,
        local_name: str,
        local_load: Callable[[], LoadReport],
        local_accept: Callable[[list[Any]], None],
        interval_s: float,
        wait_s: float = 0.0,
        member_timeout_s: float = 10.0,
        faults: FaultInjector | None = None,
    ) -> None:
        self.role = role
        self.node_id = node_id
        self.members = members
        self.reader = reader
        self.directory = directory
        self.local_name = local_name
        self.local_load = local_load
        self.local_accept = local_accept
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.member_timeout_s = member_timeout_s
        self.dead: set[str] = set()  # written off: proven dead, until an answer proves a restart
        self.leading = False
        self.misses: dict[str, int] = {}
        self.faults = faults
        self.failed_pulls = 0
        self.last_failure = ""

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                if not self.leads():
                    self.stopped.wait(STANDBY_S)
                    continue
                # The scheduler holds an empty fetch up to wait_s until new work may exist, so
                # an idle group does not poll; interval_s only spaces pulls that found nothing.
                if not self._pull_guarded():
                    self.stopped.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the engine's health()
            if not self.stopped.is_set():
                self.error = exc

    def _pull_guarded(self) -> bool:
        try:
            return self.pull_once()
        except Exception as exc:  # noqa: BLE001 - counted; the next pull starts afresh
            self.failed_pulls += 1
            self.last_failure = repr(exc)
            self.stopped.wait(min(1.0, self.interval_s * 2 ** min(self.failed_pulls, 10)))
            return False

    def leads(self) -> bool:
        """Whether every member before this one is written off, or silent too long."""
        self.leading = not any(self._answers(m) for m in self.members[: self.members.index(self.local_name)])
        return self.leading

    def _answers(self, member: str) -> bool:
        """Whether `member` is taken for alive: it answered (a written-off member that answers
        is a restarted one, taken back), or it is only slow and has missed fewer than
        TAKEOVER_MISSES checks in a row."""
        try:
            ray.get(self.directory.get(member).load.remote(), timeout=self.member_timeout_s)
        except Exception as exc:  # noqa: BLE001 - dead, hung, gone, or its worker loop died
            return not self._note_silence(member, exc) and self.misses[member] < TAKEOVER_MISSES
        self._heard_from(member)
        return True

    def _heard_from(self, member: str) -> None:
        self.misses.pop(member, None)
        self.dead.discard(member)

    def _note_silence(self, member: str, exc: BaseException) -> bool:
        """Record an unanswered call; True when `member` is written off: the call proves it
        dead (gone, or its worker loop died: `load` raises), or it was written off already and
        has not answered since. A timeout, or Ray restarting a member in service, is a miss, not
        a death. Only an answer takes a written-off member back (`_heard_from`)."""
        if member in self.dead or peer_state_of(exc) is PeerState.DEAD:
            self.dead.add(member)  # written off until it answers again
            return True
        self.misses[member] = self.misses.get(member, 0) + 1
        return False

    def report(self) -> GroupReport:
        """The group's loads, read queue and incarnations. A member that does not answer in time
        is left out of this report only (nothing is placed on it meanwhile); one written off is
        asked too, and is back in the report once it answers (Ray restarted it)."""
        others = [m for m in self.members if m != self.local_name]
        refs = {}
        for member in others:
            try:
                refs[member] = self.directory.get(member).load_report.remote()
            except PeerDiedError:
                self.dead.add(member)
        read_q_ref = self.directory.get(self.reader).queue_report.remote()
        answers = [(self.local_name, self.local_load())]
        for member, ref in refs.items():
            try:
                answers.append((member, ray.get(ref, timeout=self.member_timeout_s)))
                self._heard_from(member)
            except Exception as exc:  # noqa: BLE001 - dead, hung, restarting, or its worker loop died
                self._note_silence(member, exc)
        incarnations = [(member, answer.incarnation) for member, answer in answers]
        try:
            reader_incarnation, read_q = ray.get(read_q_ref, timeout=self.member_timeout_s)
            reader_state = PeerState.ALIVE
            incarnations.append((self.reader, reader_incarnation))
        except Exception as exc:  # noqa: BLE001 - reported; the scheduler routes around the reader
            read_q, reader_state = 0, peer_state_of(exc)
        return GroupReport(
            f"{self.role}/{self.node_id}", self.node_id, tuple(answer.load for _, answer in answers), read_q,
            reader_state, tuple(incarnations),
        )

    def pull_once(self) -> bool:
        """One fetch; True when something was assigned."""
        scheduler = self.directory.get("scheduler")
        report = self.report()
        self._lose("fetch", CallPhase.REQUEST)
        if self.role == "prefill":
            work = ray.get(scheduler.fetch_prefill.remote(report, self.wait_s))
            by_engine = _group_by(work, lambda task: task.prefill_engine)
        else:
            work = ray.get(scheduler.fetch_decode.remote(report, self.wait_s))
            by_engine = _group_by(work, lambda reservation: reservation.decode_engine)
        # A lost reply loses the assignments with it: the scheduler's heartbeat finds attempts
        # that no engine holds and retries them.
        self._lose("fetch", CallPhase.RESPONSE)
        pending = []
        for engine, items in by_engine.items():
            if engine == self.local_name:
                self.local_accept(items)
            elif not (self.faults and self.faults.fail_call("accept", CallPhase.REQUEST)):
                pending.append((engine, self.directory.get(engine).accept.remote(items)))
        # Reservations must be in place before the next report, or free HBM is counted twice.
        # An accept that is only slow stays in flight; one whose engine died loses its requests
        # with it, and the scheduler's heartbeat fails and retries them.
        for engine, ref in pending:
            try:
                ray.get(ref, timeout=self.member_timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                self._note_silence(engine, exc)
        return bool(work)


    def _lose(self, method: str, phase: CallPhase) -> None:
        if self.faults is not None and self.faults.fail_call(method, phase):
            raise InjectedFault("actor_call", f"{method} {phase.value} lost")


def _group_by(items: list[Any], key: Callable[[Any], str]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = defaultdict(list)
    for item in items:
        grouped[key(item)].append(item)
    return grouped


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread

