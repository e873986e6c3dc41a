"""Host buffer pool: slot accounting, views that share storage, the extent lifecycle."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import (
    BufferPool,
    Extent,
    ExtentEvent,
    ExtentState,
    ExtentTransitionError,
    PoolCounts,
    PoolIntegrityError,
    transition,
)
from dualpath_ray.kv.store import MemoryStore

LAYOUT = KVLayout(n_layer=3, block_size=4, n_kv_head=1, head_dim=2)


def test_buffer_geometry_and_pinning() -> None:
    pool = BufferPool(5, LAYOUT)
    assert tuple(pool.buffer.shape) == (5, *LAYOUT.full_block_shape), "one Full Block per slot"
    assert pool.buffer.dtype == torch.uint8, "the buffer holds bytes"
    assert pool.nbytes == 5 * LAYOUT.full_block_bytes, "nbytes counts every slot"
    assert pool.pinned == torch.cuda.is_available(), "pin only where an accelerator exists"
    assert not BufferPool(1, LAYOUT, pin=False).pinned, "pin=False never pins"
    assert BufferPool(1, LAYOUT, pin=True).pinned == torch.cuda.is_available(), (
        "pin=True pins only where an accelerator exists (pinning raises without one)"
    )


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True])
def test_bad_capacity_is_rejected(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        BufferPool(capacity, LAYOUT)  # type: ignore[arg-type]


def test_lease_gives_distinct_slots_and_none_when_full() -> None:
    pool = BufferPool(6, LAYOUT)
    first = pool.lease("r1", 4)
    assert first is not None and len(set(first.slots)) == 4, "an extent holds distinct slots"
    assert pool.lease("r2", 3) is None, "a lease larger than the free slots must wait (None)"
    second = pool.lease("r2", 2)
    assert second is not None and not set(first.slots) & set(second.slots), "extents never share slots"
    assert pool.check_integrity() == PoolCounts(0, 6, 0, 6), "all slots leased"
    assert pool.holders() == {"r1": 4, "r2": 2}, "holders names each owner with the blocks it holds"


def test_lease_may_use_non_contiguous_slots() -> None:
    pool = BufferPool(4, LAYOUT)
    extents = [pool.lease(f"r{i}", 1) for i in range(4)]
    assert all(e is not None for e in extents), "four single-slot leases fit in four slots"
    pool.release(extents[0].extent_id)  # type: ignore[union-attr]
    pool.release(extents[2].extent_id)  # type: ignore[union-attr]
    joined = pool.lease("big", 2)
    assert joined is not None, "two free slots that are not adjacent must still make an extent"
    assert sorted(joined.slots) == sorted([extents[0].slots[0], extents[2].slots[0]]), (  # type: ignore[union-attr]
        "the extent must reuse exactly the freed slots"
    )


@pytest.mark.parametrize("owner, n_blocks", [("", 1), ("r", 0), ("r", 9), ("r", 1.0)])
def test_bad_lease_requests_are_rejected(owner: str, n_blocks: object) -> None:
    with pytest.raises(ValueError):
        BufferPool(8, LAYOUT).lease(owner, n_blocks)  # type: ignore[arg-type]


def test_views_share_the_pool_storage() -> None:
    pool = BufferPool(4, LAYOUT)
    pool.buffer.zero_()
    extent = pool.lease("r", 3)
    assert extent is not None
    blocks = pool.full_blocks(extent)
    for i, block in enumerate(blocks):
        block.fill_(i + 1)
    for i, slot in enumerate(extent.slots):
        view = pool.full_block(slot)
        assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr(), (
            "a slot's Full Block view must share the pool's storage"
        )
        assert bool((view == i + 1).all()), "a slot view must see the bytes written through the extent"
    pool.full_block(extent.slots[2])[1].fill_(9)
    assert bool((blocks[2][1] == 9).all()), "writes through one view land in the pool for every view"


def test_view_bounds_and_stale_extents() -> None:
    pool = BufferPool(4, LAYOUT)
    extent = pool.lease("r", 2)
    assert extent is not None
    with pytest.raises(IndexError):
        pool.full_block(4)
    with pytest.raises(ValueError, match="does not match"):
        pool.full_blocks(Extent(extent.extent_id, "other", extent.slots))
    pool.release(extent.extent_id)
    with pytest.raises(KeyError, match="not leased"):
        pool.full_blocks(extent)


def test_store_reads_fill_pool_slots_in_place() -> None:
    store = MemoryStore(LAYOUT)
    keys = block_keys(list(range(8)), LAYOUT.block_size, namespace_for("m", 0))
    blocks = [torch.full(LAYOUT.full_block_shape, i + 7, dtype=torch.uint8) for i in range(2)]
    for key, block in zip(keys, blocks):
        store.put(key, block)
    pool = BufferPool(4, LAYOUT)
    extent = pool.lease("reader", 2)
    assert extent is not None
    pool.begin_transfer(extent.extent_id)
    store.get_many_into(keys, pool.full_blocks(extent))
    pool.end_transfer(extent.extent_id)
    for slot, block in zip(extent.slots, blocks):
        assert torch.equal(pool.full_block(slot), block), "a store read must land in the leased slot"


def test_legal_lifecycle() -> None:
    pool = BufferPool(3, LAYOUT)
    extent = pool.lease("r", 2)
    assert extent is not None and pool.state_of(extent.extent_id) is ExtentState.LEASED, "lease -> LEASED"
    for _ in range(2):
        pool.begin_transfer(extent.extent_id)
        assert pool.state_of(extent.extent_id) is ExtentState.IN_FLIGHT, "begin_transfer -> IN_FLIGHT"
        assert pool.check_integrity() == PoolCounts(1, 0, 2, 3), "in-flight slots counted as in flight"
        pool.end_transfer(extent.extent_id)
        assert pool.state_of(extent.extent_id) is ExtentState.LEASED, "end_transfer -> LEASED"
    pool.release(extent.extent_id)
    assert pool.state_of(extent.extent_id) is ExtentState.FREE, "release -> FREE"
    assert pool.check_integrity() == PoolCounts(3, 0, 0, 3), "released slots are free again"


def test_retiring_under_a_transfer_frees_only_when_the_transfer_ends() -> None:
    """A slot is free only when nothing reads into or out of it: retiring an extent whose
    transfer is in flight keeps its slots out of the free list until end_transfer."""
    pool = BufferPool(3, LAYOUT)
    idle = pool.lease("idle", 1)
    busy = pool.lease("busy", 2)
    assert idle is not None and busy is not None
    assert pool.retire(idle.extent_id), "retiring a LEASED extent frees it at once"
    pool.begin_transfer(busy.extent_id)
    assert not pool.retire(busy.extent_id), "retiring an extent in a transfer does not free it yet"
    assert pool.state_of(busy.extent_id) is ExtentState.RETIRING, "IN_FLIGHT -> RETIRING"
    assert pool.check_integrity() == PoolCounts(1, 0, 2, 3, 2), "retiring slots are in flight, not free"
    assert pool.lease("next", 2) is None, "a lease cannot take slots a transfer still uses"
    for illegal in (pool.begin_transfer, pool.release, pool.retire, lambda i: pool.grow(i, 0)):
        with pytest.raises(ExtentTransitionError, match="RETIRING"):
            illegal(busy.extent_id)
    assert pool.end_transfer(busy.extent_id), "the transfer's end frees a retired extent"
    assert pool.check_integrity() == PoolCounts(3, 0, 0, 3), "every slot is free once the transfer ended"


@pytest.mark.parametrize(
    "steps, match",
    [
        (["begin", "release"], "IN_FLIGHT"),
        (["begin", "begin"], "IN_FLIGHT"),
        (["end"], "LEASED"),
        (["release", "release"], "FREE"),
        (["release", "begin"], "FREE"),
        (["release", "end"], "FREE"),
    ],
)
def test_illegal_moves_are_rejected(steps: list[str], match: str) -> None:
    pool = BufferPool(2, LAYOUT)
    extent = pool.lease("r", 1)
    assert extent is not None
    actions = {"begin": pool.begin_transfer, "end": pool.end_transfer, "release": pool.release}
    for step in steps[:-1]:
        actions[step](extent.extent_id)
    before = pool.check_integrity()
    with pytest.raises(ExtentTransitionError, match=match):
        actions[steps[-1]](extent.extent_id)
    assert pool.check_integrity() == before, "a rejected move must not change any slot"


def test_unknown_extents_are_free() -> None:
    pool = BufferPool(2, LAYOUT)
    assert pool.state_of(42) is ExtentState.FREE, "an extent never leased is FREE"
    with pytest.raises(ExtentTransitionError, match="not leased"):
        pool.begin_transfer(42)


def test_transition_table() -> None:
    assert transition(0, ExtentState.FREE, ExtentEvent.LEASE) is ExtentState.LEASED, "lease leaves FREE"
    with pytest.raises(ExtentTransitionError):
        transition(0, ExtentState.LEASED, ExtentEvent.LEASE)
    with pytest.raises(ExtentTransitionError):
        transition(0, ExtentState.IN_FLIGHT, ExtentEvent.RELEASE)


def test_integrity_check_catches_shared_and_lost_slots() -> None:
    pool = BufferPool(4, LAYOUT)
    extent = pool.lease("r", 2)
    assert extent is not None
    pool._free.append(extent.slots[0])
    with pytest.raises(PoolIntegrityError, match="held by both"):
        pool.check_integrity()
    pool._free.pop()
    pool._free.pop()
    with pytest.raises(PoolIntegrityError, match="neither free nor leased"):
        pool.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "begin", "end", "release", "retire"]), st.integers(1, 5)), max_size=40))
def test_random_operations_keep_the_accounting_exact(ops: list[tuple[str, int]]) -> None:
    pool = BufferPool(8, LAYOUT)
    live: dict[int, ExtentState] = {}
    for op, n in ops:
        if op == "lease":
            extent = pool.lease("r", n)
            if extent is not None:
                live[extent.extent_id] = ExtentState.LEASED
        elif live:
            extent_id = sorted(live)[n % len(live)]
            event = {"begin": ExtentEvent.BEGIN_TRANSFER, "end": ExtentEvent.END_TRANSFER, "release": ExtentEvent.RELEASE,
                     "retire": ExtentEvent.RETIRE}[op]
            action = {"begin": pool.begin_transfer, "end": pool.end_transfer, "release": pool.release,
                      "retire": pool.retire}[op]
            try:
                expected = transition(extent_id, live[extent_id], event)
            except ExtentTransitionError:
                with pytest.raises(ExtentTransitionError):
                    action(extent_id)
                continue
            action(extent_id)
            if expected is ExtentState.FREE:
                del live[extent_id]
            else:
                live[extent_id] = expected
        counts = pool.check_integrity()
        leased = sum(pool.extent(i).n_blocks for i, s in live.items() if s is ExtentState.LEASED)
        in_flight = sum(
            pool.extent(i).n_blocks for i, s in live.items() if s in (ExtentState.IN_FLIGHT, ExtentState.RETIRING)
        )
        retiring = sum(pool.extent(i).n_blocks for i, s in live.items() if s is ExtentState.RETIRING)
        assert (counts.leased, counts.in_flight, counts.retiring) == (leased, in_flight, retiring), (
            "the pool's counts must match the states of the live extents"
        )


def test_concurrent_leases_and_releases_keep_integrity() -> None:
    pool = BufferPool(16, LAYOUT)
    errors: list[BaseException] = []

    def churn(owner: str) -> None:
        try:
            for i in range(300):
                extent = pool.lease(owner, 1 + i % 3)
                if extent is not None:
                    pool.begin_transfer(extent.extent_id)
                    pool.end_transfer(extent.extent_id)
                    pool.release(extent.extent_id)
        except BaseException as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [], f"concurrent use must not fail: {errors}"
    assert pool.check_integrity() == PoolCounts(16, 0, 0, 16), "every slot must be free again"


def test_grow_appends_free_slots_after_the_old_ones_and_keeps_the_id() -> None:
    pool = BufferPool(8, LAYOUT)
    extent = pool.lease("stage/k", 2)
    assert extent is not None
    pool.full_block(extent.slots[1]).fill_(7)
    grown = pool.grow(extent.extent_id, 3)
    assert grown is not None and grown.extent_id == extent.extent_id, "a grown extent keeps its id (grants name it)"
    assert grown.slots[:2] == extent.slots, "block order is kept: the old slots stay first, in their order"
    assert len(set(grown.slots)) == 5, "the new slots are distinct from the old ones"
    assert bool((pool.full_blocks(grown)[1] == 7).all()), "bytes already in the extent stay at their block position"
    assert pool.check_integrity() == PoolCounts(3, 5, 0, 8), "grown slots are leased, not free"
    other = pool.lease("req", 2)
    assert other is not None
    assert pool.grow(extent.extent_id, 2) is None, "None while fewer slots are free (nothing taken)"
    assert pool.check_integrity() == PoolCounts(1, 7, 0, 8), "a refused grow takes no slot"
    with pytest.raises(ValueError, match="exceeds the pool capacity"):
        pool.grow(extent.extent_id, 4)
    pool.release(extent.extent_id)
    pool.release(other.extent_id)
    assert pool.check_integrity() == PoolCounts(8, 0, 0, 8), "releasing a grown extent frees every slot of it"


def test_adopt_changes_the_owner_of_a_leased_extent_only() -> None:
    pool = BufferPool(4, LAYOUT)
    extent = pool.lease("stage/k", 2)
    assert extent is not None
    adopted = pool.adopt(extent.extent_id, "req-1@0")
    assert (adopted.extent_id, adopted.slots, adopted.owner) == (extent.extent_id, extent.slots, "req-1@0"), (
        "adopt keeps id and slots and changes only the owner"
    )
    assert pool.holders() == {"req-1@0": 2}, "the blocks are blamed on the new owner"
    pool.begin_transfer(extent.extent_id)
    with pytest.raises(ExtentTransitionError, match="only a LEASED extent"):
        pool.adopt(extent.extent_id, "other")
    with pytest.raises(ExtentTransitionError, match="only a LEASED extent"):
        pool.grow(extent.extent_id, 1)
    pool.end_transfer(extent.extent_id)
    pool.release(extent.extent_id)
    with pytest.raises(ExtentTransitionError, match="FREE"):
        pool.grow(extent.extent_id, 1)
    assert pool.check_integrity() == PoolCounts(4, 0, 0, 4), "refused moves leave the accounting exact"
