"""A decode node's hot tier of fresh prompt blocks (runtime/reader/hot_blocks.py) and the reader
core serving reads from it: blocks held before they are written, served from memory with their
digests checked and no SNIC byte charged, and leaving only once the store has them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import FaultPlan
from dualpath_ray.kv.digest import full_block_digest
from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.reader.core import ReaderCore, ReaderSettings
from dualpath_ray.runtime.reader.hot_blocks import HotBlocks


def layout() -> KVLayout:
    cfg = DualPathConfig()
    return KVLayout.from_model(cfg.model, cfg.store.block_size)


def blocks(n: int, first: int = 1) -> list[tuple[torch.Tensor, PersistedBlock]]:
    lay = layout()
    keys = block_keys(list(range(n * lay.block_size)), lay.block_size, namespace_for("hot", 0))
    out = []
    for i, key in enumerate(keys):
        data = torch.randint(0, 256, lay.full_block_shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(first + i))
        out.append((data, PersistedBlock(key, keys[i - 1] if i else None, full_block_digest(data))))
    return out


def test_held_blocks_leave_only_once_written_oldest_write_first() -> None:
    hot = HotBlocks(capacity=3)
    a, b = blocks(2), blocks(2, first=10)
    b = [(data, PersistedBlock(block.key + "-b", None, block.digest)) for data, block in b]
    assert hot.hold(a, holder=1), "two blocks fit three"
    assert not hot.hold(b, holder=2), "two more do not while none of the first two is written: nothing is dropped unwritten"
    assert len(hot) == 2 and hot.counts()["refused"] == 1
    hot.written([a[1][1].key, a[0][1].key], holder=1)
    assert hot.hold(b, holder=2), "written blocks make room"
    outs = [torch.zeros_like(data) for data, _ in a]
    cold = hot.serve([block.key for _, block in a], outs)
    assert cold == [1], "a[1], written first, left first to make room for b (one block was enough)"
    assert torch.equal(outs[0], a[0][0]), "a held block is copied into its slot"
    assert torch.equal(outs[1], torch.zeros_like(outs[1])), "a cold block's slot is left to the store read"
    hot.dropped([block.key for _, block in b])
    assert len(hot) == 1, "a refused write's blocks leave at once"


def test_a_block_that_differs_from_its_engines_digest_is_never_held_nor_served() -> None:
    hot = HotBlocks(capacity=4)
    (data, block), = blocks(1)
    assert not hot.hold([(data, PersistedBlock(block.key, None, block.digest ^ 1))], holder=1), "a wrong digest is refused"
    assert hot.hold([(data, block)], holder=1)
    hot._blocks[block.key][0][0, 0, 0] ^= 0xFF  # the copy in memory rots
    out = torch.zeros_like(data)
    assert hot.serve([block.key], [out]) == [0], "a copy that no longer matches its digest is read from the store"
    assert len(hot) == 0, "and dropped"


def recomputed(prompt: list[tuple[torch.Tensor, PersistedBlock]], seed: int) -> list[tuple[torch.Tensor, PersistedBlock]]:
    """The same keys computed again in another batch: bytes that differ in the last bits."""
    out = []
    for data, block in prompt:
        again = data.clone()
        again[0, 0, 0] ^= 1 + seed % 255
        out.append((again, PersistedBlock(block.key, block.parent, full_block_digest(again))))
    return out


def reader(root: Path, hot_blocks: int = 8) -> ReaderCore:
    lay = layout()
    settings = ReaderSettings(node_id="d0", buffer_blocks=8, lease_timeout_s=60.0, hot_blocks=hot_blocks)
    return ReaderCore(settings, lay, LocalDirStore(root, lay), (Link("snic-read/d0"), Link("snic-write/d0")),
                      FaultInjector(FaultPlan(), "reader/d0"))


def test_a_prompt_persisted_from_an_extent_is_held_and_announced_before_it_is_written(tmp_path: Path) -> None:
    core = reader(tmp_path)
    prompt = blocks(3)
    extent = core.lease("producer#0", 3)
    for slot, (data, _) in zip(extent.slots, prompt):
        core.pool.full_block(slot).copy_(data)
    announced: list[tuple[str, int]] = []
    put = core.store.put

    def recording_put(key, data, **kwargs):  # type: ignore[no-untyped-def]
        announced.append(("write", len(core.hot or ())))
        return put(key, data, **kwargs)

    core.store.put = recording_put  # type: ignore[method-assign]
    stored = core.write_extent(extent.extent_id, [(i, b) for i, (_, b) in enumerate(prompt)],
                               on_hot=lambda owner: announced.append((owner, len(core.hot or ()))))
    assert stored == 3, "every block written"
    assert announced[0] == ("producer#0", 3), "the owner is announced with its 3 blocks held, before any write"
    assert core.hot is not None and core.hot.counts()["held"] == 3


def test_a_de_read_serves_held_blocks_from_memory_and_the_rest_from_the_store(tmp_path: Path) -> None:
    core = reader(tmp_path)
    assert core.hot is not None
    lay = core.layout
    prompt = blocks(4)
    core.store.put(prompt[0][1].key, prompt[0][0])  # the shared hit stored long ago
    assert core.hot.hold(prompt[1:], holder=1), "the producer's three computed blocks are in memory, not in the store yet"
    keys = [block.key for _, block in prompt]
    extent = core.read_blocks("waiter#0", keys, 5, ReadPath.DE)
    for slot, (data, _) in zip(extent.slots, prompt):
        assert torch.equal(core.pool.full_block(slot), data), "every block's bytes are the producer's KV"
    assert core.counters.snic_read["de"] == lay.full_block_bytes, "only the stored block crossed the SNIC"
    assert core.hot.counts()["served"] == 3, "three blocks came from memory"
    assert core.read_q() == 0, "the read queue drains whichever source served a block"
    core.free(extent.extent_id)


def test_a_block_in_neither_memory_nor_store_is_named_as_missing(tmp_path: Path) -> None:
    core = reader(tmp_path)
    assert core.hot is not None
    prompt = blocks(3)
    core.hot.hold(prompt[:1], holder=1)
    core.store.put(prompt[2][1].key, prompt[2][0])
    with pytest.raises(BadBlockError) as raised:
        core.read_blocks("waiter#0", [block.key for _, block in prompt], 3, ReadPath.DE)
    assert raised.value.key == prompt[1][1].key, "the missing block is the one named (the scheduler repairs it)"


def test_without_a_hot_tier_nothing_is_held(tmp_path: Path) -> None:
    core = reader(tmp_path, hot_blocks=0)
    assert core.hot is None, "scheduler.share_buffer_blocks 0 (or sharing off): no hot tier"


def persist(core: ReaderCore, owner: str, prompt: list[tuple[torch.Tensor, PersistedBlock]]) -> int:
    extent = core.lease(owner, len(prompt))
    for slot, (data, _) in zip(extent.slots, prompt):
        core.pool.full_block(slot).copy_(data)
    return core.write_extent(extent.extent_id, [(i, b) for i, (_, b) in enumerate(prompt)], on_hot=lambda _owner: None)


def read_back(core: ReaderCore, keys: list[str]) -> list[torch.Tensor]:
    extent = core.read_blocks("reader#0", keys, len(keys), ReadPath.DE)
    try:
        return [core.pool.full_block(slot).clone() for slot in extent.slots]
    finally:
        core.free(extent.extent_id)


def stored(core: ReaderCore, key: str) -> torch.Tensor:
    host = core.layout.empty_full_block()
    core.store.get_into(key, host)
    return host


def test_a_copy_of_a_key_the_store_had_already_is_not_served_in_place_of_the_stores(tmp_path: Path) -> None:
    """A retried producer and its released waiters compute one prompt in different batches: the
    store keeps the first write of each key, and a later persist's copy of it (other bytes in the
    last bits) must not be served, or a DE-path reader hands over KV that is not the store's."""
    core = reader(tmp_path)
    assert core.hot is not None
    first, again = blocks(2), recomputed(blocks(2), seed=1)
    keys = [block.key for _, block in first]
    for data, block in first:
        core.store.put(block.key, data, parent=block.parent)
    assert persist(core, "waiter#1", again) == 2, "already stored counts as stored"
    assert core.hot.counts()["held"] == 0, "a copy of a key the store has is not even held"
    for got, key in zip(read_back(core, keys), keys):
        assert torch.equal(got, stored(core, key)), "a DE read of a stored key gets the store's bytes"


def test_a_persist_of_a_key_held_for_another_writes_the_held_copy(tmp_path: Path) -> None:
    """Two persists of one key race on a reader's io threads: A holds its copy (and waiters may
    be served it at once), B's put of the key comes first. The store must get A's bytes, the
    ones already served, not B's."""
    core = reader(tmp_path)
    assert core.hot is not None
    a, b = blocks(2), recomputed(blocks(2), seed=2)
    keys = [block.key for _, block in a]
    assert core.hot.hold(a, holder=101), "A's copies are held first"
    served = read_back(core, keys)
    assert persist(core, "b#0", b) == 2, "B's write stores the keys"
    for got, key, (held, _) in zip(served, keys, a):
        assert torch.equal(stored(core, key), held), "the store has the held copy's bytes, not B's"
        assert torch.equal(got, stored(core, key)), "what was served before the write is what the store has"
    for got, key in zip(read_back(core, keys), keys):
        assert torch.equal(got, stored(core, key)), "and every later reader gets the store's bytes"


def test_a_persists_own_held_copy_stays_until_written_and_room_is_needed(tmp_path: Path) -> None:
    core = reader(tmp_path)
    assert core.hot is not None
    prompt = blocks(3)
    assert persist(core, "producer#0", prompt) == 3
    assert len(core.hot) == 3, "the store took the producer's own bytes: its copies stay hot"
    outs = [torch.zeros_like(data) for data, _ in prompt]
    assert core.hot.serve([block.key for _, block in prompt], outs) == [], "all served from memory"
