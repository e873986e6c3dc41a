"""The store's housekeeping, on a thread of its own: what leaves the index leaves the disk.

The scheduler takes blocks out of its index on its event loop (eviction, a repair,
reset_prefix_cache: kv/eviction.py) and hands their keys here at once; this thread deletes the
files soon after, so the loop never waits on a file system (a shared mount's unlink is a round
trip to its servers). Handed-over batches wait in a bounded queue: when it is full a batch is
not queued, and its files are left to the sweep.

The sweep walks the whole store every `sweep_interval_s` (and when the janitor starts): every
block file no index holds and nothing pins, published longer than `grace_s` ago, is deleted,
whatever left it behind (a turn whose result never came, a scheduler that died before it
indexed, a block the index rebuild could not chain). Younger ones may be on their way into the
index: a decode engine publishes each block when it fills and the scheduler indexes them when
the turn ends, up to runtime.request_timeout_s later. The sweep also measures what the store
holds (its block files, and the file system's free space), which the capacity follows
(LRUEviction.measured): blocks no index holds take disk space as much as indexed ones.

Never deleted: a block the index holds, or one a request in flight hits (pinned), checked just
before each delete; and a block a writer put again after the decision to delete it
(BlockStore.discard: a put that finds a block stored refreshes its publish time, and a refreshed
block is kept), because that writer is about to report it and the index to hold it again. A
reader that opens a block just deleted gets a miss, which the scheduler turns into a retry that
recomputes it (docs/reliability.md); pinning keeps that from happening to requests in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dualpath_ray.kv.block_format import HEADER_SIZE

if TYPE_CHECKING:
    from dualpath_ray.kv.block_store import BlockStore

_LOG = logging.getLogger(__name__)

# Batches waiting to be deleted (one per eviction, repair or reset): beyond it a batch's files
# are left to the sweep, so the event loop never waits for this thread.
MAX_PENDING_BATCHES = 4096
# Woken by a first batch, the thread waits this long for more before it deletes them all: a
# store at capacity evicts at every finished turn, and one wake per turn (a thread switch and
# two GIL hand-offs) would cost the scheduler's process more than the deletes themselves.
GATHER_S = 0.05
# While it walks the store or deletes a big batch the thread works at most this share of the
# time, resting in between, so the event loop it shares the interpreter with keeps its pace.
DUTY = 0.25
_REST_EVERY = 256  # keys between two looks at the time spent


@dataclass(frozen=True)
class StoreMeasure:
    """What a sweep found the store holding."""

    block_files: int  # block files left once the sweep deleted what it could
    unindexed_blocks: int  # of them, those no index held: young ones, pinned ones
    free_bytes: int | None  # the file system's free space (None: a store without a directory)
    allocation_bytes: int  # the file system's allocation unit (1 without a directory)
    file_bytes: int  # one block file: header and payload


class Keeper(Protocol):
    """Whose blocks the janitor must keep, and who is told what the store holds (LRUEviction)."""

    def indexed(self, key: str) -> bool: ...

    def pinned(self, key: str) -> bool: ...

    def measured(self, measure: StoreMeasure) -> None: ...


@dataclass
class JanitorStats:
    deleted: int = 0  # block files deleted from handed-over batches
    kept_in_use: int = 0  # handed over, but indexed again or pinned by the time their turn came
    kept_fresh: int = 0  # handed over, but put again after the decision (or already gone)
    dropped_batches: int = 0  # not queued (the queue was full): left to the sweep
    failed: int = 0  # deletes the file system refused (the sweep tries again)
    sweeps: int = 0
    swept: int = 0  # unindexed block files the sweeps deleted
    block_files: int = 0  # at the last sweep
    unindexed_blocks: int = 0  # at the last sweep


class StoreJanitor:
    """Deletes handed-over blocks and sweeps the store, on one daemon thread (started by
    `start`, stopped by `close`). `discard` and `sweep_soon` may be called from any thread;
    neither waits for the file system. Idle, the thread sleeps until the next sweep is due."""

    def __init__(
        self, store: BlockStore, sweep_interval_s: float | None, grace_s: float,
        max_pending: int = MAX_PENDING_BATCHES, wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sweep_interval_s is not None and sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be > 0 or None, got {sweep_interval_s}")
        self.store = store
        self.sweep_interval_s = sweep_interval_s
        self.grace_s = grace_s
        self.max_pending = max_pending
        self.wall_clock = wall_clock
        self.clock = clock
        self.stats = JanitorStats()
        self._keeper: Keeper | None = None
        self._pending: deque[tuple[Iterable[str], float]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._sweep_due: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, keeper: Keeper) -> None:
        """Run the thread; the first sweep starts at once when sweeps are on."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the janitor is already started")
            self._keeper = keeper
            self._sweep_due = None if self.sweep_interval_s is None else self.clock()
            self._thread = threading.Thread(target=self._run, name="store-janitor", daemon=True)
        self._thread.start()

    def delete_later(self, keys: Iterable[str]) -> None:
        """Delete these blocks soon, each unless it is indexed, pinned or put again by then.
        `keys` is kept as it is (no copy) and iterated once on the janitor's thread: nobody may
        change it afterwards."""
        decided = self.wall_clock()
        with self._cond:
            if len(self._pending) >= self.max_pending:
                self.stats.dropped_batches += 1
                return
            self._pending.append((keys, decided))
            if len(self._pending) == 1:
                self._cond.notify()  # later ones are gathered with it (GATHER_S)

    def sweep_soon(self) -> None:
        """Sweep now rather than when the next one is due (with sweeps off: once)."""
        with self._cond:
            self._sweep_due = self.clock()
            self._cond.notify()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every handed-over batch is done and no sweep runs or is due; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy and not self._due(), timeout_s)

    def close(self, timeout_s: float | None = 10.0) -> None:
        """Stop the thread once the batches handed over are deleted (a sweep under way stops)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing and not self._due():
                    due = self._sweep_due
                    self._cond.wait(None if due is None else max(0.0, due - self.clock()))
                if self._closing and not self._pending:
                    return
                if self._pending and not self._closing:
                    self._cond.wait(GATHER_S)  # only a close or a sweep_soon wakes it early
                batches = list(self._pending)
                self._pending.clear()
                self._busy = True
            try:
                for batch in batches:
                    self._delete(*batch)
                if not batches:
                    self._sweep()
            except Exception:  # noqa: BLE001 - housekeeping must outlive one bad batch or walk
                _LOG.exception("store janitor: %s failed", "a delete" if batches else "a sweep")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _due(self) -> bool:
        return self._sweep_due is not None and self.clock() >= self._sweep_due

    def _delete(self, keys: Iterable[str], decided: float) -> None:
        keeper = self._keeper
        assert keeper is not None
        pace = _Pace(self.clock, self._rest)
        stats, indexed, pinned, discard = self.stats, keeper.indexed, keeper.pinned, self.store.discard
        for key in keys:
            pace.step()
            if indexed(key) or pinned(key):
                stats.kept_in_use += 1
                continue
            try:
                if discard(key, decided):
                    stats.deleted += 1
                else:
                    stats.kept_fresh += 1
            except OSError as exc:
                stats.failed += 1
                _LOG.warning("store janitor: cannot delete block %s (%s); the sweep tries again", key, exc)

    def _sweep(self) -> None:
        """Delete unindexed, unpinned block files older than grace_s; measure what is left."""
        keeper = self._keeper
        assert keeper is not None
        with self._cond:
            self._sweep_due = None if self.sweep_interval_s is None else self.clock() + self.sweep_interval_s
        cutoff = self.wall_clock() - self.grace_s
        pace = _Pace(self.clock, self._rest_or_delete)
        files = unindexed = swept = 0
        for key in self.store.keys():
            if self._closing:
                return
            pace.step()
            files += 1
            if keeper.indexed(key):
                continue
            try:
                if not keeper.pinned(key) and self.store.discard(key, cutoff):
                    swept += 1
                    continue
            except OSError as exc:
                self.stats.failed += 1
                _LOG.warning("store janitor: cannot delete unindexed block %s (%s)", key, exc)
            unindexed += 1
        measure = self._measure(files - swept, unindexed)
        stats = self.stats
        stats.sweeps += 1
        stats.swept += swept
        stats.block_files, stats.unindexed_blocks = measure.block_files, measure.unindexed_blocks
        if swept:
            _LOG.info("store janitor: swept %d unindexed blocks; %d block files left, %d of them unindexed",
                      swept, measure.block_files, unindexed)
        keeper.measured(measure)

    def _measure(self, files: int, unindexed: int) -> StoreMeasure:
        file_bytes = HEADER_SIZE + self.store.layout.full_block_bytes
        root = self.store.root
        if root is None:
            return StoreMeasure(files, unindexed, None, 1, file_bytes)
        stats = os.statvfs(root)
        return StoreMeasure(files, unindexed, stats.f_bavail * stats.f_frsize, stats.f_frsize, file_bytes)

    def _rest(self, seconds: float) -> None:
        with self._cond:
            if not self._closing:
                self._cond.wait(seconds)

    def _rest_or_delete(self, seconds: float) -> None:
        """A sweep's rest: batches handed over meanwhile are deleted first (a walk of a big
        store takes a while), then the rest of the pause is slept."""
        start = self.clock()
        while True:
            with self._cond:
                batch = self._pending.popleft() if self._pending else None
            if batch is None:
                break
            self._delete(*batch)
        self._rest(max(0.0, seconds - (self.clock() - start)))


class _Pace:
    """Keeps a long loop at DUTY of the time: every _REST_EVERY steps, rest in proportion to the
    time worked since the last rest."""

    def __init__(self, clock: Callable[[], float], rest: Callable[[float], None]) -> None:
        self.clock = clock
        self.rest = rest
        self.steps = 0
        self.since = clock()

    def step(self) -> None:
        self.steps += 1
        if self.steps < _REST_EVERY:
            return
        self.steps = 0
        worked = self.clock() - self.since
        self.rest(worked * (1 - DUTY) / DUTY)
        self.since = self.clock()
