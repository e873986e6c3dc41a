"""Emulated NIC links: exact byte counters, buckets only when emulation is on."""

from __future__ import annotations

from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.emulation import Link, make_link


def test_links_count_every_byte_and_pace_only_when_emulated():
    link = Link("cnic")
    for n in (10, 0, 4096):
        link.take(n)
    assert link.bytes_total == 4106, "the counter is exact"
    off = DualPathConfig().with_overrides(emulation={"enabled": False})
    assert make_link(off, "snic", 1.0).bucket is None, "real hardware: no emulated bucket"
    on = make_link(DualPathConfig(), "snic", 8.0)
    assert on.bucket is not None and on.bucket.rate == 1e9, "8 Gbit/s is 1e9 bytes/s"


def test_fifo_turns_serve_requests_in_the_order_they_asked():
    import threading

    from dualpath_ray.runtime.emulation import FifoTurns
    from tests.helpers import wait_until

    turns = FifoTurns()
    first = turns.wait_turn()
    served: list[int] = []

    def request(label: int) -> None:
        ticket = turns.wait_turn()
        served.append(label)
        turns.done(ticket)

    waiting = []
    for label in range(1, 4):
        thread = threading.Thread(target=request, args=(label,))
        thread.start()
        waiting.append(thread)
        wait_until(lambda: turns._next_ticket == label + 1)  # the next thread asks only once this one has its ticket
    assert served == [], "no request is served while an earlier turn is held"
    turns.done(first)
    for thread in waiting:
        thread.join()
    assert served == [1, 2, 3], "turns go in the order the requests asked"
    assert make_link(DualPathConfig(), "snic", 8.0).turns is not None, "an emulated link queues whole requests"
    off = DualPathConfig().with_overrides(emulation={"enabled": False})
    assert make_link(off, "snic", 8.0).turns is None, "a real link sets its own order"
