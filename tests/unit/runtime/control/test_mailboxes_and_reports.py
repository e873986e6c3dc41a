"""Two small pieces of the event-driven control plane: finished turns waiting for their client
(runtime/control/mailboxes.py) and a reader's read queue told when it changes (runtime/reader/queue_reporter.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from dualpath_ray.runtime.control.mailboxes import Mailboxes
from dualpath_ray.protocol.messages import RequestSpec, SamplingParams, aborted_result
from dualpath_ray.runtime.reader.queue_reporter import QueueReporter


def result(rid: str):
    return aborted_result(RequestSpec(rid, 0, np.arange(4), SamplingParams(), "ns", 0.0))


def test_collect_returns_at_once_when_a_result_is_there_and_waits_for_the_first_otherwise() -> None:
    async def scenario() -> None:
        boxes = Mailboxes(expiry_s=60.0)
        boxes.deliver("c", result("a"))
        assert [r.request_id for r in await boxes.collect("c", 5.0)] == ["a"], "a waiting result comes back at once"
        waiting = asyncio.ensure_future(boxes.collect("c", 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done(), "with none there, collect waits"
        boxes.deliver("c", result("b"))
        assert [r.request_id for r in await waiting] == ["b"], "and returns as soon as one arrives"
        assert await boxes.collect("c", 0.01) == [], "after wait_s with none, it returns empty"

    asyncio.run(scenario())


def test_a_client_that_stopped_collecting_is_dropped_with_its_results() -> None:
    now = [0.0]
    boxes = Mailboxes(expiry_s=30.0, clock=lambda: now[0])
    boxes.deliver("gone", result("x"))
    now[0] = 31.0
    boxes.deliver("alive", result("y"))
    assert len(boxes) == 1 and boxes.dropped == 1, "the untouched mailbox and its result are gone; the other stays"


class SteppedInterval(threading.Condition):
    """The reporter's condition, with its rate-limit wait (`wait_for` with a timeout) ending only
    when the test says the interval passed (`tick`), not when the clock does: what is sent
    depends on the order of events, never on the machine's speed. Counts the interval waits."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.intervals = 0  # rate-limit waits begun

    def wait_for(self, predicate, timeout=None):  # type: ignore[no-untyped-def, override]
        if timeout is None:
            return super().wait_for(predicate)
        self.intervals += 1
        self.notify_all()
        until = self.ticks + 1
        return super().wait_for(lambda: predicate() or self.ticks >= until)

    def tick(self) -> None:
        with self:
            self.ticks += 1
            self.notify_all()

    def await_intervals(self, count: int) -> None:
        """Until the reporter began its count-th rate-limit wait (it sent or skipped before)."""
        with self:
            super().wait_for(lambda: self.intervals >= count)


def test_the_read_queue_is_reported_once_at_start_then_only_when_it_changes_and_at_most_per_interval() -> None:
    value = [0]
    sent: list[int] = []
    reporter = QueueReporter(lambda: value[0], sent.append, interval_s=0.2, name="q")
    pacing = reporter._cond = SteppedInterval()
    reporter.start()
    pacing.await_intervals(1)
    assert sent == [0], "the first report goes out at start"
    for tokens in range(1, 51):  # a burst of block reads within one interval
        value[0] = tokens
        reporter.changed()
    assert sent == [0], "within the interval after a report, nothing more is sent"
    pacing.tick()
    pacing.await_intervals(2)
    assert sent == [0, 50], f"a burst of 50 changes within one interval is one report, of its last value: {sent}"
    reporter.changed()  # changed back and forth: the same value is not sent again
    pacing.tick()
    pacing.await_intervals(3)
    assert sent == [0, 50], "an unchanged value is not sent"
    pacing.tick()  # the interval passes with nothing changed: the reporter waits for a change
    time.sleep(0.3)
    assert sent == [0, 50] and pacing.intervals == 3, "nothing changed: nothing is sent, no interval begins"
    reporter.stop()
