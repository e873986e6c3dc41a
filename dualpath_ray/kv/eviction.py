"""The store's capacity: least-recently-used eviction that keeps the prefix index true.

The scheduler owns it, next to the index: every lookup touches the blocks it hits, every
published block is added, and once the store holds more than `store.capacity_bytes` the least
recently used *leaf* blocks (nothing indexed follows them) are unindexed at once and deleted
from the store soon after, by the store's janitor thread (kv/janitor.py), off the scheduler's
event loop. Evicting leaves only means a hot prefix is never cut from under its descendants; the
hits of requests in flight are pinned and kept until they finish: a count per chain's deepest
hit block, kept as requests take and drop their hits (O(1) each), which is enough, because while
it is indexed every block before it has a child and is no leaf. reset_prefix_cache spares the
hits of requests in flight from its deletions (`spare`, once per reset). A block deleted anyway
while a reader was about to read it (another scheduler's store, a user) is a miss for that read,
which the scheduler turns into a retry that recomputes it (docs/reliability.md).

What the store holds is the indexed blocks plus the block files no index holds that the
janitor's last sweep found and could not delete yet (young ones a turn may still report, pinned
ones): both count against the capacity. Every block that leaves the index (evicted, repaired,
reset_prefix_cache) is handed to the janitor to delete.

Cost: the index tells this object of each change as it is made (kv/index.py IndexObserver), so
nothing scans the index or the order. Recency is the index's own: each block records the index's
clock at its last publish or hit (PrefixIndex.touch, which walks a chain like a lookup). The
order is kept lazily, in a queue of the blocks as they were published and a heap of the leaves
met since, both by that stamp: a touch only stamps the block; an entry found at the front with
an older stamp than its block's goes back in with the new one, so each touch costs at most one
heap push, paid when eviction reaches it, and each victim O(log leaves).

Without a configured capacity a store in a directory is bounded by its file system
(`store_capacity_bytes`): a share of what the disk could hold when the scheduler starts, and
again at each of the janitor's measures (LRUEviction.measured), so eviction runs before the disk
is full. A store grown without bound fills its file system, and then every persist fails.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.index import PrefixIndex

if TYPE_CHECKING:
    from dualpath_ray.kv.block_store import BlockStore
    from dualpath_ray.kv.janitor import StoreMeasure

_LOG = logging.getLogger(__name__)


def capacity_from_free_space(
    free_bytes: int, allocation_bytes: int, indexed_blocks: int, block_bytes: int, fraction: float
) -> int:
    """`fraction` of the Full Blocks a file system can hold: those stored now (`indexed_blocks`;
    once the janitor has measured the store, every block file) plus as many block files (header
    + payload, rounded up to the file system's allocation unit) as fit in `free_bytes`; in
    payload bytes (what LRUEviction counts), never less than one block."""
    if not 0 < fraction <= 1:
        raise ValueError(f"store.capacity_free_fraction must be in (0, 1], got {fraction}")
    unit = max(1, allocation_bytes)
    file_bytes = -(-(HEADER_SIZE + block_bytes) // unit) * unit
    blocks = int((indexed_blocks + max(0, free_bytes) // file_bytes) * fraction)
    return max(1, blocks) * block_bytes


def store_capacity_bytes(configured: int | None, fraction: float, store: BlockStore, indexed_blocks: int) -> int | None:
    """The capacity eviction keeps the store within: store.capacity_bytes if `configured`; for a
    store in a directory without one, `fraction` of what its file system can hold now
    (capacity_from_free_space); None (no limit) for a store without a directory (memory)."""
    if configured is not None or store.root is None:
        return configured
    stats = os.statvfs(store.root)
    capacity = capacity_from_free_space(
        stats.f_bavail * stats.f_frsize, stats.f_frsize, indexed_blocks, store.layout.full_block_bytes, fraction
    )
    _LOG.info(
        "store %s: capacity %d bytes (%d blocks): %.0f%% of %d indexed blocks + %d free bytes "
        "(store.capacity_bytes unset)", store.root, capacity, capacity // store.layout.full_block_bytes,
        fraction * 100, indexed_blocks, stats.f_bavail * stats.f_frsize,
    )
    return capacity


@dataclass
class EvictionStats:
    evicted_blocks: int = 0
    touched_blocks: int = 0


class Deleter(Protocol):
    """Deletes unindexed blocks off the caller's thread (kv/janitor.py StoreJanitor)."""

    def delete_later(self, keys: Iterable[str]) -> None: ...

    def wait_idle(self, timeout_s: float | None = None) -> bool: ...


# Entries of blocks no longer indexed (a repair's) are dropped when eviction reaches them; beyond
# twice the indexed blocks plus this many, the queue and heap are rebuilt without them.
_COMPACT_SLACK = 4096


class LRUEviction:
    """LRU order of the indexed leaves, the pins of requests in flight, and the capacity the
    store must stay within. The index's observer (kv/index.py): it must be told of every change.

    Lives on one thread (the scheduler's event loop), except `indexed`, `pinned` and `measured`,
    which the janitor's thread calls (single dict lookups and attribute stores)."""

    def __init__(
        self, index: PrefixIndex, deleter: Deleter | None, capacity_bytes: int | None, block_bytes: int,
        free_fraction: float | None = None,
    ) -> None:
        """`deleter` None: unindexed blocks are not deleted (a store no one else sees). With
        `free_fraction` the capacity is that share of what the store's file system can hold,
        recomputed at each of the janitor's measures (store.capacity_bytes unset)."""
        if capacity_bytes is not None and capacity_bytes < block_bytes:
            raise ValueError(
                f"store.capacity_bytes ({capacity_bytes}) holds no Full Block ({block_bytes} bytes); "
                "raise it or set it to null (no limit)"
            )
        self.index = index
        self.deleter = deleter
        self.block_bytes = block_bytes
        self.free_fraction = free_fraction
        self.capacity_blocks = None if capacity_bytes is None else capacity_bytes // block_bytes
        # Block files on disk that no index holds, as the janitor's last sweep found them.
        self.unindexed_blocks = 0
        self.stats = EvictionStats()
        # Without a capacity nothing is ever evicted and the order is never read, so none is kept
        # (a lookup touches every hit block: hundreds per turn of a long context).
        self._ordered = self.capacity_blocks is not None
        # Each block's recency is the index's own (PrefixIndex.touch: the index clock at its last
        # publish or hit). Invariant: exactly one entry (used, key) per key in _entry, in _young
        # or in _heap, _entry[key] its `used`, at most the block's own; every indexed leaf has an
        # entry, unless it is parked. _young holds the blocks as they were published, in clock
        # order, so a publish costs no heap push, and a block that is no leaf by the time eviction
        # reaches it (most of a conversation's blocks: the next turn extends it) leaves it at the
        # cost of a popleft; only leaves reach _heap, which stays about as small as they are few.
        self._young: deque[tuple[int, str]] = deque()
        self._heap: list[tuple[int, str]] = []
        self._entry: dict[str, int] = {}
        self._parked: set[str] = set()  # leaves reached while pinned: back in the heap when unpinned
        self._pins: dict[str, int] = {}  # deepest hit block of requests in flight: how many hold it
        self._spared: Collection[str] = ()  # kept from the next reset's deletions (spare)
        self._victims: list[str] | None = None  # while evict() runs: what it unindexed
        if self._ordered:
            # An index built before (a rebuild) has no hits yet: its blocks start in the order
            # they were indexed.
            for key in index.keys():
                self._entry[key] = index.last_used(key)  # type: ignore[assignment]
            self._young = deque(sorted((used, key) for key, used in self._entry.items()))
        index.observe(self)

    # --- what the scheduler tells -------------------------------------------------------------

    def touch(self, keys: Iterable[str]) -> None:
        """These blocks were just hit (or published): most recently used."""
        if self._ordered:
            self.stats.touched_blocks += self.index.touch(keys)

    def pin(self, hits: Sequence[str]) -> None:
        """A request in flight took these hits (a chain, first block first): keep them until it
        unpins them. Only the deepest is counted: no block before it can be a leaf meanwhile."""
        if hits:
            key = hits[-1]
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, hits: Sequence[str]) -> None:
        """The request that pinned these hits is done (finished, failed, abandoned)."""
        if not hits:
            return
        key = hits[-1]
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
            return
        self._pins.pop(key, None)
        if key in self._parked:
            self._parked.discard(key)
            self._enter(key)

    def spare(self, in_use: Collection[str]) -> None:
        """The next `cleared` (a reset) deletes none of these: every hit of every request in
        flight, which its reads still need (computed by the caller once per reset)."""
        self._spared = in_use

    def over_capacity(self) -> bool:
        return self.capacity_blocks is not None and len(self.index) + self.unindexed_blocks > self.capacity_blocks

    def evict(self) -> list[str]:
        """Unindex LRU leaves until the store fits its capacity, and hand them to the deleter;
        returns their keys. Pinned blocks are kept, so the reads of requests in flight do not
        miss. O(log n) per victim, plus the heap entries of touches it passes (see above)."""
        if self.capacity_blocks is None:
            return []
        excess = len(self.index) + self.unindexed_blocks - self.capacity_blocks
        if excess <= 0:
            return []
        victims: list[str] = []
        self._victims = victims
        try:
            for _ in range(excess):  # a leaf leaves alone: one victim per block over
                victim = self._oldest_leaf()
                if victim is None:
                    break
                self.index.remove(victim)
        finally:
            self._victims = None
        self._delete(victims)
        self.stats.evicted_blocks += len(victims)
        return victims

    # --- what the janitor asks and tells (its thread) ----------------------------------------

    def indexed(self, key: str) -> bool:
        return key in self.index

    def pinned(self, key: str) -> bool:
        return key in self._pins

    def measured(self, measure: StoreMeasure) -> None:
        """The janitor's sweep found what the store holds: its unindexed block files count from
        now on, and a capacity derived from the file system follows what it holds now."""
        self.unindexed_blocks = measure.unindexed_blocks
        if self.free_fraction is not None and measure.free_bytes is not None:
            self.capacity_blocks = capacity_from_free_space(
                measure.free_bytes, measure.allocation_bytes, measure.block_files, self.block_bytes,
                self.free_fraction,
            ) // self.block_bytes

    # --- what the index tells (IndexObserver) -------------------------------------------------

    def added(self, key: str, used: int) -> None:
        if self._ordered and key not in self._entry:  # every published block comes here
            self._entry[key] = used
            self._young.append((used, key))  # the index clock only rises: _young stays in order

    def removed(self, keys: list[str], new_leaf: str | None) -> None:
        if self._ordered:
            parked = self._parked
            if parked:
                parked.difference_update(keys)
            if new_leaf is not None and new_leaf not in parked:
                self._enter(new_leaf)
            # Only a removal of more than the popped victim (a repair's) leaves heap entries behind.
            if len(keys) > 1 and len(self._entry) > 2 * len(self.index) + _COMPACT_SLACK:
                self._compact()
        if self._victims is not None:
            self._victims.extend(keys)
        else:
            self._delete(keys)

    def cleared(self, keys: Collection[str]) -> None:
        if self._ordered:
            self._entry, self._young, self._heap, self._parked = {}, deque(), [], set()
        spared, self._spared = self._spared, ()
        if keys and self.deleter is not None:
            # Filtered lazily, on the janitor's thread as it walks them: nothing here is O(index).
            self.deleter.delete_later((key for key in keys if key not in spared) if spared else keys)

    # --- the order ------------------------------------------------------------------------------

    def _enter(self, key: str) -> None:
        """Give an indexed block a heap entry unless it has one (its stamp is then older than or
        equal to the block's: it moves up when it reaches the top)."""
        if key not in self._entry:
            used = self.index.last_used(key)
            if used is not None:
                self._entry[key] = used
                heapq.heappush(self._heap, (used, key))

    def _oldest_leaf(self) -> str | None:
        """The unpinned leaf used longest ago, or None. An entry of the minimum stamp whose stamp
        is its block's own is the true minimum over the leaves: every other leaf's stamp is at
        least its entry's."""
        young, heap, entry, index = self._young, self._heap, self._entry, self.index
        while young or heap:
            if young and (not heap or young[0] < heap[0]):
                stamp, key = young.popleft()
            else:
                stamp, key = heapq.heappop(heap)
            del entry[key]
            used = index.leaf_used(key)
            if used is None:
                continue  # unindexed (a repair), or no longer a leaf: re-entered when it is one again
            if used != stamp:
                entry[key] = used  # touched since: its place is further back
                heapq.heappush(heap, (used, key))
                continue
            if key in self._pins:
                self._parked.add(key)
                continue
            return key
        return None

    def _compact(self) -> None:
        index = self.index
        self._entry = {key: used for key, used in self._entry.items() if key in index}
        self._young = deque(item for item in self._young if item[1] in index)
        self._heap = [item for item in self._heap if item[1] in index]
        heapq.heapify(self._heap)

    def _delete(self, keys: Collection[str]) -> None:
        if keys and self.deleter is not None:
            self.deleter.delete_later(keys)

