"""StoreReadTime: the wall time with a store read in flight, overlaps counted once."""

from __future__ import annotations

import threading

import pytest

from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.reader.read_time import StoreReadTime


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_reads_count_their_union_and_idle_gaps_count_nothing() -> None:
    counters, clock = NodeCounters(), Clock()
    meter = StoreReadTime(counters, threading.Condition(), clock)
    first = meter.reading()
    first.__enter__()
    clock.now += 2.0
    with meter.reading():  # overlaps the first read
        clock.now += 1.0
    assert counters.store_read_s == 0.0, "nothing is added while a read is still in flight"
    clock.now += 1.0
    first.__exit__(None, None, None)
    assert counters.store_read_s == pytest.approx(4.0), "two overlapping reads over 4 s count 4 s, not 5"
    clock.now += 10.0  # idle: no read in flight
    with meter.reading():
        clock.now += 0.5
    assert counters.store_read_s == pytest.approx(4.5), "the idle 10 s between reads are not read time"


def test_a_failed_read_still_ends_its_time() -> None:
    counters, clock = NodeCounters(), Clock()
    meter = StoreReadTime(counters, threading.Condition(), clock)
    with pytest.raises(OSError):
        with meter.reading():
            clock.now += 3.0
            raise OSError("EIO")
    assert meter.in_flight == 0, "a read that raised is no longer in flight"
    assert counters.store_read_s == pytest.approx(3.0), "its time up to the failure counts"


def test_merged_counters_add_read_time() -> None:
    a, b = NodeCounters(store_read_s=1.5), NodeCounters(store_read_s=2.0)
    a.merge(b)
    assert a.store_read_s == pytest.approx(3.5), "a node's counters merge their read time too"
