"""Attempts cancelled before they reached an engine.

The scheduler cancels an attempt at its engines when it fails (a lost task, a deadline, a dead
peer). The cancel and the attempt's way to the engine (the scheduler's `accept` push to its
prefill engine, the prefill engine's handoff to its decode engine) travel on different calls, so
the cancel can arrive first: without a record of it, the late accept would lease buffer extents,
or the late handoff reserve HBM pages, for an attempt nobody will ever finish, and those would be
lost for good. An engine records every cancel here, refuses the accept that follows one, and
drops a handoff of a cancelled attempt at once (freeing its extent).

A record is kept for `horizon_s` (the longest an accept can still be on its way: the request
deadline), so the table stays bounded however many cancels find nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from dualpath_ray.runtime.engine.ports import Clock


class CancelledAttempts:
    """Owners ("request#attempt") cancelled before they arrived, with when."""

    def __init__(self, horizon_s: float, clock: Clock) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive (got {horizon_s})")
        self.horizon_s = horizon_s
        self.clock = clock
        self._since: OrderedDict[str, float] = OrderedDict()

    def add(self, owner: str) -> None:
        now = self.clock.now()
        self._since[owner] = now
        self._since.move_to_end(owner)
        self._prune(now)

    def __contains__(self, owner: object) -> bool:
        return owner in self._since

    def __len__(self) -> int:
        return len(self._since)

    def _prune(self, now: float) -> None:
        while self._since:
            owner, since = next(iter(self._since.items()))
            if now - since < self.horizon_s:
                return
            del self._since[owner]
