"""ReaderCore without Ray: read queue and SNIC accounting per verified block, failed reads, writes.

Each core is built as the actor's `build_core` builds one, from plain settings and its
collaborators: a local store in tmp_path, plain (unpaced) SNIC links and an empty fault plan,
unless a test hands in an emulated link or the in-process fakes of tests/fakes.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import FaultMode, FaultPlan, FaultSite
from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.runtime.emulation.links import FifoTurns, Link, TokenBucket
from dualpath_ray.runtime.reader.core import ReaderCore, ReaderFaults, ReaderSettings, ReclaimedOwnerError
from dualpath_ray.runtime.reader.snic import SnicLink
from dualpath_ray.protocol.types import ReadPath
from tests.fakes import FakeSnicLink, ScriptedFaults
from tests.helpers import wait_until

STALE_TEMPORARY_S = 600.0


def kv_layout() -> KVLayout:
    """The default model's KV layout, at the default block size."""
    cfg = DualPathConfig()
    return KVLayout.from_model(cfg.model, cfg.store.block_size)


def reader_core(
    root: Path,
    *,
    buffer_blocks: int = 8,
    links: tuple[SnicLink, SnicLink] | None = None,
    faults: ReaderFaults | None = None,
    incarnation: str = "",
) -> ReaderCore:
    """Node n0's reader over a local store at `root`; plain links and no faults unless given."""
    layout = kv_layout()
    settings = ReaderSettings(
        node_id="n0", buffer_blocks=buffer_blocks, lease_timeout_s=60.0,
        stale_temporary_s=STALE_TEMPORARY_S, incarnation=incarnation,
    )
    return ReaderCore(
        settings, layout, LocalDirStore(root, layout),
        links or (Link("snic-read/n0"), Link("snic-write/n0")),
        faults or FaultInjector(FaultPlan(), "reader/n0"),
    )


def test_reader_read_queue_drops_per_verified_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    keys = block_keys(list(range(4 * layout.block_size)), layout.block_size, namespace_for("reader", 0))
    for i, key in enumerate(keys):
        core.store.put(key, torch.full(layout.full_block_shape, i + 1, dtype=torch.uint8))
    seen: list[tuple[int, int, int]] = []
    inner = core.store.get_many_into

    def recording(keys, outs, before_read=None, on_verified=None, on_failed=None):  # type: ignore[no-untyped-def]
        def verified(i: int) -> None:
            on_verified(i)
            seen.append((i, core.read_q(), core.counters.snic_read["pe"]))

        inner(keys, outs, before_read=before_read, on_verified=verified, on_failed=on_failed)

    monkeypatch.setattr(core.store, "get_many_into", recording)
    extent = core.read_blocks("r1", keys, 6, ReadPath.PE)
    expected = [(i, (3 - i) * layout.block_size, (i + 1) * layout.full_block_bytes) for i in range(4)]
    assert seen == expected, "each verified block must leave the read queue and enter the SNIC counter at once"
    assert core.read_q() == 0, "the read queue must be exactly empty after the read"
    assert core.snic_read.bytes_total == 4 * layout.full_block_bytes, "the SNIC read direction is charged once per block"
    assert core.counters.store_read_s > 0 and core.read_time.in_flight == 0, "the read's time is counted once it ended"
    for i in range(4):
        assert int(core.pool.full_block(extent.slots[i])[0, 0, 0]) == i + 1, f"hit block {i} must land in slot {i}"
    core.free(extent.extent_id)
    core.store.close()


def refused_leases(core: ReaderCore) -> list[str]:
    """The owners of the leases the core's pool refused for want of room, as they happen (a
    lease refused once waits for room from then on)."""
    refused: list[str] = []
    lease = core.pool.lease

    def counted_lease(owner: str, n_blocks: int):  # type: ignore[no-untyped-def]
        extent = lease(owner, n_blocks)
        if extent is None:
            refused.append(owner)
        return extent

    core.pool.lease = counted_lease  # type: ignore[method-assign]
    return refused


@pytest.mark.parametrize(("path", "counted_while_waiting"), [(ReadPath.PE, True), (ReadPath.DE, False)])
def test_a_read_waiting_for_its_extent_counts_in_the_read_queue_only_on_the_pe_path(
    tmp_path: Path, path: ReadPath, counted_while_waiting: bool
) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    keys = block_keys(list(range(2 * layout.block_size)), layout.block_size, namespace_for("wait", 0))
    for key in keys:
        core.store.put(key, torch.zeros(layout.full_block_shape, dtype=torch.uint8))
    hog = core.lease("hog", core.pool.capacity)
    refused = refused_leases(core)
    done: list[int] = []
    reading = threading.Thread(target=lambda: done.append(core.read_blocks("r1", keys, 2, path).extent_id))
    reading.start()
    wait_until(lambda: bool(refused))  # the read found the pool full: it waits for room from now on
    expected = 2 * layout.block_size if counted_while_waiting else 0
    assert not done and core.read_q() == expected, (
        "hits waiting for a PE extent are that path's cost and count; a DE read's decode-node extent is "
        "leased by every request whatever its path, so waiting for it does not"
    )
    core.free(hog.extent_id)
    reading.join(timeout=10)
    assert done and core.read_q() == 0, "once leased and read, the queue is empty again"
    core.free(done[0])
    assert core.pool.check_integrity().free == core.pool.capacity, "every extent is back"
    core.store.close()


def test_reader_failed_read_frees_the_extent_and_empties_the_queue(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    keys = block_keys(list(range(4 * layout.block_size)), layout.block_size, namespace_for("reader", 1))
    for i, key in enumerate(keys[:2]):
        core.store.put(key, torch.full(layout.full_block_shape, i + 1, dtype=torch.uint8))
    free_before = core.pool.check_integrity().free
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1", keys, 4, ReadPath.DE)
    assert (failed.value.kind, failed.value.key) == ("missing", keys[2]), "the error names the first bad block"
    assert core.read_q() == 0, "a failed read must leave no tokens in the read queue"
    assert core.counters.snic_read["de"] == 2 * layout.full_block_bytes, "only the verified blocks are counted"
    assert core.pool.check_integrity().free == free_before, "a failed read must free the extent it leased"
    core.store.close()


def test_an_emulated_snic_serves_whole_reads_first_come_first_served(tmp_path: Path) -> None:
    """Concurrent reads on an emulated SNIC finish one after another in arrival order, as the
    paper's FIFO read queue and the simulator's link do, not all together at the end; a read that
    fails gives its turn up to the next."""
    layout = kv_layout()
    block = layout.full_block_bytes
    # 4 blocks per read at 20 blocks/s: 0.2 s a read alone.
    rate = 20 * block
    turns = RecordedTurns()
    read_link = Link("snic-read/n0", TokenBucket(rate, rate * 0.001), turns)
    turns.link = read_link
    links = (read_link, Link("snic-write/n0", TokenBucket(rate, rate * 0.001), FifoTurns()))
    core = reader_core(tmp_path, buffer_blocks=16, links=links)
    reads = {}
    for name in ("a", "b", "c"):
        keys = block_keys(list(range(4 * layout.block_size)), layout.block_size, namespace_for(name, 0))
        for key in keys:
            core.store.put(key, torch.zeros(layout.full_block_shape, dtype=torch.uint8))
        reads[name] = keys
    missing = block_keys(list(range(4 * layout.block_size)), layout.block_size, namespace_for("gone", 0))
    core.store.put(missing[0], torch.zeros(layout.full_block_shape, dtype=torch.uint8))
    finished: list[str] = []

    def read(name: str, keys: list[str]) -> None:
        try:
            extent = core.read_blocks(name, keys, 4, ReadPath.PE)
            core.free(extent.extent_id)
        except BadBlockError:
            pass
        finished.append(name)

    threads = []
    for arrival, (name, keys) in enumerate([("a", reads["a"]), ("gone", missing), ("b", reads["b"]), ("c", reads["c"])]):
        thread = threading.Thread(target=read, args=(name, keys))
        thread.start()
        threads.append(thread)
        # the next read asks only once this one has its ticket (or, taking no turn, is done)
        wait_until(lambda: turns.issued() > arrival or not thread.is_alive())
    for thread in threads:
        thread.join()
    order = [name for name in finished if name != "gone"]
    assert order == ["a", "b", "c"], "whole reads finish in arrival order"
    carried = turns.carried_at_end
    assert [ticket for ticket, _ in carried] == [0, 1, 2, 3], f"each read's turn ended once, in ticket order: {carried}"
    ends = [nbytes for _, nbytes in carried]
    assert ends[0] == 4 * block and ends[2] - ends[1] == ends[3] - ends[2] == 4 * block, (
        f"during each whole read's turn the link carried that read's 4 blocks and nothing else, so the first "
        f"read does not wait for the whole wave (no processor sharing): bytes at each turn's end {ends}"
    )
    assert core.read_q() == 0, "every read left the queue, the failed one included"
    core.store.close()


class RecordedTurns(FifoTurns):
    """FIFO turns that note the bytes their link had carried when each turn ended."""

    link: Link

    def __init__(self) -> None:
        super().__init__()
        self.carried_at_end: list[tuple[int, int]] = []

    def issued(self) -> int:
        """Tickets handed out so far (turns asked for)."""
        with self._cond:
            return self._next_ticket

    def done(self, ticket: int) -> None:
        self.carried_at_end.append((ticket, self.link.bytes_total))
        super().done(ticket)


def test_write_extent_stores_its_blocks_and_frees_the_extent_even_on_failure(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    keys = block_keys(list(range(2 * layout.block_size)), layout.block_size, namespace_for("reader", 2))
    extent = core.lease("r1", 3)
    for i in range(2):
        core.pool.full_block(extent.slots[i]).fill_(i + 5)
    blocks = [(0, PersistedBlock(keys[0], None)), (1, PersistedBlock(keys[1], keys[0]))]
    assert core.write_extent(extent.extent_id, blocks) == 2, "both blocks are stored"
    assert core.counters.snic_write == 2 * layout.full_block_bytes, "each written block is charged to the SNIC"
    assert core.snic_write.bytes_total == 2 * layout.full_block_bytes, "persists take the SNIC's write direction"
    assert core.snic_read.bytes_total == 0, "persists never take read bandwidth (the NIC is full duplex)"
    out = layout.empty_full_block()
    core.store.get_into(keys[1], out)
    assert bool((out == 6).all()), "the stored bytes are the extent slot's"
    assert core.pool.check_integrity().free == core.pool.capacity, "the extent is freed after its writes"
    bad = core.lease("r2", 1)
    with pytest.raises(ValueError, match="invalid block key"):
        core.write_extent(bad.extent_id, [(0, PersistedBlock("not-a-key", None))])
    assert core.pool.check_integrity().free == core.pool.capacity, "a failed write still frees its extent"
    core.store.close()


def test_a_starting_reader_sweeps_temporaries_of_crashed_puts_only_once_they_are_stale(tmp_path: Path) -> None:
    import os

    first = reader_core(tmp_path)
    key = block_keys(list(range(first.layout.block_size)), first.layout.block_size, namespace_for("reader", 3))[0]
    folder = first.store.path_of(key).parent
    folder.mkdir(parents=True, exist_ok=True)
    stale, fresh = folder / f".{key}.1.aaaa.tmp", folder / f".{key}.2.bbbb.tmp"
    for temp in (stale, fresh):
        temp.write_bytes(b"half a block")
    old = time.time() - 2 * first.settings.stale_temporary_s
    os.utime(stale, (old, old))
    restarted = reader_core(tmp_path)
    assert restarted.swept_temporaries == 1, "exactly the stale temporary is swept at start"
    assert not stale.exists() and fresh.exists(), "a young temporary may be a put still running elsewhere"
    assert not restarted.store.contains(key), "a temporary never becomes a block"


def test_a_corrupt_block_is_named_by_key_and_its_extent_freed(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    keys = block_keys(list(range(3 * layout.block_size)), layout.block_size, namespace_for("reader", 4))
    for i, key in enumerate(keys):
        core.store.put(key, torch.full(layout.full_block_shape, i + 1, dtype=torch.uint8))
    path = core.store.path_of(keys[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    free_before = core.pool.check_integrity().free
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1", keys, 3, ReadPath.PE)
    assert (failed.value.kind, failed.value.key) == ("corrupt", keys[1]), "the flipped payload byte is caught at read"
    assert core.pool.check_integrity().free == free_before, "the failed read's extent is free again"
    core.store.close()


def test_reclaim_frees_a_dead_attempts_extents_and_a_late_free_is_harmless(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    dead, alive = core.lease("r1#0", 2), core.lease("r2#0", 3)
    assert core.reclaim("r1#0") == 1, "the dead attempt's one extent is reclaimed"
    counts = core.pool.check_integrity()
    assert counts.leased == 3 and counts.free == counts.capacity - 3, "only the other request's blocks stay leased"
    core.free(dead.extent_id)  # the late free of the engine that leased it
    assert core.pool.check_integrity().leased == 3, "a late free of a reclaimed extent frees nothing else"
    core.free(alive.extent_id)
    assert core.pool.check_integrity().free == core.pool.capacity, "every slot is free again"


def test_a_lease_of_a_reclaimed_attempt_is_refused_even_one_waiting_for_room(tmp_path: Path) -> None:
    """A dead engine's lease that was waiting for room (or arrives late) must not take blocks
    after its extents were reclaimed: nothing would ever free them (the chaos suite saw such a
    leak when a prefill engine was killed mid-batch)."""
    core = reader_core(tmp_path, buffer_blocks=4)
    filler = core.lease("r2#0", 4)
    outcome: list[BaseException | None] = []

    def waiting_lease() -> None:
        try:
            core.lease("r1#0", 2)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    refused = refused_leases(core)
    waiter = threading.Thread(target=waiting_lease)
    waiter.start()
    wait_until(lambda: bool(refused))  # the lease found no room: it waits for some from now on
    assert core.reclaim("r1#0") == 0, "the dead attempt holds nothing yet"
    core.free(filler.extent_id)
    waiter.join(5)
    assert outcome and isinstance(outcome[0], ReclaimedOwnerError), f"the waiting lease is refused: {outcome}"
    with pytest.raises(ReclaimedOwnerError):
        core.lease("r1#0", 1)  # a late one too
    assert core.pool.check_integrity().free == core.pool.capacity, "no block is held for the dead attempt"
    assert len(core.lease("r3#0", 4).slots) == 4, "the room goes to a live attempt"


def test_the_core_runs_on_in_process_fakes_of_its_links_and_fault_plan(tmp_path: Path) -> None:
    """With recording SNIC links and a scripted fault plan (tests/fakes.py) the core's fault sites
    are hit exactly where it says: a store_read fault is decided before that block pays the SNIC
    (a fail is the store's EIO: an unreadable block),
    a corrupt one is caught by the real checksum and named on both sides of the integrity check,
    and a dropped publish claims success, pays the SNIC but never reaches the store or the counter."""
    events: list[str] = []
    read_link, write_link = FakeSnicLink("snic-read/n0", events=events), FakeSnicLink("snic-write/n0", events=events)
    # One block per read: the store reads a batch's blocks on several threads, so only a
    # one-block read fixes which block meets which scripted decision.
    faults = ScriptedFaults({
        FaultSite.STORE_READ: [FaultMode.FAIL, FaultMode.CORRUPT, None],
        FaultSite.STORE_PUBLISH: [FaultMode.DROP, None],
    })
    core = reader_core(tmp_path, links=(read_link, write_link), faults=faults)
    layout = core.layout
    block = layout.full_block_bytes
    keys = block_keys(list(range(3 * layout.block_size)), layout.block_size, namespace_for("fakes", 0))
    for i, key in enumerate(keys):
        core.store.put(key, torch.full(layout.full_block_shape, i + 1, dtype=torch.uint8))

    with pytest.raises(BadBlockError, match="unreadable"):
        core.read_blocks("r1", keys[:1], 1, ReadPath.PE)  # an injected EIO, repaired as a real one
    assert read_link.takes == [], "a failed block never pays the SNIC: its fault is decided first"
    assert core.read_q() == 0 and core.pool.check_integrity().free == core.pool.capacity, (
        "an injected read failure leaves no queued tokens and no leased slot"
    )

    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r2", keys[1:2], 1, ReadPath.DE)
    assert (failed.value.kind, failed.value.key) == ("corrupt", keys[1]), "the damaged block is caught at read"
    assert core.integrity_keys() == ([keys[1]], [keys[1]]), "what the plan damaged is exactly what was found"
    assert read_link.takes == [block], "a damaged block was read, so it paid the SNIC"

    extent = core.read_blocks("r3", keys[2:], 2, ReadPath.PE)
    assert int(core.pool.full_block(extent.slots[0])[0, 0, 0]) == 3, "a block with no fault is read as stored"
    assert (core.counters.snic_read["pe"], core.counters.snic_read["de"]) == (block, 0), (
        "only verified blocks are counted, by their path"
    )

    events.clear()
    core.pool.full_block(extent.slots[1]).fill_(7)
    core.store.delete(keys[1])
    blocks = [(1, PersistedBlock(keys[1], None)), (0, PersistedBlock(keys[2], keys[1]))]
    assert core.write_extent(extent.extent_id, blocks) == 2, "the dropped write claims success; the other was stored already"
    assert events == ["take snic-write/n0"] * 2, "persists pay the write direction only, once per block"
    assert not core.store.contains(keys[1]), "a dropped publish never reaches the store"
    assert core.counters.snic_write == block, "only the write that happened is counted"
    assert faults.asked == [FaultSite.STORE_READ] * 3 + [FaultSite.STORE_PUBLISH] * 2, "every site event asked once"
    assert {label: c.injected for label, c in core.fault_counts().items()} == {
        "store_read:fail": 1, "store_read:corrupt": 1, "store_publish:drop": 1,
    }, "the core reports its injector's counts"
    assert core.pool.check_integrity().free == core.pool.capacity, "the persisted extent is freed"
    core.store.close()


def test_an_inactive_fault_plan_is_never_asked(tmp_path: Path) -> None:
    """Without faults the core skips its fault sites entirely (the fake fails if asked)."""
    link = FakeSnicLink("snic-read/n0")
    core = reader_core(tmp_path, links=(link, FakeSnicLink("snic-write/n0")), faults=ScriptedFaults())
    layout = core.layout
    keys = block_keys(list(range(2 * layout.block_size)), layout.block_size, namespace_for("fakes", 1))
    for key in keys:
        core.store.put(key, torch.zeros(layout.full_block_shape, dtype=torch.uint8))
    extent = core.read_blocks("r1", keys, 2, ReadPath.PE)
    assert link.takes == [layout.full_block_bytes] * 2, "each hit block pays the SNIC once"
    assert core.write_extent(extent.extent_id, [(0, PersistedBlock(keys[0], None))]) == 1, "already stored counts as stored"
    core.store.close()
