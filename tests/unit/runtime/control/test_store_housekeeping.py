"""A deployment's scheduler core keeps its store's files in step with its index, off its event
loop: evicted blocks are deleted on the janitor's thread, reset_prefix_cache deletes what the
index held (200 resets keep the disk within the capacity, and the prefix cache still hits),
block files no index holds count against the capacity, and old ones are swept. The scheduler
core of build_core, a real LocalDirStore on a temporary directory, and a writer's own handle on
it, as a decode engine has."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.kv import local_store
from dualpath_ray.kv.index import block_keys
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import ReadPath

BASE = DualPathConfig()
LAYOUT = KVLayout.from_model(BASE.model, BASE.store.block_size)
BLOCK = LAYOUT.block_size
NAMESPACE = BASE.model.kv_namespace(block_size=BLOCK)
# A file's time may be a clock tick behind the moment it was written: blocks written closer than
# this before a delete decision are kept as if put after it (LocalDirStore.discard).
PAST_ONE_TICK_S = 2 * local_store.FILE_TIME_SLACK_S
LONG_AGO = 1_000_000.0


def config(root: Path, capacity_blocks: int, **store: object) -> DualPathConfig:
    return parse_config({"store": {"root": str(root), "capacity_bytes": capacity_blocks * LAYOUT.full_block_bytes,
                                   **store}})


def settle(core: SchedulerCore) -> None:
    """Wait until the store's janitor has deleted what it was handed."""
    assert core.eviction is not None and core.eviction.deleter is not None
    assert core.eviction.deleter.wait_idle(60), "the janitor finishes its work"


def sweep(core: SchedulerCore) -> None:
    core.eviction.deleter.sweep_soon()  # type: ignore[union-attr]
    settle(core)


def block_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*.kvb"))


class Turns:
    """Serves turns through the core as the runtime does, with a writer that publishes each
    turn's new blocks before the turn's result reaches the scheduler."""

    def __init__(self, core: SchedulerCore, root: Path) -> None:
        self.core = core
        self.writer = LocalDirStore(root, LAYOUT)
        self.served = 0

    def start(self, prompt: np.ndarray) -> RequestSpec:
        self.served += 1
        spec = RequestSpec(f"r{self.served}", 0, prompt, SamplingParams(max_new_tokens=1), NAMESPACE, 0.0)
        self.core.submit(spec)
        engines = (EngineLoad("decode/d0/g0", "d0", 0, 0, 1 << 20),)
        self.core.fetch_decode(GroupReport("decode/d0", "d0", engines, 0))
        self.core.fetch_prefill(GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), 0))
        return spec

    def publish(self, spec: RequestSpec, long_ago: bool = False) -> tuple[PersistedBlock, ...]:
        """Write the blocks after the turn's hits, as its decode engine does."""
        request = self.core.requests[spec.request_id]
        keys = block_keys(spec.prompt, BLOCK, NAMESPACE)
        hit = len(request.hit_keys)
        blocks = tuple(PersistedBlock(k, p) for k, p in zip(keys, [None, *keys]))[hit:]
        for persisted in blocks:
            self.writer.put(persisted.key, torch.zeros(LAYOUT.full_block_shape, dtype=torch.uint8),
                            parent=persisted.parent)
            if long_ago:
                os.utime(self.writer.path_of(persisted.key), (LONG_AGO, LONG_AGO))
        return blocks

    def finish(self, spec: RequestSpec, persisted: tuple[PersistedBlock, ...]) -> int:
        """Report the turn; returns its hit tokens."""
        hit_tokens = self.core.requests[spec.request_id].hit_tokens
        self.core.finish(TurnResult(spec.request_id, 0, (1,), (0.0,), "length", len(spec.prompt), hit_tokens,
                                    ReadPath.PE, "prefill/p0/g0", "decode/d0/g0", 0.0, 0.0, persisted=persisted))
        return hit_tokens

    def serve(self, prompt: np.ndarray) -> int:
        spec = self.start(prompt)
        return self.finish(spec, self.publish(spec))


def prompt(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, BASE.model.vocab_size, blocks * BLOCK + 1)


def test_evicted_blocks_are_deleted_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = build_core(config(tmp_path, 6), str(tmp_path), "dualpath")
    settle(core)  # its first sweep (of an empty store) is done
    turns = Turns(core, tmp_path)
    unlinked_on: list[int] = []
    discard = LocalDirStore.discard

    # What deletes a block file is the store's discard (a rename to a temporary, then its unlink);
    # a put's own unlinks (its temporary's name once the hard link published it) are the putting
    # thread's work, a reader's in the runtime, and not recorded.
    def recording_discard(store: LocalDirStore, key: str, published_before: float) -> bool:
        unlinked_on.append(threading.get_ident())
        return discard(store, key, published_before)

    monkeypatch.setattr(LocalDirStore, "discard", recording_discard)
    for seed in range(4):
        turns.serve(prompt(seed, 3))
        time.sleep(PAST_ONE_TICK_S)  # the next turn's eviction decides after these blocks' times
    settle(core)
    assert core.eviction.stats.evicted_blocks == 6, "12 blocks published into room for 6: 6 evicted"
    assert block_files(tmp_path) == 6, "the evicted blocks' files are gone once the janitor is done"
    assert unlinked_on and threading.get_ident() not in unlinked_on, (
        "no block file is deleted on the scheduler's thread (its event loop): all on the janitor's"
    )


def test_two_hundred_resets_keep_the_disk_within_the_capacity_and_the_prefix_cache_hitting(tmp_path: Path) -> None:
    capacity = 16
    core = build_core(config(tmp_path, capacity), str(tmp_path), "dualpath")
    settle(core)
    turns = Turns(core, tmp_path)
    most = 0
    for reset in range(200):
        first = prompt(reset, 3)
        turns.serve(first)
        assert turns.serve(first) == 3 * BLOCK, "the turn after a publish hits its blocks"
        turns.serve(prompt(10_000 + reset, 2))
        if reset % 50 == 0:  # a request in flight reads its hits across the reset
            reading = turns.start(first)
        time.sleep(PAST_ONE_TICK_S)
        core.reset_prefix_cache()  # what verl's abort_all_requests does by default
        settle(core)
        most = max(most, block_files(tmp_path))
        if reset % 50 == 0:
            hits = core.requests[reading.request_id].hit_keys
            assert all(turns.writer.contains(k) for k in hits), "a reset keeps the blocks a request in flight reads"
            turns.finish(reading, ())
    assert most <= capacity, f"the store held {most} block files at most: within its capacity of {capacity}"
    again = prompt(99_999, 4)
    turns.serve(again)
    assert turns.serve(again) == 4 * BLOCK, "after 200 resets the prefix cache still hits"


def test_block_files_no_index_holds_count_against_the_capacity_and_old_ones_are_swept(tmp_path: Path) -> None:
    capacity = 8
    core = build_core(config(tmp_path, capacity), str(tmp_path), "dualpath")
    settle(core)
    turns = Turns(core, tmp_path)
    lost = turns.start(prompt(1, 4))
    turns.publish(lost)  # a turn that published and has not reported (yet, or ever)
    old = turns.start(prompt(2, 2))
    turns.publish(old, long_ago=True)  # one whose result never came, long ago
    sweep(core)
    assert block_files(tmp_path) == 4, "the sweep deletes the old unindexed blocks, keeps the young ones"
    for seed in range(3, 7):
        turns.serve(prompt(seed, 2))
        time.sleep(PAST_ONE_TICK_S)
    settle(core)
    assert block_files(tmp_path) <= capacity, (
        "the 4 unindexed files count against the capacity: the index keeps 4 blocks, not 8"
    )
    assert len(core.index) == capacity - 4
