"""The reader actor's timer for staged extents: sleeps until the earliest deadline, then expires.

No polling: with nothing staged no timer runs. Each accepted StageOrder reports its deadline
(`scheduled`); a deadline earlier than the one the timer sleeps for restarts it, a later one is
left for the expiry run, which returns the next deadline and sleeps again until then. An expiry
run that raises is logged and tried again `retry_s` later: the deadlines it would have returned
are unknown, and a timer that stopped would hold every staged extent until the next order.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

LOG = logging.getLogger("dualpath_ray.reader")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


def thread_timer(delay_s: float, fire: Callable[[], None]) -> Cancellable:
    """A daemon threading.Timer, started: the default way ExpiryTimer sleeps."""
    timer = threading.Timer(delay_s, fire)
    timer.daemon = True
    timer.name = "staged-expiry"
    timer.start()
    return timer


class ExpiryTimer:
    """Calls `expire(now)` (which frees what is due and returns the next deadline, or None) at
    each deadline. `clock` is the clock the deadlines are on (time.monotonic on the actor)."""

    def __init__(
        self, expire: Callable[[float], float | None], clock: Callable[[], float],
        start_timer: Callable[[float, Callable[[], None]], Cancellable] = thread_timer, retry_s: float = 1.0,
    ) -> None:
        self.expire = expire
        self.clock = clock
        self.start_timer = start_timer
        self.retry_s = retry_s
        self.failures = 0  # expiry runs that raised (each logged, then retried)
        self._lock = threading.Lock()
        self._target: float | None = None  # the deadline the running timer sleeps for
        self._timer: Cancellable | None = None
        self._armed = 0  # which arming the running timer is: a superseded one's fire is ignored
        self._closed = False

    def scheduled(self, deadline: float) -> None:
        """A staged extent is due at `deadline`: sleep until then unless already due earlier."""
        with self._lock:
            if self._closed or (self._target is not None and self._target <= deadline):
                return
            if self._timer is not None:
                self._timer.cancel()
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        """Start the timer for `deadline` (caller holds the lock)."""
        self._target = deadline
        self._armed += 1
        armed = self._armed
        self._timer = self.start_timer(max(0.0, deadline - self.clock()), lambda: self._fire(armed))

    def _fire(self, armed: int) -> None:
        with self._lock:
            if self._closed or self._armed != armed or self._target is None:
                return  # superseded (a cancelled timer may still fire) or closed
            self._target = self._timer = None
        try:
            following = self.expire(self.clock())
        except Exception:  # noqa: BLE001 - the timer's thread must not die with it: retried
            self.failures += 1
            LOG.exception("staged-extent expiry failed; trying again in %.1f s", self.retry_s)
            following = self.clock() + self.retry_s
        if following is not None:
            self.scheduled(following)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            self._target = self._timer = None
