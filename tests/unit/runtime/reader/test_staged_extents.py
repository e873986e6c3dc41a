"""Tool-time staging in the reader (kv/staged.py, runtime/reader/stager.py, core.py): StageOrders read
ahead behind real reads, claimed by the next turn's DE-path stage, expired, cancelled by pressure.

Every scenario ends with the pool's integrity (free + leased + in_flight == capacity, no slot
lost or shared) and, once everything is freed, every slot free again. The clock is a plain
number handed to the calls that take `now`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.pool import PoolCounts
from dualpath_ray.protocol.messages import StagedRead
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.reader.core import ReaderCore, ReaderSettings, ReclaimedOwnerError
from dualpath_ray.kv.staged import StageEvent, StageState, StageTransitionError, transition
from dualpath_ray.scheduling.staging import StageOrder, stage_id_of
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import FaultPlan
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.types import ReadPath
from tests.fakes import FakeSnicLink
from tests.unit.runtime.reader.test_reader_core import kv_layout

T0 = 100.0  # the fake clock's start


def reader(root: Path, buffer_blocks: int = 16, fraction: float = 0.5, read_link: object | None = None) -> ReaderCore:
    layout = kv_layout()
    settings = ReaderSettings(
        node_id="d0", buffer_blocks=buffer_blocks, lease_timeout_s=30.0, stage_buffer_fraction=fraction
    )
    links = (read_link or Link("snic-read/d0"), Link("snic-write/d0"))
    return ReaderCore(settings, layout, LocalDirStore(root, layout), links, FaultInjector(FaultPlan(), "reader/d0"))  # type: ignore[arg-type]


def stored_chain(core: ReaderCore, n: int, seed: int) -> tuple[str, ...]:
    """n stored blocks of a chain, block i filled with a byte pattern of its own."""
    layout = core.layout
    keys = tuple(block_keys(list(range(seed, seed + n * layout.block_size)), layout.block_size, namespace_for("st", seed)))
    for i, key in enumerate(keys):
        data = torch.arange(layout.full_block_bytes, dtype=torch.int64).add_(seed * 31 + i * 7).remainder_(251)
        core.store.put(key, data.to(torch.uint8).view(layout.full_block_shape))
    return keys


def order(keys: tuple[str, ...], ttl_s: float = 10.0, node: str = "d0") -> StageOrder:
    return StageOrder(stage_id_of(keys), node, keys, ttl_s, T0 + ttl_s)


def extent_bytes(core: ReaderCore, slots: tuple[int, ...]) -> list[torch.Tensor]:
    return [core.pool.full_block(slot).clone() for slot in slots]


def assert_integrity(core: ReaderCore, free_all: bool = False) -> None:
    counts = core.pool.check_integrity()
    assert counts.free + counts.leased + counts.in_flight == counts.capacity, "no slot is lost or counted twice"
    if free_all:
        assert counts == PoolCounts(counts.capacity, 0, 0, counts.capacity), "every slot is free again"
        assert core.stager.table.held_blocks == 0, "the staging holds no block once everything ended"


def free_all_and_check(core: ReaderCore) -> None:
    """End of a scenario: free what its requests still hold; then every slot is free."""
    for extent_id in core.extents.ids():
        core.free(extent_id)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_the_lifecycle_table_refuses_illegal_moves() -> None:
    assert transition("s", StageState.READING, StageEvent.PROMOTE) is StageState.PROMOTED, "a claim promotes a read"
    assert transition("s", StageState.PROMOTED, StageEvent.READ_DONE) is StageState.CLAIMED, (
        "a promoted read ends claimed: nothing may expire or cancel it between read and claim"
    )
    for state, event in [
        (StageState.PROMOTED, StageEvent.EXPIRE), (StageState.PROMOTED, StageEvent.CANCEL),
        (StageState.CLAIMED, StageEvent.EXPIRE), (StageState.HELD, StageEvent.FAIL),
        (StageState.EXPIRED, StageEvent.CLAIM), (StageState.CANCELLED, StageEvent.READ_DONE),
    ]:
        with pytest.raises(StageTransitionError):
            transition("s", state, event)


def test_a_claim_reads_only_the_rest_and_the_bytes_equal_a_normal_stage(tmp_path: Path) -> None:
    link = FakeSnicLink("snic-read/d0")
    core = reader(tmp_path, read_link=link)
    keys = stored_chain(core, 5, 1)
    block = core.layout.full_block_bytes
    assert core.stage_ahead(order(keys[:3]), T0), "an order with room is staged"
    assert len(link.takes) == 3 and core.counters.snic_read["de"] == 3 * block, (
        "staged blocks pay the decode node's SNIC and count under the de path"
    )
    assert core.read_q() == 0, "a staged read never enters the read queue"
    staged = StagedRead(stage_id_of(keys[:3]), "d0", 3)
    grant = core.read_hits("req-1@0", keys, 7, ReadPath.DE, "reader/d0", staged=staged)
    assert len(link.takes) == 5, "the claim reads only the two blocks past the staged ones"
    assert len(grant.slots) == 7, "the claimed extent is grown to the request's total blocks"
    claimed = extent_bytes(core, grant.slots[:5])

    normal = core.read_hits("req-2@0", keys, 7, ReadPath.DE, "reader/d0")
    assert all(torch.equal(a, b) for a, b in zip(claimed, extent_bytes(core, normal.slots[:5]))), (
        "the buffer holds exactly what a normal read gives, block by block"
    )
    assert grant.digests is not None and normal.digests is not None
    assert np.array_equal(grant.digests, normal.digests), "the grant's digests cover all hit blocks, as a normal stage's"
    assert core.staging_counts().staged == 3 and core.staging_counts().used == 3, "3 staged, 3 used"
    assert core.pool.holders() == {"req-1@0": 7, "req-2@0": 7}, "the claimant owns the adopted, grown extent"
    assert_integrity(core)
    core.free(grant.extent_id)
    core.free(normal.extent_id)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_an_unusable_claim_falls_back_to_a_normal_read_and_counts_a_miss(tmp_path: Path) -> None:
    core = reader(tmp_path)
    keys = stored_chain(core, 4, 2)
    assert core.stage_ahead(order(keys[:2]), T0)
    wrong_keys = StagedRead(stage_id_of(keys[:2]), "d0", 2)
    grant = core.read_hits("r1@0", keys[1:], 4, ReadPath.DE, "reader/d0", staged=wrong_keys)
    assert core.staging_counts().missed == 2, "keys that do not begin with the staged chain are a miss"
    assert core.stager.table.get(stage_id_of(keys[:2])) is not None, "a miss leaves the staged entry for its claimant"
    core.free(grant.extent_id)
    other_node = StagedRead(stage_id_of(keys[:2]), "d9", 2)
    core.free(core.read_hits("r2@0", keys, 4, ReadPath.DE, "reader/d0", staged=other_node).extent_id)
    pe_path = StagedRead(stage_id_of(keys[:2]), "d0", 2)
    core.free(core.read_hits("r3@0", keys, 4, ReadPath.PE, "reader/d0", staged=pe_path).extent_id)
    assert core.staging_counts().missed == 6, "another node's order and a PE-path read are misses too"
    assert core.staging_counts().used == 0, "nothing was claimed"
    core.expire(T0 + 11.0)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_a_staged_read_never_starts_a_block_while_a_real_read_is_active(tmp_path: Path) -> None:
    """A real read holds the SNIC (its store read is held inside); the staged read, started on
    another thread, must not take a block until the real one ended: every SNIC take is logged
    with the number of real reads active at that moment."""
    events: list[str] = []
    link = FakeSnicLink("snic-read/d0", events=events)
    core = reader(tmp_path, read_link=link)
    real_keys = stored_chain(core, 2, 3)
    staged_keys = stored_chain(core, 3, 4)
    takes_during_real: list[int] = []
    inside, release = threading.Event(), threading.Event()
    inner = core.store.get_many_into

    def held(keys, outs, before_read=None, on_verified=None, **more):  # type: ignore[no-untyped-def]
        if before_read is not None:  # the real read: hold it open until the test releases it
            inside.set()
            release.wait(10)
        return inner(keys, outs, before_read=before_read, on_verified=on_verified, **more)

    core.store.get_many_into = held  # type: ignore[method-assign]
    real_link_take = link.take

    def take(nbytes: int) -> None:
        takes_during_real.append(core.stager.real_reads)
        real_link_take(nbytes)

    link.take = take  # type: ignore[method-assign]
    real = threading.Thread(target=lambda: core.read_blocks("real@0", real_keys, 2, ReadPath.DE))
    real.start()
    assert inside.wait(10), "the real read is under way"
    ahead = threading.Thread(target=core.stage_ahead, args=(order(staged_keys), T0))
    ahead.start()
    ahead.join(0.2)
    assert ahead.is_alive() and not takes_during_real, "the staged read waits while the real read is active"
    release.set()
    real.join(10)
    ahead.join(10)
    assert not ahead.is_alive(), "the staged read ran once the real read ended"
    staged_takes = takes_during_real[2:]
    assert len(staged_takes) == 3 and all(n == 0 for n in staged_takes), (
        "no staged block was taken while a real read was active"
    )
    assert core.staging_counts().staged == 3
    core.expire(T0 + 100.0)
    free_all_and_check(core)


def test_a_claim_of_a_reading_entry_promotes_it_and_waits_for_its_last_block(tmp_path: Path) -> None:
    """A real read is held open so the staged read stops before its first block; a claim then
    promotes it: it reads at full priority despite the active real read, and the claim gets it."""
    core = reader(tmp_path)
    real_keys = stored_chain(core, 1, 5)
    keys = stored_chain(core, 3, 6)
    inside, release = threading.Event(), threading.Event()
    inner = core.store.get_many_into

    def held(keys_, outs, before_read=None, on_verified=None, **more):  # type: ignore[no-untyped-def]
        if before_read is not None and list(keys_) == list(real_keys):
            inside.set()
            release.wait(10)
        return inner(keys_, outs, before_read=before_read, on_verified=on_verified, **more)

    core.store.get_many_into = held  # type: ignore[method-assign]
    real = threading.Thread(target=lambda: core.read_blocks("real@0", real_keys, 1, ReadPath.PE))
    real.start()
    assert inside.wait(10)
    ahead = threading.Thread(target=core.stage_ahead, args=(order(keys), T0))
    ahead.start()
    ahead.join(0.1)
    entry = core.stager.table.get(stage_id_of(keys))
    assert entry is not None and entry.state is StageState.READING and entry.read == 0, "it yields to the real read"
    grant = core.read_hits("req@0", keys, 4, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(keys), "d0", 3))
    assert entry.state is StageState.CLAIMED and entry.read == 3, "promoted, it read every block while the real read ran"
    assert core.staging_counts().used == 3 and core.staging_counts().missed == 0, "the claim used it"
    release.set()
    real.join(10)
    ahead.join(10)
    core.free(grant.extent_id)
    free_all_and_check(core)


def test_expiry_frees_exactly_the_expired_and_returns_the_next_deadline(tmp_path: Path) -> None:
    core = reader(tmp_path)
    short, long_ = stored_chain(core, 2, 7), stored_chain(core, 3, 8)
    assert core.expire(T0) is None, "nothing staged: no deadline (the timer sleeps)"
    core.stage_ahead(order(short, ttl_s=5.0), T0)
    core.stage_ahead(order(long_, ttl_s=20.0), T0 + 1.0)
    assert core.expire(T0 + 4.9) == T0 + 5.0, "nothing due yet; the earliest deadline is receipt + ttl_s"
    assert core.pool.check_integrity().leased == 5
    assert core.expire(T0 + 5.0) == T0 + 21.0, "the short one expires at its deadline; the long one is next"
    assert core.pool.check_integrity().leased == 3, "exactly the expired extent was freed"
    assert core.stager.table.get(stage_id_of(long_)) is not None, "the other stays held"
    assert core.staging_counts().expired == 2
    miss = core.read_hits("late@0", short, 2, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(short), "d0", 2))
    assert core.staging_counts().missed == 2, "a claim after expiry reads as usual"
    core.free(miss.extent_id)
    assert core.expire(T0 + 21.0) is None, "all expired: no deadline left"
    assert_integrity(core, free_all=True)
    core.store.close()


def test_buffer_pressure_cancels_the_oldest_staged_extents_first(tmp_path: Path) -> None:
    core = reader(tmp_path, buffer_blocks=10, fraction=1.0)
    a, b, c = stored_chain(core, 3, 9), stored_chain(core, 3, 10), stored_chain(core, 3, 11)
    for i, keys in enumerate((a, b, c)):
        assert core.stage_ahead(order(keys), T0 + i)
    assert core.pool.free_blocks() == 1
    extent = core.lease("real@0", 4)  # short by 3: the oldest (a) covers it
    assert core.stager.table.get(stage_id_of(a)) is None, "the oldest staged extent is cancelled"
    assert core.stager.table.get(stage_id_of(b)) is not None and core.stager.table.get(stage_id_of(c)) is not None, (
        "younger ones stay while the oldest covers the shortfall"
    )
    assert core.staging_counts().cancelled == 3
    core.free(extent.extent_id)
    core.expire(T0 + 100.0)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_a_duplicate_an_over_cap_or_an_empty_order_is_skipped(tmp_path: Path) -> None:
    core = reader(tmp_path, buffer_blocks=8, fraction=0.5)  # cap: 4 staged blocks
    a, b = stored_chain(core, 3, 12), stored_chain(core, 2, 13)
    assert core.stage_ahead(order(a), T0)
    assert not core.stage_ahead(order(a), T0), "a live stage_id is not staged twice"
    assert not core.stage_ahead(order(b), T0), "3 + 2 staged blocks would pass the cap of 4"
    assert not core.stage_ahead(StageOrder("stage/none", "d0", (), 5.0, T0 + 5.0), T0), "no keys, nothing to stage"
    assert core.staging_counts().skipped == 3 + 2, "skipped orders count their blocks"
    assert core.pool.check_integrity().leased == 3, "skipped orders lease nothing"
    core.expire(T0 + 100.0)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_a_failed_staged_read_frees_its_extent_and_the_claim_reads_as_usual(tmp_path: Path) -> None:
    core = reader(tmp_path)
    keys = stored_chain(core, 3, 14)
    core.store.delete(keys[1])
    assert not core.stage_ahead(order(keys[:2]), T0), "a missing block fails the staged read"
    assert core.staging_counts().failed == 2 and core.pool.check_integrity().leased == 0, "its extent is freed"
    stored_chain(core, 3, 14)  # the block is back (another turn stored it)
    grant = core.read_hits("req@0", keys, 3, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(keys[:2]), "d0", 2))
    assert core.staging_counts().missed == 2, "the claim falls back to a normal read"
    core.free(grant.extent_id)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_reclaim_of_the_claimant_frees_the_grown_extent(tmp_path: Path) -> None:
    core = reader(tmp_path)
    keys = stored_chain(core, 4, 15)
    core.stage_ahead(order(keys[:2]), T0)
    grant = core.read_hits("dead@0", keys, 6, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(keys[:2]), "d0", 2))
    assert core.pool.holders() == {"dead@0": 6}
    assert core.reclaim("dead@0") == 1, "the adopted and grown extent is the claimant's: reclaim frees it"
    assert_integrity(core, free_all=True)
    core.stage_ahead(order(keys[:2]), T0)
    with pytest.raises(ReclaimedOwnerError):
        core.read_hits("dead@0", keys, 6, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(keys[:2]), "d0", 2))
    core.free(grant.extent_id)  # a late free of the reclaimed extent is harmless
    core.expire(T0 + 100.0)
    assert_integrity(core, free_all=True)
    core.store.close()


def test_pressure_cancels_a_reading_entry_which_frees_itself_at_its_next_block(tmp_path: Path) -> None:
    """A staged read yielding to a held-open real read is cancelled by a lease short of room: its
    reader wakes, reads no further block and frees the extent, and the lease gets the room."""
    core = reader(tmp_path, buffer_blocks=8, fraction=1.0)
    real_keys, keys = stored_chain(core, 1, 16), stored_chain(core, 5, 17)
    inside, release = threading.Event(), threading.Event()
    inner = core.store.get_many_into

    def held(keys_, outs, before_read=None, on_verified=None, **more):  # type: ignore[no-untyped-def]
        if before_read is not None:
            inside.set()
            release.wait(10)
        return inner(keys_, outs, before_read=before_read, on_verified=on_verified, **more)

    core.store.get_many_into = held  # type: ignore[method-assign]
    real = threading.Thread(target=lambda: core.read_blocks("real@0", real_keys, 1, ReadPath.PE))
    real.start()
    assert inside.wait(10)
    results: list[bool] = []
    ahead = threading.Thread(target=lambda: results.append(core.stage_ahead(order(keys), T0)))
    ahead.start()
    ahead.join(0.1)
    assert core.pool.free_blocks() == 2, "1 block for the real read, 5 for the staged one"
    extent = core.lease("other@0", 4)  # waits until the cancelled reader freed its 5 blocks
    ahead.join(10)
    assert results == [False], "the cancelled order reports it did not stage"
    counts = core.staging_counts()
    assert (counts.staged, counts.cancelled) == (0, 5), "no block was read after the cancel; all 5 counted"
    release.set()
    real.join(10)
    core.free(extent.extent_id)
    free_all_and_check(core)


def test_the_in_process_readers_port_stages_ahead_and_claims(tmp_path: Path) -> None:
    """tests/fakes.py FakeReaders carries `staged` through the ReaderPort's stage, as RayReaders
    does to the actor, and runs orders as the actor's stage_ahead."""
    from tests.fakes import Fabric, FakeReaders

    core = reader(tmp_path)
    readers = FakeReaders({"d0": core}, Fabric())
    keys = stored_chain(core, 3, 18)
    readers.stage_ahead([order(keys[:2])], T0)
    grant = readers.read_hits("d0", "req@0", keys, 4, ReadPath.DE, staged=StagedRead(stage_id_of(keys[:2]), "d0", 2)).wait()
    assert core.staging_counts().used == 2, "the port's stage claimed the staged extent"
    assert readers.calls == ["stage_ahead", "read_hits"]
    readers.free(grant)
    readers.close()
    assert_integrity(core, free_all=True)
    core.store.close()


def test_the_reader_exports_its_staging_counts_as_staged_blocks_by_outcome(tmp_path: Path) -> None:
    from dualpath_ray import metrics as m
    from dualpath_ray.runtime.telemetry.actor_metrics import ReaderMetrics
    from tests.metric_sink import RecordingSink

    core = reader(tmp_path)
    keys = stored_chain(core, 3, 19)
    core.stage_ahead(order(keys[:2]), T0)
    core.stage_ahead(order(keys[:2]), T0)  # a duplicate: skipped
    core.free(core.read_hits("req@0", keys, 3, ReadPath.DE, "reader/d0", staged=StagedRead(stage_id_of(keys[:2]), "d0", 2)).extent_id)
    sink = RecordingSink()
    ReaderMetrics(sink, core, "decode").collect()
    for outcome, blocks in core.staging_counts().as_dict().items():
        assert sink.counter(m.STAGED_BLOCKS, node="d0", role="decode", outcome=outcome) == blocks, (
            f"dualpath_staged_blocks{{outcome={outcome}}} equals the reader's count"
        )
    assert (core.staging_counts().staged, core.staging_counts().used, core.staging_counts().skipped) == (2, 2, 2)
    assert_integrity(core, free_all=True)
    core.store.close()
