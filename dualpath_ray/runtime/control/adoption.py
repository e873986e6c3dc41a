"""What a restarted scheduler takes over from its dead incarnation.

Ray restarts the Scheduler actor (up to runtime.scheduler_max_restarts times) with an empty
state and resends the calls that were in flight (each up to runtime.max_call_resends times;
runtime/placement/topology.py, scheduler_options): every caller's `generate` comes again, and every
engine's unacknowledged reports are sent again on its report channel's next connection
(runtime/reporting/channel.py). The engines still hold the dead incarnation's attempts. The new incarnation (a
new epoch, so none of its attempts shares a name with an old one) asks every engine what it
holds before it serves anything:

- an attempt not handed off yet (a reservation, a queued prefill) is cancelled: it is cheap to
  redo, and its old decisions were made on loads the new scheduler does not know;
- every request some engine still holds is *adoptable*: its `generate` is not dispatched again
  while an engine holds it (one request never runs on two engines at once); it waits for the
  old attempt's result, which the engine reports to the new incarnation;
- an adoptable request that no engine names for the heartbeat grace was dropped (cancelled,
  or its engine died): it is dispatched afresh.

A result that arrives before its caller's resent `generate` is kept until the caller asks.
No Ray here: the Scheduler actor feeds heartbeat answers in and resolves futures.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dualpath_ray.protocol.messages import Holding, TurnResult


# Adopted results kept for a caller that has not asked again: at most this many, oldest first out.
MAX_UNCLAIMED = 65536


@dataclass
class Adoptions:
    """Requests of a dead incarnation that engines still hold. `unclaimed_ttl_s`: how long an
    adopted result waits for its caller's resent `generate` (the Scheduler gives the callers'
    deadline, runtime.request_timeout_s: a caller that has not asked by then never will)."""

    unclaimed_ttl_s: float = 600.0
    holders: dict[str, set[str]] = field(default_factory=dict)  # request id -> engines holding it
    waiting: dict[str, asyncio.Future[TurnResult | None]] = field(default_factory=dict)
    unclaimed: dict[str, TurnResult] = field(default_factory=dict)
    unclaimed_at: dict[str, float] = field(default_factory=dict)  # when each unclaimed result came
    unheld_since: dict[str, float] = field(default_factory=dict)
    adopted: int = 0
    dropped: int = 0
    expired: int = 0  # unclaimed results dropped (their caller never asked, or the cap)

    def learn(self, engine: str, holds: dict[str, Holding]) -> list[str]:
        """Record what `engine` holds at the restart; returns the owners to cancel there."""
        cancel = []
        for rid, holding in holds.items():
            self.holders.setdefault(rid, set()).add(engine)
            if not holding.handed_off:
                cancel.append(holding.owner(rid))
        return cancel

    def engines(self) -> set[str]:
        return set().union(*self.holders.values()) if self.holders else set()

    def adoptable(self, request_id: str) -> bool:
        return request_id in self.holders or request_id in self.unclaimed

    def claim(self, request_id: str) -> TurnResult | None:
        """The old attempt's result if it already arrived (and is then forgotten)."""
        self.unclaimed_at.pop(request_id, None)
        return self.unclaimed.pop(request_id, None)

    def wait_for(self, request_id: str) -> asyncio.Future[TurnResult | None]:
        """A future resolved with the old attempt's result, or None once it is dropped."""
        future: asyncio.Future[TurnResult | None] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        return future

    def deliver(self, result: TurnResult, now: float) -> bool:
        """An old attempt's result arrived: hand it to its waiting caller, or keep it until the
        caller's resent `generate` asks (for unclaimed_ttl_s at most). False when the request
        was not adoptable."""
        rid = result.request_id
        if rid not in self.holders:
            return False
        self.adopted += 1
        if not self._settle(rid, result):
            self.unclaimed[rid] = result
            self.unclaimed_at[rid] = now
        self.expire(now)
        return True

    def expire(self, now: float) -> None:
        """Drop the unclaimed results older than unclaimed_ttl_s, and the oldest past MAX_UNCLAIMED."""
        for rid, since in list(self.unclaimed_at.items()):  # in arrival order: the oldest first
            if now - since < self.unclaimed_ttl_s and len(self.unclaimed_at) <= MAX_UNCLAIMED:
                break
            del self.unclaimed_at[rid]
            self.unclaimed.pop(rid, None)
            self.expired += 1

    def check(self, held: dict[str, dict[str, Holding]], silent: set[str], now: float, grace_s: float) -> list[str]:
        """After a heartbeat round: drop the adoptable requests no engine has named for
        grace_s (their callers dispatch them afresh); returns them."""
        dropped = []
        for rid, engines in list(self.holders.items()):
            if engines & silent:
                continue
            if any(rid in held.get(engine, {}) for engine in engines):
                self.unheld_since.pop(rid, None)
            elif now - self.unheld_since.setdefault(rid, now) >= grace_s:
                dropped.append(rid)
        for rid in dropped:
            self.dropped += 1
            self._settle(rid, None)
        self.expire(now)
        return dropped

    def _settle(self, rid: str, outcome: TurnResult | None) -> bool:
        """`rid` is adoptable no more: its waiting caller (if any) gets `outcome`; whether there was one."""
        del self.holders[rid]
        self.unheld_since.pop(rid, None)
        future = self.waiting.pop(rid, None)
        if future is None or future.done():
            return False
        future.set_result(outcome)
        return True

    def forget(self, request_id: str) -> None:
        """The caller gave up (its deadline passed)."""
        self.waiting.pop(request_id, None)
