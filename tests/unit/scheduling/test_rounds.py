"""The event-driven rounds (scheduling/rounds.py) on a fake clock, as the runtime runs them: a
decision only when something happened, everything of one moment decided at once, nothing left
pending when nothing happens."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.protocol.messages import PeerState, PrefillTask, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.scheduling.rounds import Outputs, Rounds
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Mode, ReadPath

BLOCK = 16
BETA = 1000
INTERVAL = 0.05


class FakeTimers:
    """A clock that moves only when told; actions due run in (time, order) order."""

    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[Any], None], argument: Any) -> None:
        heapq.heappush(self._heap, (max(when, self.t), next(self._order), action, argument))

    def run(self, until: float | None = None) -> None:
        """Run what is due (up to `until`, default: now), moving the clock to each action."""
        limit = self.t if until is None else until
        while self._heap and self._heap[0][0] <= limit:
            when, _, action, argument = heapq.heappop(self._heap)
            self.t = when
            action(argument)
        self.t = max(self.t, limit)

    def pending(self) -> int:
        return len(self._heap)


@dataclass
class BookView:
    """A group reported from the core's own books, as the runtime's BookedGroup does."""

    group_id: str
    node_id: str
    engines: list[str]
    core: SchedulerCore
    decode: bool
    hbm: int = 4096
    asked: int = 0
    reader: PeerState = PeerState.ALIVE

    def loads(self) -> tuple[EngineLoad, ...]:
        book = self.core.dispatcher.decode_book if self.decode else self.core.dispatcher.prefill_book
        return tuple(EngineLoad(e, self.node_id, book.seq(e), book.tok(e), self.hbm - book.tok(e) if self.decode else 0)
                     for e in self.engines)

    def read_q(self, now: float) -> int | None:
        self.asked += 1
        return None

    def reader_state(self) -> PeerState:
        return self.reader


@dataclass
class Setup:
    timers: FakeTimers
    core: SchedulerCore
    rounds: Rounds
    tasks: list[list[PrefillTask]] = field(default_factory=list)


def setup(prefill_nodes: int = 2, decode_nodes: int = 2) -> Setup:
    core = SchedulerCore(CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, BETA), decode_groups=decode_nodes),
                         PrefixIndex(BLOCK))
    timers = FakeTimers()
    prefill = [BookView(f"prefill/p{n}", f"p{n}", [f"prefill/p{n}/g{g}" for g in range(2)], core, False)
               for n in range(prefill_nodes)]
    decode = [BookView(f"decode/d{n}", f"d{n}", [f"decode/d{n}/g{g}" for g in range(2)], core, True)
              for n in range(decode_nodes)]
    made = Setup(timers, core, None)  # type: ignore[arg-type]
    made.rounds = Rounds(timers, core, prefill, decode, 0.0, INTERVAL, BETA,
                         Outputs(on_tasks=lambda tasks, now: made.tasks.append(list(tasks))))
    made.rounds.start()
    return made


def spec(rid: str, tokens: int = 40) -> RequestSpec:
    prompt = np.random.default_rng(len(rid)).integers(0, 512, tokens)
    return RequestSpec(rid, 0, prompt, SamplingParams(max_new_tokens=8), "ns", 0.0, epoch=1)


def result_of(task: PrefillTask) -> TurnResult:
    s = task.request
    return TurnResult(s.request_id, s.attempt, (1,), (0.0,), "length", len(s.prompt), 0, ReadPath.PE,
                      task.prefill_engine, task.decode_engine, 0.1, 0.01, epoch=s.epoch)


def test_nothing_is_pending_while_nothing_happens() -> None:
    made = setup()
    made.timers.run(until=10.0)
    assert made.timers.pending() == 0, "an idle scheduler has no timer armed: nothing polls"
    assert made.tasks == [], "and nothing was decided"


def test_a_moments_submissions_are_decided_in_one_round_and_pushed_once_per_group() -> None:
    made = setup()
    for i in range(6):
        made.rounds.submit(spec(f"r{i}"))
    assert made.tasks == [], "nothing is decided inside the submitting call: the round runs after the moment"
    made.timers.run()
    placed = [task.request_id for tasks in made.tasks for task in tasks]
    assert sorted(placed) == [f"r{i}" for i in range(6)], "every submitted request got a prefill engine in that round"
    assert len(made.tasks) <= 2, "one output per prefill group asked, not one per request"
    made.core.dispatcher.check_integrity()


def test_a_handoff_lightens_its_prefill_engine_and_asks_the_prefill_groups_again() -> None:
    made = setup(prefill_nodes=1)
    for i in range(6):
        made.rounds.submit(spec(f"big{i}", tokens=BETA - 100))  # two of them take an engine past beta
    made.timers.run()
    first = [t for tasks in made.tasks for t in tasks]
    assert len(first) == 4, f"prefill engines past beta take nothing more (class C1): {[t.request_id for t in first]}"
    made.tasks.clear()
    made.rounds.handed_off(first[0].request_id)
    made.timers.run()
    assert [t for tasks in made.tasks for t in tasks], "the lightened engine was given the next waiting request"


def test_a_finished_turn_frees_its_decode_engine_and_what_waited_for_it_is_placed() -> None:
    made = setup(decode_nodes=1)
    hbm_requests = [spec(f"r{i}", tokens=2000) for i in range(6)]  # 2000 + 8 tokens: two fit one engine of 4096
    for s in hbm_requests:
        made.rounds.submit(s)
    made.timers.run()
    placed = [t for tasks in made.tasks for t in tasks]
    assert len(placed) == 4, "two decode engines of 4096 tokens hold four such requests"
    for task in placed[:2]:
        made.rounds.handed_off(task.request_id)
        made.rounds.finish(result_of(task), "decode/d0")
    made.tasks.clear()
    made.timers.run()
    assert len([t for tasks in made.tasks for t in tasks]) == 2, "the freed HBM took the two that waited"
    made.core.dispatcher.check_integrity()


def test_a_decode_group_reports_again_at_most_once_per_interval() -> None:
    made = setup(decode_nodes=1)
    view = made.rounds.decode[0].view
    asked = view.asked  # type: ignore[attr-defined]
    for _ in range(5):
        made.rounds.report_changed("decode/d0")
    made.timers.run(until=INTERVAL / 2)
    assert view.asked == asked, "a change is not reported before the interval since the last report"  # type: ignore[attr-defined]
    made.timers.run(until=INTERVAL * 1.5)
    assert view.asked - asked <= 2, "five changes within an interval make one report"  # type: ignore[attr-defined]
    made.timers.run(until=10.0)
    assert made.timers.pending() == 0, "and nothing stays armed afterwards"


def test_everything_changed_asks_every_group() -> None:
    made = setup()
    made.rounds.submit(spec("a"))
    made.timers.run()
    pulls = made.rounds.stats.decode_pulls, made.rounds.stats.prefill_pulls
    made.rounds.everything_changed()
    made.timers.run()
    assert made.rounds.stats.decode_pulls >= pulls[0] + 2, "every decode group was asked again"
    made.timers.run(until=made.timers.t + 1.0)
    assert made.timers.pending() == 0, "nothing polls afterwards (a group that placed reports once more, then sleeps)"


def test_a_decode_group_that_takes_no_work_does_not_strand_the_global_queue() -> None:
    made = setup(prefill_nodes=1, decode_nodes=2)
    made.rounds.submit(spec("first"))  # served before the death: the first spread is behind us
    made.timers.run()
    (first,) = made.tasks.pop()
    made.rounds.finish(result_of(first), None)
    dead = made.rounds.decode[made.rounds._decode_turn % 2].view
    dead.reader = PeerState.DEAD  # the group next in phase 1's rotation lost its reader for good
    for engine in dead.engines:
        made.core.engine_died(engine)
    made.rounds.submit(spec("r"))
    made.timers.run()
    placed = [task for tasks in made.tasks for task in tasks]
    assert [t.request_id for t in placed] == ["r"], "the same round asks the next group, which places it"
    assert placed[0].decode_node != dead.node_id, "on the group that takes work"
    assert not made.core.dispatcher.decode_waiting(), "nothing is left in any decode queue"
