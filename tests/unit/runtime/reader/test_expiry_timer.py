"""ExpiryTimer (runtime/reader/expiry_timer.py): sleeps until the earliest staged deadline, never
when nothing is staged; an earlier deadline restarts it. Timers are fakes the test fires."""

from __future__ import annotations

from typing import Callable

from dualpath_ray.runtime.reader.expiry_timer import ExpiryTimer


class FakeTimers:
    """Started timers as (delay, fire, cancelled?) records; the test fires them by hand."""

    def __init__(self) -> None:
        self.started: list[list[object]] = []

    def start(self, delay_s: float, fire: Callable[[], None]) -> "FakeTimers.Handle":
        record: list[object] = [delay_s, fire, False]
        self.started.append(record)
        return FakeTimers.Handle(record)

    class Handle:
        def __init__(self, record: list[object]) -> None:
            self.record = record

        def cancel(self) -> None:
            self.record[2] = True

    def fire_next(self) -> None:
        """Fire the one live timer (it is spent after)."""
        (record,) = self.live()
        record[2] = True
        record[1]()  # type: ignore[operator]

    def live(self) -> list[list[object]]:
        return [r for r in self.started if not r[2]]


def test_the_timer_sleeps_until_the_earliest_deadline_and_follows_the_next_one() -> None:
    now = [100.0]
    deadlines: list[float] = []  # what the fake expire reports as still staged
    expired_at: list[float] = []

    def expire(t: float) -> float | None:
        expired_at.append(t)
        deadlines[:] = [d for d in deadlines if d > t]
        return min(deadlines) if deadlines else None

    timers = FakeTimers()
    timer = ExpiryTimer(expire, lambda: now[0], timers.start)
    assert timers.started == [], "nothing staged: no timer runs (no polling)"
    deadlines.append(110.0)
    timer.scheduled(110.0)
    assert [r[0] for r in timers.live()] == [10.0], "it sleeps exactly until the deadline"
    deadlines.append(120.0)
    timer.scheduled(120.0)
    assert len(timers.started) == 1, "a later deadline does not restart it"
    deadlines.append(105.0)
    timer.scheduled(105.0)
    assert [r[0] for r in timers.live()] == [5.0] and timers.started[0][2], "an earlier deadline restarts it"
    now[0] = 105.0
    timers.fire_next()
    assert expired_at == [105.0], "at the deadline it expires, with the clock's time"
    assert [r[0] for r in timers.live()] == [5.0], "then sleeps until the next deadline (110)"
    timers.started[0][1]()  # type: ignore[operator]
    assert expired_at == [105.0], "a superseded timer's fire does nothing"
    now[0] = 110.0
    timers.fire_next()
    now[0] = 120.0
    timers.fire_next()
    assert expired_at == [105.0, 110.0, 120.0] and timers.live() == [], "nothing left: no timer runs"
    timer.scheduled(130.0)
    timer.close()
    assert timers.live() == [], "close cancels the running timer"
    timer.scheduled(140.0)
    assert timers.live() == [], "a closed timer starts no other"


def test_an_expiry_run_that_raises_is_logged_and_retried_and_the_timer_goes_on(caplog) -> None:
    """A raising expire must not stop the timer (its thread would die with it, and every staged
    extent would be held until the next order): it is logged, counted, and run again retry_s later."""
    now = [100.0]
    runs: list[float] = []

    def expire(t: float) -> float | None:
        runs.append(t)
        if len(runs) == 1:
            raise RuntimeError("expiry bug")
        return 130.0 if t < 130.0 else None

    timers = FakeTimers()
    timer = ExpiryTimer(expire, lambda: now[0], timers.start)  # retry_s: 1.0 by default
    timer.scheduled(110.0)
    now[0] = 110.0
    with caplog.at_level("ERROR", logger="dualpath_ray.reader"):
        timers.fire_next()  # raises inside: must not escape the timer's thread
    assert timer.failures == 1 and "expiry failed" in caplog.text, "the failure is counted and logged"
    assert [r[0] for r in timers.live()] == [timer.retry_s], "and the timer sleeps retry_s, then runs the expiry again"
    now[0] = 112.0
    timers.fire_next()
    assert runs == [110.0, 112.0], "the retry expires with the clock's time"
    assert [r[0] for r in timers.live()] == [18.0], "then follows the next deadline it returned (130) as usual"
    now[0] = 130.0
    timers.fire_next()
    assert runs[-1] == 130.0 and timers.live() == [], "and stops once nothing is staged"
