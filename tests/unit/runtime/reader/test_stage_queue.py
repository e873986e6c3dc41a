"""The reader's staging orders wait bounded and are timed from their arrival (issue 31 item 9):
runtime/reader/stage_queue.py, with the reader core that reads them. The clock is a plain number
the test moves; the queue's block count is checked after every step."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dualpath_ray.runtime.reader.stage_queue import DropReason, StageQueue
from dualpath_ray.scheduling.staging import StageOrder, stage_id_of
from tests.unit.runtime.reader.test_staged_extents import reader, stored_chain

T0 = 100.0


def order_of(keys: tuple[str, ...], ttl_s: float = 10.0) -> StageOrder:
    return StageOrder(stage_id_of(keys), "d0", keys, ttl_s, T0 + ttl_s)


def fake_keys(n: int, tag: str) -> tuple[str, ...]:
    return tuple(f"{tag}{i:031x}"[:32] for i in range(n))


def test_waiting_orders_are_bounded_and_the_oldest_make_room() -> None:
    now = [T0]
    dropped: list[tuple[str, DropReason]] = []
    queue = StageQueue(8, lambda: now[0], lambda order, why: dropped.append((order.stage_id, why)))
    orders = [order_of(fake_keys(3, f"a{i}")) for i in range(4)]
    queue.submit(orders[:2])
    queue.check_integrity()
    assert (len(queue), queue.blocks) == (2, 6) and not dropped, "two orders of 3 blocks fit a cap of 8"
    queue.submit(orders[2:])
    queue.check_integrity()
    assert (len(queue), queue.blocks) == (2, 6), "the queue never holds more than its cap in blocks"
    assert dropped == [(orders[0].stage_id, DropReason.OVERFLOW), (orders[1].stage_id, DropReason.OVERFLOW)], (
        "the oldest orders are dropped to make room, and reported"
    )
    big = order_of(fake_keys(20, "b"))
    queue.submit([big])
    queue.check_integrity()
    assert len(queue) == 1 and queue.take(0).order == big, "one order larger than the cap is still kept (alone)"


def test_an_order_lives_from_its_arrival_not_from_when_the_staging_thread_gets_to_it(tmp_path: Path) -> None:
    """Its time (ttl_s) runs while it waits: one whose time ran out is dropped unread, and one
    read late is held only until arrival + ttl_s, not for a whole ttl_s after its read."""
    core = reader(tmp_path)
    now = [T0]
    queue = StageQueue(core.settings.stage_cap_blocks, lambda: now[0], core.stager.dropped)
    stale, late = stored_chain(core, 2, seed=1), stored_chain(core, 3, seed=2)
    queue.submit([order_of(stale, ttl_s=5.0)])
    now[0] = T0 + 4.0
    queue.submit([order_of(late, ttl_s=10.0)])
    queue.check_integrity()
    now[0] = T0 + 6.0  # the staging thread was busy until now (a long read of another order)
    taken = queue.take(0)
    assert taken is not None and taken.order.keys == late, "the order whose time ran out while it waited is skipped"
    assert core.staging_counts().skipped == 2, "its blocks are counted skipped, never read"
    assert taken.received == T0 + 4.0, "the order is stamped with its arrival"
    assert core.stage_ahead(taken.order, taken.received), "the live one is staged"
    assert core.expire(T0 + 13.9) == T0 + 14.0, "it is held until its arrival + ttl_s (14), not its read + ttl_s (16)"
    assert core.expire(T0 + 14.0) is None and core.staging_counts().expired == 3, "and freed then"
    assert core.pool.check_integrity().free == core.pool.capacity, "every slot is free again"
    assert queue.take(0) is None and len(queue) == 0, "nothing else waits"
    core.store.close()


def test_the_staging_thread_waits_for_orders_and_close_wakes_it() -> None:
    now = [T0]
    dropped: list[DropReason] = []
    queue = StageQueue(16, lambda: now[0], lambda _order, why: dropped.append(why))
    taken: list[object] = []
    thread = threading.Thread(target=lambda: taken.append(queue.take()), daemon=True)
    thread.start()
    queue.submit([order_of(fake_keys(1, "c"))])
    thread.join(5)
    assert not thread.is_alive() and taken and taken[0] is not None, "a waiting take gets the order that arrives"
    queue.submit([order_of(fake_keys(1, "d"))])
    queue.close()
    assert queue.take() is None and dropped == [DropReason.CLOSED], "close drops what waits; no order is taken after"
    queue.submit([order_of(fake_keys(1, "e"))])
    assert dropped == [DropReason.CLOSED, DropReason.CLOSED] and len(queue) == 0, "nor queued"


def test_a_cap_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="cap_blocks"):
        StageQueue(0, lambda: T0)
