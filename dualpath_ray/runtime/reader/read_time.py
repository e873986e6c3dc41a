"""How long a node's store reads ran: wall seconds with at least one hit read in flight.

`NodeCounters.snic_read` says how many bytes a reader read; this says over how long, so their
ratio is the rate the reads ran at while there were reads to run (the idle gaps between a
workload's turns left out): the figure a cold-read benchmark compares with the disk's own rate
(fio) through `dualpath bench` (benchmarks/README.md, "Store read, cold"). Overlapping reads
count their overlap once, so two requests reading at once do not double the time.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from dualpath_ray.protocol.counters import NodeCounters


class StoreReadTime:
    """Adds to `counters.store_read_s` the wall time during which some `reading()` was open.

    `lock` is the one that guards `counters` (the reader core's), taken only to count, never
    across the read. `clock` is a monotonic clock in seconds (a test drives it).
    """

    def __init__(self, counters: NodeCounters, lock: threading.Condition, clock: Callable[[], float]) -> None:
        self._counters = counters
        self._lock = lock
        self._clock = clock
        self._in_flight = 0
        self._since = 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """One store read, from its first block to its end (failed or not)."""
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._counters.store_read_s += self._clock() - self._since

    @property
    def in_flight(self) -> int:
        return self._in_flight
