"""A node's host staging buffer: Full Block slots leased to requests, back-pressure when full.

The runtime's reader (runtime/reader/core.py) waits on a condition while its pool has no room and
retries its waiters when blocks are freed. Here waiters are granted strictly in arrival order:
a freed block goes to the oldest waiter, which is never passed by a smaller, younger one (the
runtime's notify_all lets whichever waiter wakes first try; leases there are of similar sizes, and
strict order keeps a release O(grants) with thousands of waiters). Fragmentation is not
modelled: a lease needs only enough free slots.

Tool-time staging (sim/staged.py) leases with `try_lease`, which never waits (and never passes a
waiter), and sets `reclaim`: a real lease that has to wait first asks it to cancel unclaimed
staged extents, oldest first, until the waiters fit.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

Granted = Callable[[float], None]


class SimBufferPool:
    __slots__ = ("node_id", "capacity", "free", "_waiting", "_wanted", "peak", "reclaim")

    def __init__(self, node_id: str, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"node {node_id}: the buffer needs at least one block")
        self.node_id = node_id
        self.capacity = capacity_blocks
        self.free = capacity_blocks
        self._waiting: deque[tuple[int, Granted]] = deque()
        self._wanted = 0  # blocks the waiters want, summed
        self.peak = 0
        # reclaim(now, blocks): free up to `blocks` held by staged extents (set by sim/staged.py)
        self.reclaim: Callable[[float, int], None] | None = None

    def lease(self, now: float, blocks: int, granted: Granted) -> None:
        """granted(now) once `blocks` slots are set aside (at once when they are free)."""
        if blocks > self.capacity:
            raise ValueError(
                f"a request needs {blocks} buffer blocks but node {self.node_id} has {self.capacity}; "
                "raise cluster.buffer_blocks_per_node"
            )
        if not self._waiting and blocks <= self.free:
            self._take(blocks)
            granted(now)
            return
        self._waiting.append((blocks, granted))
        self._wanted += blocks
        if self.reclaim is not None and self._wanted > self.free:
            self.reclaim(now, self._wanted - self.free)

    def try_lease(self, blocks: int) -> bool:
        """Set `blocks` slots aside at once if they are free and nobody waits; never waits."""
        if self._waiting or blocks > self.free:
            return False
        self._take(blocks)
        return True

    def release(self, now: float, blocks: int) -> None:
        self.free += blocks
        if self.free > self.capacity:
            raise AssertionError(f"node {self.node_id}: more buffer blocks freed than leased")
        waiting = self._waiting
        ready = []
        while waiting and waiting[0][0] <= self.free:
            blocks_wanted, granted = waiting.popleft()
            self._wanted -= blocks_wanted
            self._take(blocks_wanted)
            ready.append(granted)
        for granted in ready:
            granted(now)

    def waiting(self) -> int:
        return len(self._waiting)

    def _take(self, blocks: int) -> None:
        self.free -= blocks
        used = self.capacity - self.free
        if used > self.peak:
            self.peak = used
