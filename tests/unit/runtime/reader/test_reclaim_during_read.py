"""A store read's extent freed or reclaimed while the read still fills it (issue 31 item 2).

The read is a transfer of its extent (kv/pool.py: IN_FLIGHT); a reclaim (its engine died) or a
free (its engine gave it back) during the read only retires the extent: its slots stay out of the
free list until the read ended, the read stops at its next block and fails, and the next lease
gets slots no byte of the old read lands in. The store here reads one block at a time and waits
halfway (tests/fakes.py GatedStore), so the test frees the extent at a known moment.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.pool import Extent, PoolCounts
from dualpath_ray.protocol.messages import ExtentGrant
from dualpath_ray.runtime.reader.core import ExtentRetiredError, ReaderCore
from dualpath_ray.protocol.types import ReadPath
from tests.fakes import GatedStore
from tests.unit.runtime.reader.test_reader_core import reader_core

BLOCKS = 4
NEW_OWNER_BYTE = 0xAB  # what the lease after the reclaim writes into its slots (its own KV)


def gated_core(root: Path) -> tuple[ReaderCore, GatedStore, list[str]]:
    """A core whose buffer is exactly one read's extent, over a gated store holding BLOCKS blocks
    whose bytes are 1, 2, 3, ... (never NEW_OWNER_BYTE)."""
    core = reader_core(root, buffer_blocks=BLOCKS)
    layout = core.layout
    keys = block_keys(list(range(BLOCKS * layout.block_size)), layout.block_size, namespace_for("gated", 0))
    for i, key in enumerate(keys):
        core.store.put(key, torch.full(layout.full_block_shape, i + 1, dtype=torch.uint8))
    gated = GatedStore(core.store, pause_at=1)
    core.store = gated  # type: ignore[assignment]
    return core, gated, keys


def recording_leases(core: ReaderCore) -> list[Extent]:
    """Every extent the core leases from now on, in order (the test needs the read's extent id)."""
    leased: list[Extent] = []
    lease = core.lease

    def recorded(owner: str, n_blocks: int) -> Extent:
        extent = lease(owner, n_blocks)
        leased.append(extent)
        return extent

    core.lease = recorded  # type: ignore[method-assign]
    return leased


def run_on_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """fn on a thread; its result or exception lands in the returned list."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("how", ["reclaim", "free"])
def test_a_read_whose_extent_is_reclaimed_or_freed_stops_and_the_next_lease_gets_clean_slots(
    tmp_path: Path, how: str
) -> None:
    core, gated, keys = gated_core(tmp_path)
    leased = recording_leases(core)
    reading, read_outcome = run_on_thread(lambda: core.read_hits("dead#0", keys, BLOCKS, ReadPath.PE, "reader/n0"))
    assert gated.paused.wait(10), "the read reached its second block"
    extent = leased[0]
    if how == "reclaim":
        assert core.reclaim("dead#0") == 1, "the reclaim retires the one extent of the dead attempt"
    else:
        core.free(extent.extent_id)
    under_the_read = core.pool.check_integrity()  # checked below, after the slots' contents

    # The next attempt's lease: it must wait while the old read can still write its slots.
    waiting, lease_outcome = run_on_thread(lambda: core.lease("next#0", BLOCKS))
    waiting.join(0.3)
    got_slots_under_the_read = bool(lease_outcome)
    if lease_outcome:  # old behaviour: the slots were handed on at once; the new owner writes its KV
        for slot in lease_outcome[0].slots:  # type: ignore[attr-defined]
            core.pool.full_block(slot).fill_(NEW_OWNER_BYTE)
    gated.proceed.set()
    reading.join(10)
    waiting.join(10)
    assert not reading.is_alive() and not waiting.is_alive(), "the read and the waiting lease both end"
    new = lease_outcome[0]
    assert isinstance(new, Extent), f"the next lease gets the slots once the read ended: {new}"
    if not got_slots_under_the_read:
        for slot in new.slots:
            core.pool.full_block(slot).fill_(NEW_OWNER_BYTE)

    assert all(
        bool((core.pool.full_block(slot) == NEW_OWNER_BYTE).all()) for slot in new.slots
    ), "no byte of the old read lands in a slot leased after the reclaim (a slot is free only when nothing reads into it)"
    assert (under_the_read.free, under_the_read.in_flight) == (0, BLOCKS) and under_the_read.retiring == BLOCKS, (
        f"a retired extent under a read stays in flight (not free) until the read ends: {under_the_read}"
    )
    assert not got_slots_under_the_read, "the next lease waits while the retired extent's read still runs"
    assert isinstance(read_outcome[0], ExtentRetiredError), (
        f"the read of a retired extent fails (no grant certifies its bytes): {read_outcome[0]!r}"
    )
    assert gated.read_after_pause == 0, "the read stops at its next block boundary, reading nothing more"
    assert core.retired_reads == 1, "the stopped read is counted once"
    assert core.read_q() == 0, "the stopped read leaves nothing in the read queue"
    assert core.pool.check_integrity() == PoolCounts(0, BLOCKS, 0, BLOCKS), "only the next lease holds slots"
    core.free(new.extent_id)
    assert core.pool.check_integrity().free == BLOCKS, "every slot is free again"


def test_a_reclaim_after_the_read_but_before_its_digests_leaves_no_grant(tmp_path: Path) -> None:
    """The digests of the hit KV are taken while the read still holds its extent: a reclaim that
    lands after the last block but before the digests retires the extent all the same, and the
    stage fails rather than grant digests of slots that are no longer the attempt's."""
    core, gated, keys = gated_core(tmp_path)
    gated.pause_at = BLOCKS + 1  # never pauses
    digests = core._digests
    reclaimed: list[int] = []

    def reclaim_first(extent: Extent, start: int, end: int):  # type: ignore[no-untyped-def]
        reclaimed.append(core.reclaim("dead#0"))
        return digests(extent, start, end)

    core._digests = reclaim_first  # type: ignore[method-assign]
    with pytest.raises(ExtentRetiredError):
        core.read_hits("dead#0", keys, BLOCKS, ReadPath.PE, "reader/n0")
    assert reclaimed == [1], "the reclaim ran while the extent was still the read's"
    assert core.pool.check_integrity().free == BLOCKS, "the retired extent is free once the read ended"


def test_a_read_finished_before_the_free_grants_normally(tmp_path: Path) -> None:
    """The ordinary case is unchanged: a read that ends before anyone frees its extent returns
    its grant, and a free after it frees at once."""
    core, gated, keys = gated_core(tmp_path)
    gated.pause_at = BLOCKS + 1
    grant = core.read_hits("r#0", keys, BLOCKS, ReadPath.PE, "reader/n0")
    assert isinstance(grant, ExtentGrant) and grant.digests is not None, "granted with the hit KV's digests"
    for i, slot in enumerate(grant.slots):
        assert int(core.pool.full_block(slot)[0, 0, 0]) == i + 1, f"hit block {i} landed in its slot"
    assert core.pool.check_integrity() == PoolCounts(0, BLOCKS, 0, BLOCKS), "the grant's extent is leased"
    core.free(grant.extent_id)
    assert core.pool.check_integrity().free == BLOCKS, "a free after the read frees at once"
