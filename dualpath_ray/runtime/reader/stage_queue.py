"""The reader's waiting room for tool-time staging orders (scheduling/staging.py): bounded, and
each order timed from when the reader received it.

Orders are read one at a time, behind every real read (runtime/reader/stager.py), so they wait
for that one staging thread. Before, they waited as queued Ray calls: without bound, and an
order's time (`ttl_s`, from receipt) only started once its call ran, so an order could be read
long after its next turn came and went, then held for a whole ttl_s more. Here an order is
stamped on arrival (`received`, the reader's monotonic clock, injected) and lives until
`received + ttl_s` whether it waits or is held: one whose time ran out while it waited is
dropped unread, and the extent of one read late is freed at that same deadline.

The queue holds at most `cap_blocks` blocks of orders (the staging share of the buffer: more
could not be held at once anyway); an arrival that would pass it drops the oldest orders first
(they have the least time left, and their next turns are the likeliest to have come already).
At least one order is always kept. Every dropped order is reported (`on_dropped`, outside the
queue's lock), which the reader counts as skipped.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from dualpath_ray.scheduling.staging import StageOrder


class DropReason(enum.Enum):
    OVERFLOW = "overflow"  # the queue was full: the oldest orders made room
    EXPIRED = "expired"  # its time ran out while it waited
    CLOSED = "closed"  # the reader is shutting down


@dataclass(frozen=True)
class QueuedOrder:
    order: StageOrder
    received: float  # on the reader's clock; the order's deadline is received + ttl_s

    @property
    def deadline(self) -> float:
        return self.received + self.order.ttl_s


class StageQueue:
    """Staging orders received and not yet read, oldest first (see the module doc). Thread-safe:
    the actor's control thread submits, its staging thread takes."""

    def __init__(
        self, cap_blocks: int, clock: Callable[[], float],
        on_dropped: Callable[[StageOrder, DropReason], None] = lambda _order, _why: None,
    ) -> None:
        if cap_blocks < 1:
            raise ValueError(f"cap_blocks must be >= 1, got {cap_blocks}")
        self.cap_blocks = cap_blocks
        self.clock = clock
        self.on_dropped = on_dropped
        self._cond = threading.Condition()
        self._queue: deque[QueuedOrder] = deque()
        self._blocks = 0  # of the orders in the queue
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def blocks(self) -> int:
        with self._cond:
            return self._blocks

    def submit(self, orders: Sequence[StageOrder]) -> None:
        """Orders just received: stamped now, queued, the oldest dropped past `cap_blocks`."""
        dropped: list[tuple[StageOrder, DropReason]] = []
        with self._cond:
            if self._closed:
                dropped = [(order, DropReason.CLOSED) for order in orders]
            else:
                received = self.clock()
                for order in orders:
                    self._queue.append(QueuedOrder(order, received))
                    self._blocks += order.blocks
                while self._blocks > self.cap_blocks and len(self._queue) > 1:
                    dropped.append((self._pop().order, DropReason.OVERFLOW))
                self._cond.notify_all()
        self._report(dropped)

    def take(self, timeout_s: float | None = None) -> QueuedOrder | None:
        """The oldest order still in time, waiting up to `timeout_s` (None: for good) for one;
        orders whose deadline passed are dropped on the way. None once closed or timed out."""
        dropped: list[tuple[StageOrder, DropReason]] = []
        taken = None
        with self._cond:
            while taken is None and not self._closed:
                now = self.clock()
                while self._queue and taken is None:
                    item = self._pop()
                    if item.deadline <= now:
                        dropped.append((item.order, DropReason.EXPIRED))
                    else:
                        taken = item
                if taken is None and not self._cond.wait(timeout_s):
                    break
        self._report(dropped)
        return taken

    def close(self) -> None:
        """Drop what waits and wake the taker: no order is taken after this."""
        with self._cond:
            self._closed = True
            dropped = [(self._pop().order, DropReason.CLOSED) for _ in range(len(self._queue))]
            self._cond.notify_all()
        self._report(dropped)

    def check_integrity(self) -> None:
        """The block count is the sum of the queued orders' blocks and within the cap (but for
        a single order, always kept)."""
        with self._cond:
            total = sum(item.order.blocks for item in self._queue)
            if total != self._blocks:
                raise RuntimeError(f"stage queue counts {self._blocks} blocks, its orders hold {total}")
            if total > self.cap_blocks and len(self._queue) > 1:
                raise RuntimeError(f"stage queue holds {total} blocks in {len(self._queue)} orders, over {self.cap_blocks}")

    def _pop(self) -> QueuedOrder:
        item = self._queue.popleft()
        self._blocks -= item.order.blocks
        return item

    def _report(self, dropped: list[tuple[StageOrder, DropReason]]) -> None:
        for order, why in dropped:
            self.on_dropped(order, why)
