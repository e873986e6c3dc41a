"""The storage reader's logic, without Ray: buffer extents, hit-block reads, persists.

Its parts: the extents by owner (runtime/reader/extents.py), tool-time staging (stager.py), the
block writes (writer.py); the hit-block reads are its own.

`ReaderCore` is what the reader actor (runtime/reader/actor.py) runs for its node, and what the
unit tests and the in-process engine harness (tests/engine_harness.py) call directly. It is
handed plain settings (`ReaderSettings`) and its collaborators: the block store, the two
directions of the node's SNIC (runtime/reader/snic.py) and the fault injector (`ReaderFaults`);
the actor builds those from the config (`build_core`), a test may hand in fakes (tests/fakes.py).

The read queue it reports (`read_q`) is the number of hit tokens whose blocks are waiting for,
or being read through, the SNIC. A PE-path read counts from the moment it is asked, while it
waits for its extent too: that extent is a cost of the PE path alone. A DE-path read counts only
once its extent is leased: every request leases that decode-node extent whichever path reads its
hits (the KV it sends lands there), so waiting for it says nothing about which side should read,
and counting it made congested decode buffers push reads onto the prefill nodes' SNICs.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from dualpath_ray.faults.injector import FaultCount
from dualpath_ray.faults.plan import FaultMode, FaultSite
from dualpath_ray.faults.store import damage_stored_block
from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.digest import block_digests
from dualpath_ray.kv.errors import BadBlockError, BlockCorruptedError, BlockNotFoundError, IncompatibleBlockError
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool, Extent, ExtentState
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.messages import ExtentGrant, PersistedBlock, StagedRead
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.reader.extents import ExtentRetiredError, ReaderExtents, ReclaimedOwnerError
from dualpath_ray.runtime.reader.hot_blocks import HotBlocks
from dualpath_ray.runtime.reader.read_time import StoreReadTime
from dualpath_ray.runtime.reader.recent_keys import RecentKeys
from dualpath_ray.runtime.reader.settings import ReaderFaults, ReaderSettings
from dualpath_ray.runtime.reader.snic import ReadTurn, SnicLink
from dualpath_ray.kv.staged import StagingCounts
from dualpath_ray.runtime.reader.stager import ReaderStaging
from dualpath_ray.runtime.reader.store_errors import WriteRefusals, bad_block_kind
from dualpath_ray.runtime.reader.writer import BlockWriter
from dualpath_ray.scheduling.staging import StageOrder

# The errors of leases and reads (runtime/reader/extents.py) are the core's to its callers.
__all__ = ["ExtentRetiredError", "ReaderCore", "ReaderFaults", "ReaderSettings", "ReclaimedOwnerError"]


class ReaderCore:
    """The reader's logic, independent of Ray so the tests and the actor share it.

    One lock (`_cond`) guards the extents, the read queue, the counters and the integrity keys
    together: a verified block leaves the read queue in the same critical section that charges it
    to the SNIC read counter, and a freed extent wakes the leases waiting for room under it."""

    def __init__(
        self,
        settings: ReaderSettings,
        layout: KVLayout,
        store: BlockStore,
        links: tuple[SnicLink, SnicLink],
        faults: ReaderFaults,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.incarnation = settings.incarnation
        self.layout = layout
        self._store = store
        # A writer that crashed between write and publish left a temporary no reader will ever
        # see (publish is an atomic rename); sweep those once at start so they do not pile up.
        self.swept_temporaries = store.remove_stale_temporaries(settings.stale_temporary_s)
        self.pool = BufferPool(settings.buffer_blocks, layout, pin=settings.pin_host_buffers)
        # (read, write): a NIC is full duplex, so persists (NIC transmit) never slow hit-KV reads
        # (NIC receive), as the paper counts CNIC read and write separately.
        self.snic_read, self.snic_write = links
        self.counters = NodeCounters()
        self.faults = faults
        # Keys whose stored block this reader damaged (fault plan) and keys it found corrupt:
        # a chaos test proves every damage was caught by comparing the two. Bounded (the newest
        # settings.bad_key_cap of each, runtime/reader/recent_keys.py): a reader on a failing
        # disk must not grow them for good; the comparison holds while neither dropped a key.
        self.damaged_keys = RecentKeys(settings.bad_key_cap)
        self.corrupt_keys = RecentKeys(settings.bad_key_cap)
        # Keys whose file the store could not read (an I/O error), bounded the same way.
        self.unreadable_keys = RecentKeys(settings.bad_key_cap)
        # Store reads stopped because their extent was freed or reclaimed while they ran.
        self.retired_reads = 0
        self._read_q_tokens = 0
        # Called (under this core's lock) whenever the read queue changed: the actor's reporter.
        self.on_read_q: Callable[[], None] = lambda: None
        self._cond = threading.Condition()
        self.read_time = StoreReadTime(self.counters, self._cond, clock)  # counters.store_read_s
        # Tool-time staging (runtime/reader/stager.py): under this core's lock, fed by its reads.
        self.stager = ReaderStaging(
            self.pool, store, self.snic_read, layout, self.counters, self._cond, settings.stage_cap_blocks
        )
        # Extents by owner (runtime/reader/extents.py): under this core's lock too.
        self.extents = ReaderExtents(settings.node_id, self.pool, self._cond, settings.lease_timeout_s, self.stager.relieve)
        # Persists (runtime/reader/writer.py): the store's refusals, the persist digest check.
        self.writer = BlockWriter(settings.node_id, layout, store, self.snic_write, faults, self.counters, self._cond)
        # In-flight sharing's hot tier of fresh prompt blocks (hot_blocks.py); None = off.
        self.hot = HotBlocks(settings.hot_blocks) if settings.hot_blocks else None

    @property
    def store(self) -> BlockStore:
        return self._store

    @store.setter
    def store(self, store: BlockStore) -> None:
        """Reads, staged reads and writes all go to `store` from now on (a test swaps in a fake)."""
        self._store = self.stager.store = self.writer.store = store

    @property
    def write_refusals(self) -> WriteRefusals:
        """Block writes the store refused (a full disk, an I/O error)."""
        return self.writer.refusals

    @property
    def persist_mismatches(self) -> int:
        """Blocks not published because the bytes the store wrote failed their engine's digest."""
        with self._cond:
            return self.writer.persist_mismatches

    # --- extents (runtime/reader/extents.py) ------------------------------------------

    def lease(self, owner: str, n_blocks: int) -> Extent:
        """Lease n_blocks slots, waiting while the pool is full (back-pressure, not failure)."""
        return self.extents.lease(owner, n_blocks)

    def free(self, extent_id: int) -> None:
        """Give an extent back; a no-op if already freed or reclaimed. One that a transfer
        still uses (a store read filling it, a write or D2H pull reading it) is free once that
        transfer ends, and a read into it stops at its next block and fails."""
        self.extents.free(extent_id)

    def begin_write(self, extent_id: int) -> Extent:
        """The extent is a store write's (or D2H pull's) until `end_write`."""
        return self.extents.begin_write(extent_id)

    def end_write(self, extent_id: int) -> None:
        """The write from the extent ended: it is freed in any case."""
        self.extents.end_write(extent_id)

    def reclaim(self, owner: str) -> int:
        """Retire the extents of an attempt that is over (its engine died, or failed it); returns
        how many. One a transfer still uses is free when it ends; the attempt's later leases,
        and one waiting for room now, are refused (ReclaimedOwnerError)."""
        return self.extents.reclaim(owner)

    def grant(self, extent: Extent, reader: str) -> ExtentGrant:
        """The extent as an engine addresses it: `reader` is this reader's endpoint name (the
        transport peer of the one-sided moves into its buffer)."""
        return ExtentGrant(self.node_id, reader, extent.extent_id, extent.slots, incarnation=self.incarnation)

    def read_hits(
        self, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, reader: str, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> ExtentGrant:
        """read_blocks, granted with the digests of the verified hit KV (runtime.kv_digests).
        With `staged` (a claim of a tool-time staged extent), the staged extent is handed over
        instead of reading its blocks, if this reader still holds it for these keys."""
        filled = None
        if staged is not None and 0 <= first_block and first_block + len(keys) <= total_blocks:  # else: raises below
            filled = self._claim_staged(owner, keys, total_blocks, path, first_block, staged)
        if filled is None:
            self._check_fits(owner, keys, total_blocks, first_block)
            filled = self._read(owner, keys, path, first_block, lambda: self.lease(owner, total_blocks), digests=True)
        extent, digests = filled
        return ExtentGrant(self.node_id, reader, extent.extent_id, extent.slots, digests, self.incarnation)

    # --- tool-time staging (runtime/reader/stager.py) -----------------------------------------

    def stage_ahead(self, order: StageOrder, now: float) -> bool:
        """Read an order's blocks ahead on this thread, behind real reads (False: skipped/failed)."""
        return self.stager.stage_ahead(order, now)

    def expire(self, now: float) -> float | None:
        """Free the staged extents past their deadline; the next deadline (None: none staged)."""
        return self.stager.expire(now)

    def staging_counts(self) -> StagingCounts:
        """Staged blocks by outcome (staged, used, expired, cancelled, skipped, failed, missed)."""
        return self.stager.counts()

    def _claim_staged(
        self, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int, staged: StagedRead
    ) -> tuple[Extent, np.ndarray | None] | None:
        """The claimed staged extent, grown to total_blocks with the rest of `keys` read into it;
        None (a counted miss) when it cannot be claimed: the caller reads all of them."""
        claimed = self.stager.claim(staged, self.node_id, owner, keys, path, first_block)
        if claimed is None:
            return None
        self.extents.track(claimed)  # reclaim(owner) frees it from now on
        have = claimed.n_blocks

        def grown() -> Extent:
            if total_blocks == have:
                return claimed
            try:
                return self.extents.wait_for_room(owner, total_blocks - have, lambda: self.pool.grow(claimed.extent_id, total_blocks - have))
            except BaseException:
                self.free(claimed.extent_id)
                raise

        # The digests cover every hit block, the staged ones too: taken while the grown extent's
        # read is still a transfer, so no free or reclaim can hand its slots on before.
        return self._read(owner, keys[have:], path, have, grown, digests=True, digest_from=0)

    # --- storage I/O --------------------------------------------------------------------

    def read_blocks(self, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0) -> Extent:
        """Lease an extent of total_blocks and read the hit blocks `keys` into its slots from
        `first_block` on (the prompt's block positions; a split read's decode side starts past
        the blocks the prefill side reads).

        One store read of all hit blocks (the store overlaps them on its helper threads); the
        SNIC bucket is taken per block just before that block's read, and each block leaves the
        read queue (and enters the SNIC read counter) once it is verified. On a failure the
        extent is freed and the queue drops every block that was not read.
        """
        self._check_fits(owner, keys, total_blocks, first_block)
        return self._read(owner, keys, path, first_block, lambda: self.lease(owner, total_blocks))[0]

    @staticmethod
    def _check_fits(owner: str, keys: Sequence[str], total_blocks: int, first_block: int) -> None:
        if first_block < 0 or first_block + len(keys) > total_blocks:
            raise ValueError(
                f"request {owner}: blocks [{first_block}, {first_block + len(keys)}) do not fit an extent of {total_blocks}"
            )

    def _read(
        self, owner: str, keys: Sequence[str], path: ReadPath, first_block: int, get_extent: Callable[[], Extent],
        digests: bool = False, digest_from: int | None = None,
    ) -> tuple[Extent, np.ndarray | None]:
        """read_blocks into the extent `get_extent` leases (or grows), which it frees itself if
        it fails; from entering the read queue to its end the read counts as a real read, which
        staged reads yield to. With `digests` (and runtime.kv_digests), also the digests of the
        hit blocks from `digest_from` (default: `first_block`) to the last one read.

        The read is a transfer of the extent (kv/pool.py): a free or reclaim while it runs only
        retires the extent, whose slots stay out of the free list until the read ended; the read
        stops at its next block and fails with ExtentRetiredError, and its digests are taken
        before it ends, so they certify bytes no other lease can have written."""
        block_bytes = self.layout.full_block_bytes
        block_tokens = self.layout.block_size
        pending = len(keys) * block_tokens
        verified = 0
        queued = False  # whether pending is in the read queue yet (see the module doc)

        def enqueue() -> None:
            nonlocal queued
            with self._cond:
                self._read_q_tokens += pending
                if keys:
                    self.stager.real_read_began()
                self.on_read_q()
            queued = True

        if path is not ReadPath.DE:
            enqueue()

        turn = ReadTurn(None, 0)  # the SNIC turn of the blocks the hot tier does not serve, below
        cold = list(range(len(keys)))  # the blocks read from the store

        def on_failed(index: int, error: BaseException) -> None:
            # Every bad block the read found, not only the one it raises for: the store reads
            # several at once, and a corrupt block left unnamed would stay unrepaired and uncounted.
            kind = bad_block_kind(error)
            if kind is not None:
                self._note_bad_block(kind, keys[index])

        def on_verified(_: int, snic: bool = True) -> None:
            nonlocal pending, verified
            verified += snic  # store reads only: the first bad block is the one after them
            with self._cond:
                if snic:
                    self.counters.snic_read[path] += block_bytes
                self._read_q_tokens -= block_tokens
                pending -= block_tokens
                self.on_read_q()

        try:
            extent = get_extent()
            if not queued:
                enqueue()
            start, end = (first_block if digest_from is None else digest_from), first_block + len(keys)
            wants_digests = digests and self.settings.kv_digests and end > start
            if not keys and not wants_digests:
                return extent, None
            self.extents.begin_read(extent)

            def before_read(index: int) -> None:
                if self.pool.state_of(extent.extent_id) is ExtentState.RETIRING:
                    raise ExtentRetiredError(self.extents.retired_detail(extent))  # stop: nobody wants these bytes
                if self.faults.active:
                    self._store_read_fault(keys[index])
                self.snic_read.take(block_bytes)
                turn.took_one()

            try:
                if keys:
                    outs = [self.pool.full_block(slot) for slot in extent.slots[first_block:end]]
                    if self.hot is not None:  # blocks a producer's prompt left on this node
                        cold = self.hot.serve(keys, outs)
                        for _ in range(len(keys) - len(cold)):
                            on_verified(0, snic=False)
                    # Indices below are into the blocks read from the store, in key order.
                    turn = ReadTurn(self.snic_read.turns if cold else None, len(cold))
                    turn.begin()
                    with self.read_time.reading():
                        self.store.get_many_into(
                            [keys[i] for i in cold], [outs[i] for i in cold],
                            before_read=lambda i: before_read(cold[i]), on_verified=on_verified,
                            on_failed=lambda i, error: on_failed(cold[i], error),
                        )
                hit_digests = self._digests(extent, start, end) if wants_digests else None
            except (BlockNotFoundError, BlockCorruptedError, IncompatibleBlockError, OSError) as exc:
                # The store raises for the first bad block in key order, the one after the
                # verified ones: name it, so the scheduler repairs that block and no other
                # (on_failed has already noted it, with every other bad block the read found).
                retired = self.extents.end_transfer(extent.extent_id)
                kind = bad_block_kind(exc)
                if retired:
                    raise ExtentRetiredError(self.extents.retired_detail(extent)) from exc
                self.free(extent.extent_id)
                if kind is None:
                    raise
                raise BadBlockError(kind, keys[cold[verified]], str(exc)) from None
            except BaseException:
                if not self.extents.end_transfer(extent.extent_id):
                    self.free(extent.extent_id)
                raise
            if self.extents.end_transfer(extent.extent_id):
                raise ExtentRetiredError(self.extents.retired_detail(extent))
            return extent, hit_digests
        except ExtentRetiredError:
            with self._cond:
                self.retired_reads += 1
            raise
        finally:
            turn.end()
            if queued and keys:
                with self._cond:
                    self.stager.real_read_ended()
                    if pending:
                        self._read_q_tokens -= pending
                        self.on_read_q()

    def _digests(self, extent: Extent, start: int, end: int) -> np.ndarray:
        """Digests of the extent's blocks [start, end), taken while the read is its transfer."""
        hits = torch.stack([self.pool.full_block(slot) for slot in extent.slots[start:end]])
        return block_digests(hits, (end - start) * self.layout.block_size)

    def _note_bad_block(self, kind: str, key: str) -> None:
        if kind == "missing":
            return
        with self._cond:
            (self.corrupt_keys if kind == "corrupt" else self.unreadable_keys).add(key)

    def _store_read_fault(self, key: str) -> None:
        spec = self.faults.decide(FaultSite.STORE_READ)
        if spec is None:
            return
        if spec.mode is FaultMode.FAIL:
            # Raised inside the store's read of this block, as the file system's own EIO is.
            raise OSError(errno.EIO, f"injected store_read fault: I/O error reading block {key}")
        if damage_stored_block(self.store, key, self.faults.corruption_rng):
            with self._cond:
                self.damaged_keys.add(key)

    def read_q(self) -> int:
        with self._cond:
            return self._read_q_tokens

    def fault_counts(self) -> dict[str, FaultCount]:
        return self.faults.counts()

    def integrity_keys(self) -> tuple[list[str], list[str]]:
        """(keys of blocks this reader damaged, keys it found corrupt): the newest of each, up to
        settings.bad_key_cap (see __init__)."""
        with self._cond:
            return sorted(self.damaged_keys), sorted(self.corrupt_keys)

    def corrupt_found(self) -> int:
        """Distinct corrupt blocks found so far, past the cap of the keys remembered too."""
        with self._cond:
            return self.corrupt_keys.total

    def store_faults(self) -> tuple[list[str], int]:
        """(keys of hit blocks the store could not read, block writes the store refused)."""
        with self._cond:
            return sorted(self.unreadable_keys), self.write_refusals.count

    def write_block(self, block: PersistedBlock, data: torch.Tensor) -> bool:
        """BlockWriter.write_block (runtime/reader/writer.py)."""
        return self.writer.write_block(block, data)

    def write_blocks(self, blocks: Sequence[tuple[torch.Tensor, PersistedBlock]]) -> int:
        """BlockWriter.write_blocks: how many leading blocks are stored (a refused write, or one
        whose bytes fail their engine's digest, ends the chain there without raising)."""
        return self.writer.write_blocks(blocks)

    def _as_held(self, data: torch.Tensor, block: PersistedBlock) -> tuple[torch.Tensor, PersistedBlock]:
        """A block to write as the hot tier holds it, if it does (another persist's copy: its
        bytes may have been served already, so they are the ones the store must get)."""
        assert self.hot is not None
        held = self.hot.held_copy(block.key)
        if held is None:
            return data, block
        return held[0], PersistedBlock(block.key, block.parent, held[1])

    def write_extent(
        self, extent_id: int, blocks: Sequence[tuple[int, PersistedBlock]], on_hot: Callable[[str], None] | None = None,
    ) -> int:
        """write_blocks of (index in the extent, key) pairs from an extent, then free it in any case.
        With the hot tier, the blocks are held in memory first and `on_hot(owner)` is told before
        they are written (in-flight sharing publishes them then: hot_blocks.py)."""
        extent = self.begin_write(extent_id)
        keys = [block.key for _, block in blocks]
        stored = 0
        fresh: list[str] = []  # keys this write stored with its bytes (hot_blocks.py: whose copy stays)
        try:
            data = [(self.pool.full_block(extent.slots[index]), block) for index, block in blocks]
            # A key the store has already is served by the store (its bytes may not be this copy's:
            # hot_blocks.py); the rest are held, and dropped again if another write beats this one.
            if self.hot is not None and on_hot is not None and data and self.hot.hold(
                [(block_data, block) for block_data, block in data if not self.store.contains(block.key)], holder=extent_id,
            ):
                on_hot(extent.owner)
            if self.hot is not None:
                data = [self._as_held(block_data, block) for block_data, block in data]
            stored = self.writer.write_blocks(data, fresh)
            return stored
        finally:
            if self.hot is not None:
                self.hot.written(fresh, holder=extent_id)
                self.hot.stored_already([key for key in keys[:stored] if key not in fresh])
                self.hot.dropped(keys[stored:])
            self.end_write(extent_id)

