"""Block keys and the prefix trie: longest stored prefix, partial blocks, namespaces, rebuild."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.kv.index import PrefixHit, PrefixIndex, block_keys, namespace_for, next_block_key
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import HEADER_SIZE, LocalDirStore, MemoryStore

BLOCK = 4
NS = namespace_for("test-model", 0)
LAYOUT = KVLayout(n_layer=2, block_size=BLOCK, n_kv_head=1, head_dim=2)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# block_keys


def test_one_fixed_length_hex_key_per_full_block() -> None:
    keys = block_keys(tokens(10), BLOCK, NS)
    assert len(keys) == 2, "10 tokens in blocks of 4 are 2 full blocks; the partial one gets no key"
    assert all(len(k) == 32 and k == k.lower() and int(k, 16) >= 0 for k in keys), (
        "every key must be 32 lowercase hex chars"
    )
    assert len(set(keys)) == 2, "different blocks of one prompt must get different keys"
    assert block_keys(tokens(3), BLOCK, NS) == [], "a prompt shorter than a block has no key"


def test_keys_are_deterministic_and_chain_the_prefix() -> None:
    long = block_keys(tokens(20), BLOCK, NS)
    assert block_keys(tokens(20), BLOCK, NS) == long, "keys must be deterministic"
    assert block_keys(tokens(12), BLOCK, NS) == long[:3], "a prefix's keys are a prefix of the keys"
    changed = tokens(20)
    changed[9] += 1000
    other = block_keys(changed, BLOCK, NS)
    assert other[:2] == long[:2], "blocks before a changed token must keep their keys"
    assert all(a != b for a, b in zip(other[2:], long[2:])), (
        "a changed token must change its block's key and every later key (the chain)"
    )


def test_same_block_tokens_after_different_prefixes_get_different_keys() -> None:
    first = block_keys([1, 2, 3, 4, 9, 9, 9, 9], BLOCK, NS)
    second = block_keys([5, 6, 7, 8, 9, 9, 9, 9], BLOCK, NS)
    assert first[1] != second[1], "a key names the whole prefix, not only its own block's tokens"


def test_namespace_and_weight_version_separate_keys() -> None:
    prompt = tokens(8)
    base = block_keys(prompt, BLOCK, namespace_for("m", 0))
    assert not set(base) & set(block_keys(prompt, BLOCK, namespace_for("m", 1))), (
        "another weight version must never share a key"
    )
    assert not set(base) & set(block_keys(prompt, BLOCK, namespace_for("n", 0))), (
        "another model id must never share a key"
    )


def test_namespace_for_is_one_to_one_and_validated() -> None:
    assert namespace_for("a@w1", 2) != namespace_for("a", 12), "namespaces must not alias"
    for bad_model, bad_version in [("", 0), ("m", -1), ("m", True), (3, 0)]:
        with pytest.raises(ValueError):
            namespace_for(bad_model, bad_version)  # type: ignore[arg-type]


def test_keys_do_not_depend_on_the_token_container() -> None:
    ids = tokens(13, start=100_000)
    expected = block_keys(ids, BLOCK, NS)
    for container in (tuple(ids), np.array(ids, dtype=np.int32), np.array(ids), torch.tensor(ids)):
        assert block_keys(container, BLOCK, NS) == expected, (
            f"keys of {type(container).__name__} ids must equal keys of a list"
        )


def test_next_block_key_extends_a_chain() -> None:
    ids = tokens(12)
    keys = block_keys(ids, BLOCK, NS)
    assert next_block_key(None, ids[:4], NS) == keys[0], "the first block chains from the root"
    assert next_block_key(keys[1], ids[8:12], NS) == keys[2], "a block chains from its parent key"
    for bad_parent in (keys[0].upper(), keys[0][:-1], "../" + keys[0][3:]):
        with pytest.raises(ValueError):
            next_block_key(bad_parent, ids[:4], NS)


@pytest.mark.parametrize(
    "bad_tokens, bad_block_size",
    [([[1, 2], [3, 4]], 2), ([1.5, 2.0], 1), ([1, 2], 0), ([1, 2], True)],
    ids=["2-d", "floats", "zero block", "bool block"],
)
def test_bad_token_input_raises(bad_tokens: object, bad_block_size: object) -> None:
    with pytest.raises(ValueError):
        block_keys(bad_tokens, bad_block_size, NS)  # type: ignore[arg-type]


# PrefixIndex


def test_longest_prefix_match() -> None:
    index = PrefixIndex(BLOCK)
    stored = tokens(12)
    index.insert(block_keys(stored, BLOCK, NS))
    extended = stored + tokens(9, start=500)
    hit = index.match(extended, NS)
    assert hit == PrefixHit(3, 12, block_keys(stored, BLOCK, NS)), (
        "a prompt extending a stored prefix must hit exactly the stored blocks"
    )
    diverged = stored[:6] + [999] + stored[7:]
    assert index.match(diverged, NS).hit_blocks == 1, "a lookup must stop at the first block that differs"
    assert index.match([], NS) == PrefixHit(0, 0, []), "an empty prompt is a miss"


def test_trailing_partial_block_is_a_miss() -> None:
    index = PrefixIndex(BLOCK)
    index.insert(block_keys(tokens(8), BLOCK, NS))
    hit = index.match(tokens(11), NS)
    assert (hit.hit_blocks, hit.hit_tokens) == (2, 8), "the 3 trailing tokens can never be a hit"
    assert index.match(tokens(3), NS).hit_tokens == 0, "a prompt shorter than a block is a miss"


def test_other_namespace_misses() -> None:
    index = PrefixIndex(BLOCK)
    index.insert(block_keys(tokens(8), BLOCK, NS))
    assert index.match(tokens(8), namespace_for("test-model", 1)).hit_blocks == 0, (
        "blocks of another weight version must never be hit"
    )


def test_match_keys_requires_a_connected_chain() -> None:
    index = PrefixIndex(BLOCK)
    keys = block_keys(tokens(16), BLOCK, NS)
    index.insert(keys[:2])
    index.insert_block(keys[2], keys[1])
    assert index.match_keys(keys) == 3, "match_keys must count the held prefix"
    assert index.match_keys(keys[1:]) == 2, "a chain may start at any held key"
    assert index.match_keys([]) == 0, "an empty chain matches nothing"


def test_insert_block_checks_parents() -> None:
    index = PrefixIndex(BLOCK)
    keys = block_keys(tokens(12), BLOCK, NS)
    with pytest.raises(ValueError, match="parent"):
        index.insert_block(keys[1], keys[0])
    assert index.insert_block(keys[0], None), "a first block must be insertable"
    assert not index.insert_block(keys[0], None), "re-inserting a block must report False"
    index.insert_block(keys[1], keys[0])
    with pytest.raises(ValueError, match="parent"):
        index.insert_block(keys[1], None)
    assert index.insert(keys) == 1, "insert must add only the new blocks of a chain"
    assert index.parent_of(keys[2]) == keys[1], "parent_of must return the block before"


def test_remove_drops_the_subtree_only() -> None:
    index = PrefixIndex(BLOCK)
    trunk = tokens(8)
    left = block_keys(trunk + tokens(8, start=100), BLOCK, NS)
    right = block_keys(trunk + tokens(8, start=200), BLOCK, NS)
    index.insert(left)
    index.insert(right)
    assert len(index) == 6, "two branches off a shared 2-block trunk hold 6 blocks"
    assert index.remove(left[2]) == 2, "removing a block removes it and its descendants"
    assert left[3] not in index and left[2] not in index, "a block whose parent is gone must be gone"
    assert index.match_keys(right) == 4, "the sibling branch must be untouched"
    assert index.remove(left[2]) == 0, "removing a missing key removes nothing"
    assert index.remove(left[0]) == 4, "removing the root removes every branch below it"
    assert len(index) == 0, "nothing may remain below a removed root"


def test_remove_handles_deep_chains() -> None:
    index = PrefixIndex(BLOCK)
    keys = block_keys(np.arange(4 * 5000), BLOCK, NS)
    index.insert(keys)
    assert index.remove(keys[0]) == 5000, "a 5000-block chain must be removed without recursion limits"


def test_clear_len_contains() -> None:
    index = PrefixIndex(BLOCK)
    keys = block_keys(tokens(8), BLOCK, NS)
    index.insert(keys)
    assert len(index) == 2 and keys[1] in index, "inserted keys must be held"
    index.clear()
    assert len(index) == 0 and keys[0] not in index, "clear must empty the index"


class Observer:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.used: list[int] = []

    def added(self, key: str, used: int) -> None:
        self.events.append(("added", key))
        self.used.append(used)

    def removed(self, keys: list[str], new_leaf: str | None) -> None:
        self.events.append(("removed", sorted(keys), new_leaf))

    def cleared(self, keys: object) -> None:
        self.events.append(("cleared", sorted(keys)))  # type: ignore[call-overload]


def test_the_observer_is_told_every_change_as_it_is_made() -> None:
    index = PrefixIndex(BLOCK)
    seen = Observer()
    index.observe(seen)
    a, b, c = block_keys(tokens(12), BLOCK, NS)
    (other,) = block_keys(tokens(4, start=100), BLOCK, NS)
    index.insert([a, b, c])
    index.insert([a, b])  # nothing new
    assert seen.events == [("added", a), ("added", b), ("added", c)], "each new block, once, parent first"
    assert seen.used == sorted(seen.used) and len(set(seen.used)) == 3, "each with the index's clock, rising"
    index.insert_block(other, b)  # b has two children now
    seen.events.clear()
    index.remove(c)
    assert seen.events == [("removed", [c], None)], "b still has a child: it does not become a leaf"
    index.remove(other)
    assert seen.events[-1] == ("removed", [other], b), "b lost its last child: it is a leaf now"
    index.remove(a)
    assert seen.events[-1] == ("removed", sorted([a, b]), None), "a subtree leaves in one event; a had no parent"
    index.insert([a, b])
    index.clear()
    assert seen.events[-1] == ("cleared", sorted([a, b])), "a clear names every block it dropped"
    assert len(index) == 0


def test_touch_stamps_a_chain_with_the_index_clock_and_skips_what_is_not_indexed() -> None:
    index = PrefixIndex(BLOCK)
    a, b, c = block_keys(tokens(12), BLOCK, NS)
    (other,) = block_keys(tokens(4, start=100), BLOCK, NS)
    index.insert([a, b])
    index.insert([other])
    before = index.clock
    assert index.touch([a, b, c]) == 2, "two of the three are indexed"
    assert index.last_used(a) == before + 1 and index.last_used(b) == before + 2, "stamped in chain order"
    assert index.touch([other]) == 1 and index.last_used(other) > index.last_used(b), "the latest is newest"
    assert index.last_used(c) is None, "an unindexed block has no stamp"


def _fill(store: LocalDirStore | MemoryStore, prompts: list[list[int]]) -> PrefixIndex:
    live = PrefixIndex(BLOCK)
    block = LAYOUT.empty_full_block().zero_()
    for prompt in prompts:
        keys = block_keys(prompt, BLOCK, NS)
        live.insert(keys)
        for parent, key in zip([None, *keys], keys):
            store.put(key, block, parent=parent)
    return live


PROMPTS = [tokens(16), tokens(8) + tokens(12, start=50), tokens(20, start=300)]


@pytest.mark.parametrize("backend", ["local_dir", "memory"])
def test_rebuild_from_store_gives_the_same_matches(backend: str, tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT) if backend == "local_dir" else MemoryStore(LAYOUT)
    live = _fill(store, PROMPTS)
    rebuilt = PrefixIndex.rebuild(store, BLOCK)
    assert len(rebuilt) == len(live), "a rebuilt index must hold every stored block"
    probes = PROMPTS + [p[:9] for p in PROMPTS] + [tokens(8) + [7] * 12, tokens(30, start=301)]
    for probe in probes:
        assert rebuilt.match(probe, NS) == live.match(probe, NS), (
            "a rebuilt index must answer every lookup like the live one"
        )


def test_rebuild_leaves_out_orphans_and_corrupted_blocks(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    _fill(store, [tokens(16)])
    keys = block_keys(tokens(16), BLOCK, NS)
    store.delete(keys[1])
    path = store.path_of(keys[0])
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    rebuilt = PrefixIndex.rebuild(store, BLOCK)
    assert len(rebuilt) == 0, (
        "blocks that cannot be read, and blocks whose parent chain is broken, can never be hit"
    )


def test_rebuild_rejects_another_block_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex.rebuild(LocalDirStore(tmp_path, LAYOUT), BLOCK * 2)


def _common_full_blocks(a: list[int], b: list[int]) -> int:
    blocks = 0
    while (blocks + 1) * BLOCK <= min(len(a), len(b)) and a[: (blocks + 1) * BLOCK] == b[: (blocks + 1) * BLOCK]:
        blocks += 1
    return blocks


@settings(max_examples=60, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=4),
    probe=st.lists(st.integers(0, 3), max_size=14),
)
def test_match_is_the_longest_common_full_block_prefix(stored: list[list[int]], probe: list[int]) -> None:
    index = PrefixIndex(BLOCK)
    for prompt in stored:
        index.insert(block_keys(prompt, BLOCK, NS))
    expected = max((_common_full_blocks(prompt, probe) for prompt in stored), default=0)
    assert index.match(probe, NS).hit_blocks == expected, (
        "the hit must be the longest full-block prefix the probe shares with a stored prompt"
    )


def test_random_weight_seeds_get_their_own_namespace():
    from dualpath_ray.config import ModelConfig

    prompt = tokens(2 * BLOCK)
    a, b = ModelConfig(seed=1), ModelConfig(seed=2)
    a_keys = block_keys(prompt, BLOCK, a.kv_namespace(block_size=BLOCK))
    assert not set(a_keys) & set(block_keys(prompt, BLOCK, b.kv_namespace(block_size=BLOCK))), (
        "random weights of two seeds compute different KV, so their keys must differ"
    )
    assert namespace_for("m", 1, 23) != namespace_for("m", 12, 3), "version and seed must not alias"
    assert a.kv_namespace(5, block_size=BLOCK) == namespace_for(
        a.model_id, 5, 1, KVLayout.from_model(a, BLOCK)
    ), "an explicit version replaces the configured one"


def test_publish_indexes_a_chain_as_far_as_its_parents_are_indexed() -> None:
    index = PrefixIndex(4)
    keys = block_keys(list(range(16)), 4, "m@w0")
    assert index.publish([(keys[0], None), (keys[1], keys[0])]) == 2, "a chain from its first block is published"
    index.remove(keys[1])
    # keys[2]'s parent keys[1] is gone: it and everything after it stay out (no lookup could reach them).
    assert index.publish([(keys[2], keys[1]), (keys[3], keys[2])]) == 0
    assert keys[2] not in index and keys[3] not in index, "an orphan chain is not published"
    assert index.publish([(keys[1], keys[0]), (keys[2], keys[1])]) == 2, "re-published in order, it is indexed"
