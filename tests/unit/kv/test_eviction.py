"""LRU eviction of the store: within capacity, least recently used leaves first, the hits of
requests in flight kept, the index always naming exactly the blocks the store still has once the
janitor has deleted what left it, and a cost per eviction that does not grow with the store."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex, block_keys, namespace_for
from dualpath_ray.kv.janitor import StoreJanitor, StoreMeasure
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
    janitor = StoreJanitor(store, sweep_interval_s=None, grace_s=0.0)
    lru = LRUEviction(index, janitor, blocks * LAYOUT.full_block_bytes, LAYOUT.full_block_bytes)
    janitor.start(lru)
    return store, index, lru


def settled(lru: LRUEviction) -> None:
    assert lru.deleter is not None and lru.deleter.wait_idle(30), "the janitor deletes what it was handed"


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
    settled(lru)
    for key in cold + hot + more:
        assert (key in index) == store.contains(key), f"index and store agree on {key} once the janitor is done"
    assert lru.stats.evicted_blocks == 2


def test_a_hot_prefix_is_never_cut_from_under_its_descendants() -> None:
    store, index, lru = store_within(2)
    chain = publish(store, index, 0, 3)
    lru.touch(chain[:1])  # the first block is the most recently used, but it has descendants
    assert lru.evict() == [chain[2]], "only the leaf goes, although its parent is newer in LRU order"
    assert chain[0] in index and chain[1] in index, "the prefix stays hittable"


def test_a_parent_left_without_children_competes_with_its_own_last_touch() -> None:
    store, index, lru = store_within(3)
    chain = publish(store, index, 0, 2)
    lru.touch(chain)
    other = publish(store, index, 100, 1)
    lru.touch(other)
    lru.touch(chain[:1])  # the chain's first block is now newer than `other`
    publish(store, index, 200, 1)
    assert lru.evict() == [chain[1]], "the oldest leaf goes first"
    publish(store, index, 300, 1)
    assert lru.evict() == [other[0]], "chain[0], a leaf now, was touched after `other`, so `other` goes"


def test_no_capacity_means_no_eviction_and_a_capacity_below_one_block_is_refused() -> None:
    store, index = MemoryStore(LAYOUT), PrefixIndex(BLOCK)
    publish(store, index, 0, 3)
    assert LRUEviction(index, None, None, LAYOUT.full_block_bytes).evict() == [], "unlimited keeps everything"
    with pytest.raises(ValueError, match="store.capacity_bytes"):
        LRUEviction(index, None, LAYOUT.full_block_bytes - 1, LAYOUT.full_block_bytes)


def test_a_pinned_chain_keeps_every_block_of_it() -> None:
    store, index, lru = store_within(3)
    reading = publish(store, index, 0, 3)
    lru.touch(reading)
    lru.pin(reading)  # only its deepest block is counted
    publish(store, index, 100, 2)
    assert lru.evict() != [] and all(k in index for k in reading), (
        "none of the chain is a leaf but its deepest block, which is pinned: the newer blocks go"
    )
    lru.unpin(reading)
    publish(store, index, 200, 3)
    assert lru.evict()[:3] == reading[::-1], "unpinned, the old chain goes leaf by leaf"


def test_hits_of_requests_in_flight_are_not_evicted_until_unpinned() -> None:
    store, index, lru = store_within(1)
    reading = publish(store, index, 0, 1)
    lru.touch(reading)
    lru.pin(reading)
    newer = publish(store, index, 100, 1)
    lru.touch(newer)
    assert lru.evict() == newer, "the older block is being read, so the newer leaf goes"
    assert reading[0] in index, "a pinned block stays indexed"
    lru.pin(reading)  # a second request hits it too
    later = publish(store, index, 200, 1)
    lru.unpin(reading)
    assert lru.evict() == later, "one of its two requests still reads it"
    lru.unpin(reading)
    publish(store, index, 300, 1)
    assert lru.evict() == reading, "unpinned by both, it is the oldest leaf again"
    settled(lru)
    assert not store.contains(reading[0]), "and then deleted"


def test_unindexed_block_files_count_against_the_capacity() -> None:
    store, index, lru = store_within(4)
    publish(store, index, 0, 3)
    assert not lru.over_capacity(), "3 indexed blocks fit 4"
    lru.measured(StoreMeasure(block_files=5, unindexed_blocks=2, free_bytes=None, allocation_bytes=1, file_bytes=1))
    assert lru.over_capacity() and len(lru.evict()) == 1, "2 files no index holds leave room for 2 indexed blocks"


def test_a_derived_capacity_follows_the_block_files_and_free_space_measured() -> None:
    index = PrefixIndex(BLOCK)
    block = LAYOUT.full_block_bytes
    lru = LRUEviction(index, None, 100 * block, block, free_fraction=0.5)
    page = 4096
    file_pages = -(-(HEADER_SIZE + block) // page)  # the 4096-byte header, then the payload
    lru.measured(StoreMeasure(block_files=40, unindexed_blocks=10, free_bytes=60 * file_pages * page,
                              allocation_bytes=page, file_bytes=block))
    assert lru.capacity_blocks == 50, "half of 40 block files on disk plus 60 more that fit the free space"


class NoStore:
    """Deletes nothing: what the eviction itself costs is counted, not the store's work."""

    def delete(self, key: str) -> bool:
        return True

    def delete_later(self, keys: Iterable[str]) -> None:
        pass

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return True


class CountingIndex(PrefixIndex):
    """Counts every key the eviction reads or changes in the index."""

    visits = 0

    def keys(self) -> list[str]:
        keys = super().keys()
        self.visits += len(keys)
        return keys

    def __contains__(self, key: object) -> bool:
        self.visits += 1
        return super().__contains__(key)

    def is_leaf(self, key: str) -> bool:
        self.visits += 1
        return super().is_leaf(key)

    def last_used(self, key: str) -> int | None:
        self.visits += 1
        return super().last_used(key)

    def leaf_used(self, key: str) -> int | None:
        self.visits += 1
        return super().leaf_used(key)

    def remove(self, key: str) -> int:
        self.visits += 1
        return super().remove(key)


def fill(index: PrefixIndex, chains: int, depth: int, first: int = 0) -> list[list[str]]:
    """`chains` chains of `depth` blocks, keys made from a counter (cheap, valid)."""
    out = []
    for chain in range(chains):
        keys = [f"{first + chain * depth + i:032x}" for i in range(depth)]
        index.insert(keys)
        out.append(keys)
    return out


def index_visits_per_round(stored_blocks: int) -> tuple[int, int]:
    """A store at capacity with `stored_blocks` blocks, each touched after all were stored (a
    worst case for a lazy order: every entry is older than its block), and one eviction to pay
    for that once. Then each round publishes a chain of 4 blocks, touched as a finished turn
    touches them, hits an old prefix, and evicts. Returns (index visits in the rounds, victims)."""
    index = CountingIndex(BLOCK)
    depth = 16
    lru = LRUEviction(index, NoStore(), stored_blocks * LAYOUT.full_block_bytes, LAYOUT.full_block_bytes)  # type: ignore[arg-type]
    chains = fill(index, stored_blocks // depth, depth)
    for chain in chains:
        lru.touch(chain)
    (first,) = fill(index, 1, 1, first=10**8)
    lru.touch(first)
    lru.evict()  # amortises the touches above: each costs at most one heap entry, once
    index.visits, victims = 0, 0
    for round_ in range(40):
        (chain,) = fill(index, 1, 4, first=10**9 + 4 * round_)
        lru.touch(chain)
        lru.touch(chains[-1 - round_][:8])  # a lookup hits a prefix
        victims += len(lru.evict())
    return index.visits, victims


def test_an_eviction_costs_in_proportion_to_its_victims_not_to_the_store() -> None:
    small_visits, small_victims = index_visits_per_round(2_000)
    big_visits, big_victims = index_visits_per_round(20_000)
    assert small_victims == big_victims == 160, "each round evicts the 4 blocks it published beyond capacity"
    assert big_visits <= 8 * big_victims, (
        f"{big_visits} index visits for {big_victims} victims: eviction must not scan the index"
    )
    assert big_visits == small_visits, "ten times the store, the same work per eviction"


# --- the lazy heap against a plain LRU over the leaves ------------------------------------------


class ReferenceLRU:
    """What LRUEviction must evict: the leaf touched longest ago that is not the deepest hit of a
    request in flight, found by scanning every leaf."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.time: dict[str, int] = {}
        self.clock = 0
        self.pins: dict[str, int] = {}

    def stamp(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key in self.index:
                self.clock += 1
                self.time[key] = self.clock

    def oldest_leaf(self) -> str | None:
        leaves = [k for k in self.index.keys() if self.index.is_leaf(k) and not self.pins.get(k)]
        return min(leaves, key=lambda k: self.time[k], default=None)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(3, 12))
def test_the_lazy_order_evicts_exactly_what_a_plain_lru_over_the_leaves_would(seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(BLOCK)
    lru = LRUEviction(index, NoStore(), capacity * LAYOUT.full_block_bytes, LAYOUT.full_block_bytes)  # type: ignore[arg-type]
    ref = ReferenceLRU(index)
    chains: list[list[str]] = []
    in_flight: list[list[str]] = []
    next_key = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.35 or not chains:  # a turn publishes blocks after a stored prefix (or a new chain)
            base = rng.choice(chains)[: rng.randint(0, 3)] if chains and rng.random() < 0.6 else []
            base = base[: index.match_keys(base)]
            new = [f"{next_key + i:032x}" for i in range(rng.randint(1, 3))]
            next_key += len(new)
            index.insert([*base, *new])
            for key in new:  # an insert stamps in both (the LRU is told by the index)
                ref.stamp([key])
            lru.touch(new)
            ref.stamp(new)
            chains.append([*base, *new])
        elif op < 0.6:  # a lookup hits a prefix
            chain = rng.choice(chains)
            hit = chain[: index.match_keys(chain[: rng.randint(1, len(chain))])]
            lru.touch(hit)
            ref.stamp(hit)
        elif op < 0.7:  # a request pins its hits (its deepest block counts), or one finishes
            if rng.random() < 0.5 or not in_flight:
                chain = rng.choice(chains)
                hit = chain[: index.match_keys(chain)]
                lru.pin(hit)
                in_flight.append(hit)
                if hit:
                    ref.pins[hit[-1]] = ref.pins.get(hit[-1], 0) + 1
            else:
                hit = in_flight.pop(rng.randrange(len(in_flight)))
                lru.unpin(hit)
                if hit:
                    ref.pins[hit[-1]] -= 1
        elif op < 0.75 and len(index):  # a repair unindexes a block and what follows it
            index.remove(rng.choice(index.keys()))
        elif op < 0.77:
            index.clear()
        while len(index) > capacity:
            expected = ref.oldest_leaf()
            lru.capacity_blocks = len(index) - 1  # one victim per evict(), to compare one at a time
            assert lru.evict() == ([] if expected is None else [expected]), (
                "the lazy heap evicts the leaf a scan of every unpinned leaf finds oldest"
            )
            lru.capacity_blocks = capacity
            if expected is None:
                break  # every leaf is pinned: the store stays over capacity until one is unpinned
