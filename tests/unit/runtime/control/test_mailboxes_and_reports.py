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


def test_the_read_queue_is_reported_once_at_start_then_only_when_it_changes_and_at_most_per_interval() -> None:
    value = [0]
    sent: list[int] = []
    done = threading.Event()

    def send(tokens: int) -> None:
        sent.append(tokens)
        done.set()

    reporter = QueueReporter(lambda: value[0], send, interval_s=0.2, name="q").start()
    assert done.wait(2.0) and sent == [0], "the first report goes out at start"
    time.sleep(0.5)
    assert sent == [0], "nothing changed: nothing is sent"
    for tokens in range(1, 51):  # a burst of block reads within one interval
        value[0] = tokens
        reporter.changed()
    time.sleep(0.7)
    assert sent[-1] == 50, "the last value of the burst is reported"
    assert len(sent) <= 3, f"a burst of 50 changes is at most two reports, not one per change: {sent}"
    reporter.changed()  # changed back and forth: the same value is not sent again
    time.sleep(0.3)
    assert sent[-1] == 50 and len(sent) <= 3, "an unchanged value is not sent"
    reporter.stop()
