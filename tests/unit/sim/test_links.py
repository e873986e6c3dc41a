"""Links as FIFO queues or token buckets, and a node's read queue."""

from __future__ import annotations

import pytest

from dualpath_ray.sim.buffers import SimBufferPool
from dualpath_ray.sim.links import SimLink, ReadQueue, take_all


def test_without_burst_a_link_is_a_fifo_queue():
    link = SimLink("l", rate_bytes_s=100.0)
    assert link.take(0.0, 100) == pytest.approx(1.0)
    assert link.take(0.5, 100) == pytest.approx(2.0), "the second waits for the first"
    assert link.take(5.0, 50) == pytest.approx(5.5), "an idle link starts at once"
    assert link.bytes_total == 250


def test_a_burst_lets_a_transfer_through_on_credit_like_the_runtimes_bucket():
    link = SimLink("l", rate_bytes_s=100.0, burst_bytes=50.0)
    assert link.take(10.0, 40) == pytest.approx(10.0), "within the burst: no wait"
    assert link.take(10.0, 40) == pytest.approx(10.3), "30 bytes of debt take 0.3 s"


def test_a_transfer_over_several_links_ends_with_the_slowest():
    fast, slow = SimLink("fast", 1000.0), SimLink("slow", 10.0)
    assert take_all(0.0, ((fast, 100), (slow, 100))) == pytest.approx(10.0)


def test_read_queue_counts_unread_tokens():
    queue = ReadQueue()
    queue.waiting = 64
    queue.add_read(0.0, 2.0, 128)
    queue.add_read(2.0, 3.0, 64)
    assert queue.tokens(0.0) == 64 + 128 + 64
    assert queue.tokens(1.0) == 64 + 64 + 64, "half of the read in service is done"
    assert queue.tokens(2.5) == 64 + 32
    assert queue.tokens(3.0) == 64, "only the tokens waiting for an extent remain"


def test_buffer_leases_wait_in_order_until_blocks_are_freed():
    pool = SimBufferPool("n", 10)
    granted: list[tuple[str, float]] = []
    pool.lease(0.0, 6, lambda t: granted.append(("a", t)))
    pool.lease(0.0, 6, lambda t: granted.append(("b", t)))
    pool.lease(0.0, 2, lambda t: granted.append(("c", t)))
    assert granted == [("a", 0.0)], "b does not fit; c waits behind b (arrival order)"
    pool.release(1.0, 6)
    assert granted == [("a", 0.0), ("b", 1.0), ("c", 1.0)]
    assert pool.free == 2 and pool.peak == 8
    with pytest.raises(ValueError, match="buffer_blocks_per_node"):
        pool.lease(1.0, 11, lambda t: None)
