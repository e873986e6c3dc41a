"""What callers aborted: single requests in flight, and whole trajectories (request id prefixes).

Pure bookkeeping for the Scheduler actor. A request is aborted while its `generate` runs (an
attempt in flight or between attempts); a prefix (`"traj7/"`) aborts every request of that
trajectory in flight and refuses later ones until it is cleared (or refused none for
runtime.session_ttl_s), so a turn that finished just before the abort cannot start the next
turn of an aborted trajectory.
"""

from __future__ import annotations

import time
from typing import Callable

from dualpath_ray.config.sections import IDLE_TTL_DEFAULT_S
from dualpath_ray.scheduling.expiry import IdleExpiry


class Aborts:
    """`prefixes` are the aborted trajectories' marks. A mark that refuses no turn for `ttl_s`
    (runtime.session_ttl_s) is forgotten, so marks of trajectories that never come back do not
    pile up; each turn a mark refuses keeps it another `ttl_s`."""

    def __init__(self, ttl_s: float = IDLE_TTL_DEFAULT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.running: set[str] = set()  # request ids whose generate runs
        self.aborted: set[str] = set()  # of those, the ones their callers aborted
        self.prefixes = IdleExpiry(ttl_s, clock)  # trajectories aborted (until cleared or idle for ttl_s)
        self.count = 0

    def start(self, request_id: str) -> bool:
        """A generate begins; False when its trajectory was aborted (it must not run)."""
        self.prefixes.sweep()
        prefix = self._mark_of(request_id)
        if prefix is not None:
            self.prefixes.touch(prefix)  # the trajectory is still being refused: keep its mark
            return False
        self.running.add(request_id)
        return True

    def _mark_of(self, request_id: str) -> str | None:
        """The mark that refuses `request_id`, if any: by looking up each prefix of the id when
        there are more marks than characters in it, so a start costs at most O(len(id)) lookups
        however many trajectories are aborted."""
        if len(self.prefixes) > len(request_id):
            return next((request_id[:end] for end in range(1, len(request_id) + 1)
                         if request_id[:end] in self.prefixes), None)
        return next((prefix for prefix in self.prefixes if request_id.startswith(prefix)), None)

    def end(self, request_id: str) -> None:
        self.running.discard(request_id)
        self.aborted.discard(request_id)

    def is_aborted(self, request_id: str) -> bool:
        return request_id in self.aborted

    def abort(self, request_id: str) -> bool:
        """Mark one running request aborted; False when none runs under that id."""
        if request_id not in self.running or request_id in self.aborted:
            return False
        self.aborted.add(request_id)
        self.count += 1
        return True

    def abort_prefix(self, prefix: str) -> list[str]:
        """Refuse later requests of `prefix`; returns the running ones to abort now."""
        if not prefix:
            raise ValueError("an abort prefix must not be empty (use abort_all to stop everything)")
        self.prefixes.sweep()
        self.prefixes.touch(prefix)
        return sorted(rid for rid in self.running if rid.startswith(prefix) and rid not in self.aborted)

    def clear(self, prefixes: list[str] | None = None) -> None:
        """Let requests of these prefixes (all, with None) run again."""
        if prefixes is None:
            self.prefixes.clear()
            return
        for prefix in prefixes:
            self.prefixes.discard(prefix)

    def marks(self) -> int:
        """Aborted trajectories remembered (after forgetting the idle ones)."""
        self.prefixes.sweep()
        return len(self.prefixes)
