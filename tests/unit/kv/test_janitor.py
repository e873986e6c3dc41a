"""The store's janitor: what leaves the index is deleted on its own thread, never a block that is
indexed, pinned or put again after the decision; its queue is bounded; its sweep deletes old
block files no index holds, keeps young ones, and measures what the store holds."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.janitor import GATHER_S, StoreJanitor, StoreMeasure
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore, MemoryStore

LAYOUT = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=2)
KEYS = block_keys(list(range(80)), LAYOUT.block_size, namespace_for("janitor", 0))
LONG_AGO = 1_000_000.0  # a publish time older than any decision


def block() -> torch.Tensor:
    return torch.zeros(LAYOUT.full_block_shape, dtype=torch.uint8)


class Keeper:
    """The eviction's side of the janitor: which keys are indexed or pinned, what was measured."""

    def __init__(self, indexed: set[str] = frozenset(), pinned: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.indexed_keys = set(indexed)
        self.pinned_keys = set(pinned)
        self.measures: list[StoreMeasure] = []

    def indexed(self, key: str) -> bool:
        return key in self.indexed_keys

    def pinned(self, key: str) -> bool:
        return key in self.pinned_keys

    def measured(self, measure: StoreMeasure) -> None:
        self.measures.append(measure)


class RecordingStore(MemoryStore):
    """A memory store that notes the thread of each delete."""

    def __init__(self) -> None:
        super().__init__(LAYOUT)
        self.deleting_threads: list[int] = []

    def discard(self, key: str, published_before: float) -> bool:
        self.deleting_threads.append(threading.get_ident())
        return super().discard(key, published_before)

    def delete(self, key: str) -> bool:
        self.deleting_threads.append(threading.get_ident())
        return super().delete(key)


def published_long_ago(store: LocalDirStore, keys: list[str]) -> None:
    for key in keys:
        store.put(key, block())
        os.utime(store.path_of(key), (LONG_AGO, LONG_AGO))


def test_blocks_handed_over_are_deleted_on_the_janitors_thread() -> None:
    store = RecordingStore()
    for key in KEYS[:4]:
        store.put(key, block())
    janitor = StoreJanitor(store, sweep_interval_s=None, grace_s=0.0, wall_clock=lambda: 2e9)
    janitor.start(Keeper())
    janitor.delete_later(KEYS[:4])
    assert janitor.wait_idle(30), "the janitor finishes what it was handed"
    assert not any(store.contains(k) for k in KEYS[:4]), "every block handed over is deleted"
    assert store.deleting_threads and threading.get_ident() not in store.deleting_threads, (
        "no delete runs on the caller's thread (the scheduler's event loop)"
    )
    assert janitor.stats.deleted == 4
    janitor.close()


def test_a_block_indexed_again_pinned_or_put_again_before_its_delete_ran_is_kept(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    published_long_ago(store, KEYS[:4])
    reindexed, pinned, reput, gone = KEYS[:4]
    keeper = Keeper()
    janitor = StoreJanitor(store, sweep_interval_s=None, grace_s=0.0)
    janitor.delete_later(KEYS[:4])  # decided now; the thread is not started yet
    keeper.indexed_keys.add(reindexed)  # a result published it again and the index holds it
    keeper.pinned_keys.add(pinned)  # a request in flight hits it (a reset unindexed it)
    writer = LocalDirStore(tmp_path, LAYOUT)  # another process's handle on the same store
    assert not writer.put(reput, block()), "the writer finds it stored and keeps it: it will report it"
    janitor.start(keeper)
    assert janitor.wait_idle(30)
    assert store.contains(reindexed), "an indexed block is never deleted"
    assert store.contains(pinned), "a block a request in flight reads is not deleted"
    assert store.contains(reput), "a block a writer found after the decision stays: its report is on the way"
    assert not store.contains(gone), "the others are deleted"
    assert (janitor.stats.deleted, janitor.stats.kept_in_use, janitor.stats.kept_fresh) == (1, 2, 1)
    janitor.close()


def test_a_full_queue_drops_the_batch_for_the_sweep_never_blocks() -> None:
    store = MemoryStore(LAYOUT)
    for key in KEYS[:3]:
        store.put(key, block())
    janitor = StoreJanitor(store, sweep_interval_s=None, grace_s=0.0, max_pending=2, wall_clock=lambda: 2e9)
    for key in KEYS[:3]:
        janitor.delete_later([key])  # the thread is not started: nothing is taken off the queue
    assert janitor.stats.dropped_batches == 1, "the third batch does not fit and is dropped, not waited for"
    keeper = Keeper()
    janitor.start(keeper)
    janitor.sweep_soon()
    assert janitor.wait_idle(30)
    assert not any(store.contains(k) for k in KEYS[:3]), "the sweep deletes what the dropped batch named"
    janitor.close()


def test_the_sweep_deletes_old_unindexed_blocks_keeps_young_indexed_and_pinned_ones_and_measures(
    tmp_path: Path,
) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    indexed, pinned, old, young = KEYS[:3], KEYS[3:5], KEYS[5:9], KEYS[9:11]
    published_long_ago(store, indexed + pinned + old)
    for key in young:
        store.put(key, block())  # published just now: its turn may still report it
    keeper = Keeper(set(indexed), set(pinned))
    janitor = StoreJanitor(store, sweep_interval_s=3600.0, grace_s=60.0)
    janitor.start(keeper)  # the first sweep runs at once
    assert janitor.wait_idle(30)
    assert all(store.contains(k) for k in indexed + pinned + young), "indexed, pinned and young blocks stay"
    assert not any(store.contains(k) for k in old), "old blocks no index holds are deleted"
    (measure,) = keeper.measures
    assert (measure.block_files, measure.unindexed_blocks) == (7, 4), (
        "7 block files left, 4 of them unindexed (2 pinned, 2 young): they count against the capacity"
    )
    stats = os.statvfs(tmp_path)
    assert measure.allocation_bytes == stats.f_frsize and measure.free_bytes is not None, "free space is measured"
    assert janitor.stats.swept == 4
    janitor.close()


class RecordingCondition(threading.Condition):
    """Notes how long the janitor's thread asks to sleep each time it waits."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[tuple[str, float | None]] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.sleeps.append((threading.current_thread().name, timeout))
        return super().wait(timeout)


def test_an_idle_janitor_sleeps_until_its_next_sweep_and_gathers_batches() -> None:
    store = MemoryStore(LAYOUT)
    for key in KEYS[:3]:
        store.put(key, block())
    janitor = StoreJanitor(store, sweep_interval_s=600.0, grace_s=0.0, clock=lambda: 0.0, wall_clock=lambda: 2e9)
    condition = janitor._cond = RecordingCondition()
    for key in KEYS[:3]:
        janitor.delete_later([key])  # three evictions before the thread runs
    keeper = Keeper()
    janitor.start(keeper)
    assert janitor.wait_idle(30) and len(keeper.measures) == 1, "the batches, then one sweep when it starts"
    janitor.delete_later([KEYS[3]])
    assert janitor.wait_idle(30)
    assert len(keeper.measures) == 1, "a batch does not start a sweep"
    janitor.close()
    sleeps = [timeout for thread, timeout in condition.sleeps if thread == "store-janitor"]
    assert sleeps == [GATHER_S, 600.0, GATHER_S, 600.0], (
        "one wake gathers the three batches; idle, the thread sleeps until the next sweep is due "
        f"(600 s on a clock that stands still); a later batch wakes it once: {sleeps}"
    )
    assert janitor.stats.deleted == 3, "the three handed-over blocks are deleted (the fourth was never stored)"
