"""The store's capacity: least-recently-used eviction that keeps the prefix index true.

The scheduler owns it, next to the index: every lookup touches the blocks it hits, every
published block is added, and once the indexed blocks exceed `store.capacity_bytes` the least
recently used *leaf* blocks (nothing indexed follows them) are unindexed first and deleted from
the store second. Evicting leaves only means a hot prefix is never cut from under its
descendants, and the hits of requests in flight are kept until they finish. A block deleted
anyway while a reader was about to read it (another scheduler's store, a user) is a miss for that
read, which the scheduler turns into a retry that recomputes it (docs/reliability.md).

Without a configured capacity a store in a directory is bounded by its file system
(`store_capacity_bytes`): a share of what the disk could hold when the scheduler starts, so
eviction runs before the disk is full. A store grown without bound fills its file system, and
then every persist fails.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Iterable

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.index import PrefixIndex

if TYPE_CHECKING:
    from dualpath_ray.kv.block_store import BlockStore

_LOG = logging.getLogger(__name__)


def capacity_from_free_space(
    free_bytes: int, allocation_bytes: int, indexed_blocks: int, block_bytes: int, fraction: float
) -> int:
    """`fraction` of the Full Blocks a file system can hold: those indexed now plus as many
    block files (header + payload, rounded up to the file system's allocation unit) as fit in
    `free_bytes`; in payload bytes (what LRUEviction counts), never less than one block."""
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


class LRUEviction:
    """LRU order of the indexed blocks and the capacity they must stay within."""

    def __init__(self, index: PrefixIndex, store: BlockStore, capacity_bytes: int | None, block_bytes: int) -> None:
        if capacity_bytes is not None and capacity_bytes < block_bytes:
            raise ValueError(
                f"store.capacity_bytes ({capacity_bytes}) holds no Full Block ({block_bytes} bytes); "
                "raise it or set it to null (no limit)"
            )
        self.index = index
        self.store = store
        self.capacity_blocks = None if capacity_bytes is None else capacity_bytes // block_bytes
        self.stats = EvictionStats()
        # Oldest first. A rebuilt index has no recency yet: its blocks start in index order.
        self._order: OrderedDict[str, None] = OrderedDict((key, None) for key in index.keys())

    def touch(self, keys: Iterable[str]) -> None:
        """These blocks were just hit (or published): most recently used. Without a capacity
        nothing is ever evicted and the order is never read, so nothing is recorded (a lookup
        touches every hit block: hundreds per turn of a long context)."""
        if self.capacity_blocks is None:
            return
        for key in keys:
            if key in self.index:
                self._order[key] = None
                self._order.move_to_end(key)
                self.stats.touched_blocks += 1

    def forget(self, key: str) -> None:
        self._order.pop(key, None)

    def over_capacity(self) -> bool:
        return self.capacity_blocks is not None and len(self.index) > self.capacity_blocks

    def evict(self, in_use: Collection[str] = ()) -> list[str]:
        """Unindex and delete LRU leaves until the indexed blocks fit; returns their keys.
        Blocks `in_use` (hits of requests in flight) are kept, so their reads do not miss."""
        evicted: list[str] = []
        if self.over_capacity():
            self._adopt_untracked()
        while self.over_capacity():
            victim = self._oldest_leaf(in_use)
            if victim is None:
                break
            self.index.remove(victim)
            self._order.pop(victim, None)
            self.store.delete(victim)
            evicted.append(victim)
        self.stats.evicted_blocks += len(evicted)
        return evicted

    def _adopt_untracked(self) -> None:
        """Indexed blocks never touched (inserted by someone else) count as the oldest."""
        untracked = [key for key in self.index.keys() if key not in self._order]
        for key in reversed(untracked):
            self._order[key] = None
            self._order.move_to_end(key, last=False)

    def _oldest_leaf(self, in_use: Collection[str]) -> str | None:
        for key in list(self._order):
            if key not in self.index:
                self._order.pop(key)  # unindexed meanwhile (a repair)
                continue
            if key not in in_use and self.index.is_leaf(key):
                return key
        return None
