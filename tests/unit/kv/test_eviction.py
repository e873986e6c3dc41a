"""LRU eviction of the store: within capacity, least recently used leaves first, and the index
always names exactly the blocks the store still has."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex, block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import MemoryStore

BLOCK = 4
LAYOUT = KVLayout(n_layer=2, block_size=BLOCK, n_kv_head=1, head_dim=2)
NS = namespace_for("evict", 0)


def publish(store: MemoryStore, index: PrefixIndex, first_token: int, blocks: int) -> list[str]:
    keys = block_keys(list(range(first_token, first_token + blocks * BLOCK)), BLOCK, NS)
    parent = None
    for key in keys:
        store.put(key, torch.zeros(LAYOUT.full_block_shape, dtype=torch.uint8), parent=parent)
        index.insert_block(key, parent)
        parent = key
    return keys


def store_within(blocks: int) -> tuple[MemoryStore, PrefixIndex, LRUEviction]:
    store, index = MemoryStore(LAYOUT), PrefixIndex(BLOCK)
    return store, index, LRUEviction(index, store, blocks * LAYOUT.full_block_bytes, LAYOUT.full_block_bytes)


def test_least_recently_used_leaves_go_first_and_the_index_stays_true() -> None:
    store, index, lru = store_within(4)
    cold = publish(store, index, 0, 2)
    lru.touch(cold)
    hot = publish(store, index, 100, 2)
    lru.touch(hot)
    lru.touch(cold[:1])  # a hit on cold's first block only: its leaf stays the oldest
    more = publish(store, index, 200, 2)
    lru.touch(more)
    evicted = lru.evict()
    assert evicted == [cold[1], hot[1]], "the two least recently used leaves are evicted, oldest first"
    assert len(index) == 4, "the index is back within capacity"
    for key in cold + hot + more:
        assert (key in index) == store.contains(key), f"index and store agree on {key}"
    assert lru.stats.evicted_blocks == 2


def test_a_hot_prefix_is_never_cut_from_under_its_descendants() -> None:
    store, index, lru = store_within(2)
    chain = publish(store, index, 0, 3)
    lru.touch(chain[:1])  # the first block is the most recently used, but it has descendants
    assert lru.evict() == [chain[2]], "only the leaf goes, although its parent is newer in LRU order"
    assert chain[0] in index and chain[1] in index, "the prefix stays hittable"


def test_no_capacity_means_no_eviction_and_a_capacity_below_one_block_is_refused() -> None:
    store, index = MemoryStore(LAYOUT), PrefixIndex(BLOCK)
    publish(store, index, 0, 3)
    assert LRUEviction(index, store, None, LAYOUT.full_block_bytes).evict() == [], "unlimited keeps everything"
    with pytest.raises(ValueError, match="store.capacity_bytes"):
        LRUEviction(index, store, LAYOUT.full_block_bytes - 1, LAYOUT.full_block_bytes)


def test_hits_of_requests_in_flight_are_not_evicted() -> None:
    store, index, lru = store_within(1)
    reading = publish(store, index, 0, 1)
    lru.touch(reading)
    newer = publish(store, index, 100, 1)
    lru.touch(newer)
    assert lru.evict(in_use=set(reading)) == newer, "the older block is being read, so the newer leaf goes"
    assert store.contains(reading[0]) and reading[0] in index, "a block in use stays stored and indexed"
