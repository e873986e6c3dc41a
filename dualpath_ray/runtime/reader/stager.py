"""The reader's side of tool-time staging (scheduling/staging.py): reading ahead, claims, pressure.

`ReaderStaging` runs a `StageOrder` on the calling thread: it leases the order's extent at once (never
waiting: an order the buffer has no room for under `cap_blocks` is skipped) and reads the keys
into it at low priority. Before each block it waits, on the reader core's condition, while any
real read is active (counted by the core from when a read enters the read queue until it ends),
unless a claim promoted it: a real read so waits for at most the one staged block already under
way. Staged reads never enter the read queue (they delay no real read), and their bytes count in
the SNIC read counter under the "de" path (the decode node's SNIC reads them).

A claim (`claim`) takes a live entry whose keys are the request's first hit keys, waits for a
READING one to finish (promoted to full priority) and adopts its extent to the request's owner;
the core then grows it and reads the rest. `relieve` cancels the oldest unclaimed entries when a
real lease finds the pool short; `expire` frees those past their deadline.

Shares the core's lock (`cond`): the table, the real-read count and the pool move together.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.errors import BlockCorruptedError, BlockNotFoundError, IncompatibleBlockError
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool, Extent
from dualpath_ray.kv.staged import CLAIMABLE, StagedExtent, StagedTable, StageEvent, StageState, StagingCounts
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.messages import StagedRead
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.reader.snic import SnicLink
from dualpath_ray.scheduling.staging import StageOrder

# The store's errors for one bad block: the staged read fails, the claim reads it again (and
# reports it as the normal read does).
_STORE_ERRORS = (BlockNotFoundError, BlockCorruptedError, IncompatibleBlockError, OSError)
STAGED_PATH = ReadPath.DE  # staged blocks are read by the decode node's SNIC


class ReaderStaging:
    """One node's staged extents and the reads that fill them (see the module doc)."""

    def __init__(
        self, pool: BufferPool, store: BlockStore, link: SnicLink, layout: KVLayout, counters: NodeCounters,
        cond: threading.Condition, cap_blocks: int,
    ) -> None:
        self.pool = pool
        self.store = store
        self.link = link
        self.layout = layout
        self.counters = counters
        self.cond = cond
        self.cap_blocks = cap_blocks
        self.table = StagedTable()
        self.real_reads = 0  # real reads between entering the read queue and their end
        # Called (outside the lock) with the deadline of each accepted order: the actor's timer.
        self.on_deadline: Callable[[float], None] = lambda _deadline: None

    # --- the real reads staging yields to (the core calls these under `cond`) --------------

    def real_read_began(self) -> None:
        self.real_reads += 1

    def real_read_ended(self) -> None:
        self.real_reads -= 1
        if self.real_reads < 0:
            raise RuntimeError("real read count went negative: a read ended twice")
        self.cond.notify_all()

    # --- orders --------------------------------------------------------------------------

    def stage_ahead(self, order: StageOrder, now: float) -> bool:
        """Run one order: lease, read ahead, hold until `now + ttl_s` (`now`: when the reader
        received it, runtime/reader/stage_queue.py, so time spent waiting counts). False if it
        was skipped (no keys, a live duplicate, no room under the cap or in the pool) or its
        read failed."""
        entry = self._accept(order, now)
        if entry is None:
            return False
        self.on_deadline(entry.deadline)
        return self._read_ahead(entry)

    def dropped(self, order: StageOrder, why: object) -> None:
        """An order the reader's queue dropped unread (full, or its time ran out waiting): skipped."""
        with self.cond:
            self.table.counts.skipped += order.blocks

    def _accept(self, order: StageOrder, now: float) -> StagedExtent | None:
        with self.cond:
            n = order.blocks
            refused = self.table.refuses(order.stage_id, n, self.cap_blocks)
            extent = None if refused else self.pool.lease(order.stage_id, n)
            if extent is None:
                self.table.counts.skipped += n
                return None
            entry = StagedExtent(order.stage_id, tuple(order.keys), extent.extent_id, now + order.ttl_s)
            self.table.add(entry)
            return entry

    def _read_ahead(self, entry: StagedExtent) -> bool:
        slots = self.pool.extent(entry.extent_id).slots
        block_bytes = self.layout.full_block_bytes
        try:
            for index, key in enumerate(entry.keys):
                if not self._may_read_next(entry):
                    break
                self.link.take(block_bytes)
                self.store.get_many_into([key], [self.pool.full_block(slots[index])])
                with self.cond:
                    self.counters.snic_read[STAGED_PATH] += block_bytes
                    self.table.counts.staged += 1
                    entry.read += 1
        except _STORE_ERRORS:
            self._fail(entry)
            return False
        except BaseException:
            self._fail(entry)
            raise
        return self._finish(entry)

    def _may_read_next(self, entry: StagedExtent) -> bool:
        """Wait while a real read is active (unless promoted); False once the entry has ended
        (expired or cancelled: its extent is freed by `_finish`)."""
        with self.cond:
            while entry.state is StageState.READING and self.real_reads > 0:
                self.cond.wait()
            return entry.state in (StageState.READING, StageState.PROMOTED)

    def _finish(self, entry: StagedExtent) -> bool:
        with self.cond:
            if entry.state in (StageState.READING, StageState.PROMOTED):
                # READING -> HELD; PROMOTED -> CLAIMED, which its waiting claimant takes over.
                self.table.move(entry, StageEvent.READ_DONE)
            else:
                self._free(entry)  # ended while it read: this thread owns the extent
            self.cond.notify_all()
            return entry.state in (StageState.HELD, StageState.CLAIMED)

    def _fail(self, entry: StagedExtent) -> None:
        with self.cond:
            if entry.state in (StageState.READING, StageState.PROMOTED):
                self.table.move(entry, StageEvent.FAIL)
            self._free(entry)
            self.cond.notify_all()

    def _free(self, entry: StagedExtent) -> None:
        """Give an ended entry's extent back (caller holds `cond`) and wake leases waiting for room."""
        self.pool.release(entry.extent_id)
        self.table.released(entry)
        self.cond.notify_all()

    # --- claims ---------------------------------------------------------------------------

    def claim(
        self, staged: StagedRead, node_id: str, owner: str, keys: Sequence[str], path: ReadPath, first_block: int
    ) -> Extent | None:
        """The staged extent `staged` names, adopted by `owner`, holding keys[:staged.blocks] at
        block positions [0, staged.blocks); None (a miss, counted) when this node holds no live
        entry for those keys on the DE path: the caller reads them as usual. Waits for a READING
        entry's last block (promoted: it no longer yields to real reads)."""
        blocks = staged.blocks
        with self.cond:
            entry = self.table.get(staged.stage_id) if staged.node_id == node_id else None
            usable = (
                entry is not None and entry.state in CLAIMABLE and path is STAGED_PATH and first_block == 0
                and 0 < blocks == entry.blocks <= len(keys) and entry.keys == tuple(keys[:blocks])
            )
            if entry is None or not usable:
                self.table.counts.missed += blocks
                return None
            if entry.state is StageState.HELD:
                self.table.move(entry, StageEvent.CLAIM)
            else:
                self.table.move(entry, StageEvent.PROMOTE)
                self.cond.notify_all()  # its reader may be waiting for real reads: not any more
                while entry.state is StageState.PROMOTED:
                    self.cond.wait()
            if entry.state is not StageState.CLAIMED:
                self.table.counts.missed += blocks  # its read failed: read them as usual
                return None
            self.table.released(entry)
            return self.pool.adopt(entry.extent_id, owner)

    # --- pressure and time -------------------------------------------------------------------

    def relieve(self, shortfall: int) -> int:
        """Cancel the oldest unclaimed entries whose blocks cover `shortfall` (caller holds
        `cond`): HELD ones are freed now, READING ones by their reader at its next block.
        Returns the blocks cancelled."""
        cancelled = 0
        for entry in self.table.victims(shortfall):
            was_held = entry.state is StageState.HELD
            self.table.move(entry, StageEvent.CANCEL)
            if was_held:
                self._free(entry)
            cancelled += entry.blocks
        if cancelled:
            self.cond.notify_all()
        return cancelled

    def expire(self, now: float) -> float | None:
        """End the entries past their deadline at `now`; the next deadline, or None."""
        with self.cond:
            for entry in self.table.due(now):
                was_held = entry.state is StageState.HELD
                self.table.move(entry, StageEvent.EXPIRE)
                if was_held:
                    self._free(entry)
            self.cond.notify_all()
            return self.table.next_deadline()

    def counts(self) -> StagingCounts:
        """A snapshot of the counts (the table's own go on changing)."""
        with self.cond:
            return dataclasses.replace(self.table.counts)
