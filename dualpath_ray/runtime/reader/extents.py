"""A node reader's extents by owner: leases that wait for room, frees and reclaims, and the
transfers (store reads into an extent, store writes and D2H pulls out of it) they must not
outrun.

An extent is tracked here from its lease until its owner frees it or a reclaim (its engine died)
takes it; a late free of one no longer tracked is a no-op (extent ids are never reused). Either
retires it in the pool (kv/pool.py): a LEASED extent is free at once, one under a transfer only
when that transfer ends, so a slot is free only when nothing reads into or out of it. A
transfer that finds its extent retired stops early where it can (a store read, at its next
block) and fails.

Guarded by the reader core's lock (`cond`), shared with the read queue and staging: a freed
extent wakes the leases waiting for room under it, and a lease short of room cancels staged
extents first (`relieve`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from dualpath_ray.kv.pool import BufferPool, Extent

MAX_RECLAIMED_OWNERS = 65536  # reclaimed attempts remembered (see ReaderExtents._reclaimed)


class ReclaimedOwnerError(RuntimeError):
    """A lease for an attempt whose extents were reclaimed: its engine is gone."""


class ExtentRetiredError(RuntimeError):
    """A store read's extent was freed or reclaimed while the read filled it: the read stopped at
    its next block and its bytes are nobody's (the slots are free once it ended)."""


class ReaderExtents:
    """The extents one reader leased, by id (see the module doc)."""

    def __init__(
        self, node_id: str, pool: BufferPool, cond: threading.Condition, lease_timeout_s: float,
        relieve: Callable[[int], int],
    ) -> None:
        self.node_id = node_id
        self.pool = pool
        self.cond = cond
        self.lease_timeout_s = lease_timeout_s
        self.relieve = relieve  # cancel staged extents covering a shortfall (caller holds cond)
        self._extents: dict[int, Extent] = {}
        # Attempts whose extents were reclaimed (their engine died), oldest first: a lease of
        # theirs still waiting for room, or arriving late, is refused, or it would hold its
        # blocks for an owner that will never free them. Bounded: an attempt is reclaimed once.
        self._reclaimed: dict[str, None] = {}

    def lease(self, owner: str, n_blocks: int) -> Extent:
        """Lease n_blocks slots, waiting while the pool is full (back-pressure, not failure)."""
        if n_blocks < 1:
            raise ValueError(f"request {owner}: an extent needs at least one block")
        if n_blocks > self.pool.capacity:
            raise ValueError(
                f"request {owner} needs {n_blocks} buffer blocks but node {self.node_id} has "
                f"{self.pool.capacity}; raise cluster.buffer_blocks_per_node"
            )
        return self.wait_for_room(owner, n_blocks, lambda: self.pool.lease(owner, n_blocks))

    def wait_for_room(self, owner: str, n_blocks: int, take: Callable[[], Extent | None]) -> Extent:
        """`take` (a lease, or a grow of a claimed staged extent, by n_blocks) once the pool has
        room, cancelling the oldest unclaimed staged extents when it has not (a real lease comes
        before a guess), else waiting for frees; the extent is tracked under its owner."""
        deadline = time.monotonic() + self.lease_timeout_s
        with self.cond:
            while True:
                self.refuse_reclaimed(owner)
                if (extent := take()) is not None:
                    break
                if self.relieve(n_blocks - self.pool.free_blocks()) and (extent := take()) is not None:
                    break
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"node {self.node_id}: no {n_blocks} free buffer blocks in {self.lease_timeout_s}s")
            self._extents[extent.extent_id] = extent
            return extent

    def ids(self) -> list[int]:
        """The ids of the extents tracked now (leased, or under a transfer and not yet freed)."""
        with self.cond:
            return list(self._extents)

    def refuse_reclaimed(self, owner: str) -> None:
        """ReclaimedOwnerError if `owner`'s extents were reclaimed (caller holds cond)."""
        if owner in self._reclaimed:
            raise ReclaimedOwnerError(f"node {self.node_id}: {owner}'s engine died; its extents were reclaimed")

    def track(self, extent: Extent) -> None:
        """An extent leased elsewhere (a claimed staged extent) is its owner's from now on: freed
        by its free or reclaim. Refused, and freed, if that owner was reclaimed already."""
        with self.cond:
            self._extents[extent.extent_id] = extent
            if extent.owner in self._reclaimed:  # reclaimed before it was tracked: nobody else frees it
                self.retire(extent.extent_id)
                self.refuse_reclaimed(extent.owner)

    def free(self, extent_id: int) -> None:
        """Give an extent back (see the module doc: retired, free once no transfer uses it)."""
        with self.cond:
            self.retire(extent_id)

    def retire(self, extent_id: int) -> bool:
        """Stop tracking the extent and retire it in the pool (caller holds cond); False if it
        was not tracked (already freed or reclaimed)."""
        if self._extents.pop(extent_id, None) is None:
            return False
        if self.pool.retire(extent_id):
            self.cond.notify_all()
        return True

    def reclaim(self, owner: str) -> int:
        """Retire the extents of one attempt that is over (its engine died, or failed it);
        returns how many. Its later leases, and one waiting for room now, are refused."""
        retired = 0
        with self.cond:
            self._reclaimed[owner] = None
            while len(self._reclaimed) > MAX_RECLAIMED_OWNERS:
                del self._reclaimed[next(iter(self._reclaimed))]
            for extent_id, extent in list(self._extents.items()):
                if extent.owner == owner and self.retire(extent_id):
                    retired += 1
            self.cond.notify_all()
        return retired

    # --- transfers ------------------------------------------------------------------------

    def begin_read(self, extent: Extent) -> None:
        """A store read into `extent` becomes its transfer, unless a free or reclaim took the
        extent since its lease (then nothing is read into it: ExtentRetiredError)."""
        with self.cond:
            if self._extents.get(extent.extent_id) is None:
                raise ExtentRetiredError(self.retired_detail(extent))
            self.pool.begin_transfer(extent.extent_id)

    def begin_write(self, extent_id: int) -> Extent:
        """The extent is a store write's (or D2H pull's) from now on: a free or reclaim meanwhile
        retires it, and its slots stay out of the free list until `end_write`. KeyError if it was
        already freed or reclaimed."""
        with self.cond:
            extent = self._extents[extent_id]
            self.pool.begin_transfer(extent_id)
            return extent

    def end_transfer(self, extent_id: int) -> bool:
        """A transfer on the extent ended: True if it had been retired meanwhile (free now)."""
        with self.cond:
            if self.pool.end_transfer(extent_id):
                self.cond.notify_all()
                return True
            return False

    def end_write(self, extent_id: int) -> None:
        """The write from the extent ended (either way): freed in any case, at once if a free or
        reclaim already retired it during the write."""
        with self.cond:
            self.end_transfer(extent_id)
            self.retire(extent_id)

    def retired_detail(self, extent: Extent) -> str:
        why = "reclaimed (its engine died)" if extent.owner in self._reclaimed else "freed by its owner"
        return f"node {self.node_id}: extent {extent.extent_id} of {extent.owner} was {why} during its store read"
