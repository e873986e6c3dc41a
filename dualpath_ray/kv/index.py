"""Block keys and the prefix trie that finds the hit tokens of a prompt (paper: "Block layouts").

A block key is a chained hash, key_i = xxh3_128(key_{i-1} || len(ns) || ns || token ids of block
i as int64), with block 0 chained from a root derived from the namespace ns alone. A key therefore names the
whole token prefix up to and including its block, under one model, weight version and KV layout, so two
prompts share a key exactly when they share that prefix. Only full blocks get keys: a trailing
partial block is always a miss.

The trie mirrors the store: one node per stored Full Block, linked to the block before it. A
lookup walks the prompt's key chain from the root and stops at the first key it does not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import xxhash

from dualpath_ray.kv.errors import BlockCorruptedError, BlockNotFoundError, IncompatibleBlockError
from dualpath_ray.kv.keys import validate_key

if TYPE_CHECKING:
    from dualpath_ray.kv.block_store import BlockStore
    from dualpath_ray.kv.layout import KVLayout

_LOG = logging.getLogger(__name__)

_ROOT_DOMAIN = b"dualpath-ray/block-chain-root/v1\x00"
# Token ids are hashed as little-endian int64 whatever the caller's dtype, so a list, an int32
# array and a torch tensor of the same ids give the same keys.
_TOKEN_DTYPE = np.dtype("<i8")


def namespace_for(
    model_id: str, weight_version: int, seed: int | None = None, layout: KVLayout | None = None
) -> str:
    """The namespace of every block key of one model at one weight version, in one KV layout.

    `seed` is the seed of random weights (None for a checkpoint's): two runs of random weights
    with different seeds compute different KV, so their blocks must never hit each other.
    `layout` (dtype, layers, KV heads, head dim, block size) is part of it so that a persistent
    store never holds a block of one layout under the key another layout asks for: after a
    change of layout every old block is a miss, not a read that fails. Every key a runtime
    stores is made with a layout (ModelConfig.kv_namespace); None is for keys nothing stores.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    for name, value in (("weight_version", weight_version), ("seed", seed)):
        if value is None and name == "seed":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if weight_version < 0:
        raise ValueError(f"weight_version must be >= 0, got {weight_version}")
    # The version (and seed) follow the model id, digits only after '@w' (and 's'); the layout
    # tag, which has no '@' or '#', comes last after '#kv:'. Read from the end, a namespace
    # splits back into its parts one way only, so the mapping is 1:1.
    suffix = "" if seed is None else f"s{int(seed)}"
    tag = "" if layout is None else f"#kv:{layout.key_tag}"
    return f"{model_id}@w{int(weight_version)}{suffix}{tag}"


# A tenant's cache salt follows the layout tag after this marker (no namespace_for part holds '!').
_SALT_MARK = "!salt:"


def salted_namespace(namespace: str, salt: str | None) -> str:
    """`namespace` with a tenant's cache salt (None: unchanged). Blocks of one salt never hit
    another's, so a client cannot learn from cached_tokens what another client's prompts held.
    The salt is hashed, so a key never carries the tenant's secret."""
    if salt is None:
        return namespace
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string or None, got {salt!r}")
    if _SALT_MARK in namespace:
        raise ValueError(f"namespace {namespace!r} is already salted")
    return f"{namespace}{_SALT_MARK}{xxhash.xxh3_128_hexdigest(salt.encode())}"


def unsalted_namespace(namespace: str) -> str:
    """The model's namespace of a (possibly salted) key namespace: what names its weights."""
    return namespace.split(_SALT_MARK, 1)[0]


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=_TOKEN_DTYPE)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def _namespace_field(namespace: str) -> bytes:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string (see namespace_for), got {namespace!r}")
    encoded = namespace.encode()
    # Length-prefixed so that no (namespace, tokens) pair can alias another.
    return len(encoded).to_bytes(4, "little") + encoded


def _root_digest(namespace_bytes: bytes) -> bytes:
    return xxhash.xxh3_128_digest(_ROOT_DOMAIN + namespace_bytes)


def _chain(parent_digest: bytes, namespace_bytes: bytes, block_tokens: np.ndarray) -> bytes:
    hasher = xxhash.xxh3_128(parent_digest)
    hasher.update(namespace_bytes)
    hasher.update(block_tokens.data)
    return hasher.digest()


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, namespace: str) -> list[str]:
    """One key per full block of `token_ids`, in order; a trailing partial block gets none."""
    _check_block_size(block_size)
    tokens = _token_array(token_ids)
    n_full = tokens.size // block_size
    namespace_bytes = _namespace_field(namespace)
    # The chain of `_chain`, one hash call per block over the joined bytes (the same input, so
    # the same digest): the scheduler hashes every prompt it is given, tens of thousands of
    # tokens a turn at the paper's contexts.
    raw = memoryview(tokens[: n_full * block_size].tobytes())
    stride = block_size * _TOKEN_DTYPE.itemsize
    digest = _root_digest(namespace_bytes)
    hash128, join = xxhash.xxh3_128_digest, b"".join
    keys: list[str] = []
    for start in range(0, n_full * stride, stride):
        digest = hash128(join((digest, namespace_bytes, raw[start : start + stride])))
        keys.append(digest.hex())
    return keys


def next_block_key(parent: str | None, block_token_ids: Sequence[int], namespace: str) -> str:
    """The key of one full block that follows `parent` (None: the first block of a prompt).

    Decode persists blocks one at a time; this extends a known chain without rehashing it.
    """
    tokens = _token_array(block_token_ids)
    if tokens.size == 0:
        raise ValueError("a block needs at least one token id")
    namespace_bytes = _namespace_field(namespace)
    parent_digest = _root_digest(namespace_bytes) if parent is None else bytes.fromhex(validate_key(parent))
    return _chain(parent_digest, namespace_bytes, tokens).hex()


class PrefixHit(NamedTuple):
    """The longest stored prefix of a prompt: its blocks, its tokens and the blocks' keys."""

    hit_blocks: int
    hit_tokens: int
    keys: list[str]


@dataclass(eq=False, slots=True)
class _Node:
    key: str
    parent: _Node | None
    used: int  # the index's clock at the block's last publish or hit (PrefixIndex.touch)
    children: dict[str, _Node] = field(default_factory=dict)


class IndexObserver(Protocol):
    """Told of each change of a PrefixIndex as it is made, so that what follows the index (the
    store's LRU order and its deleter, kv/eviction.py) is kept in step incrementally: nothing has
    to scan the index to find out what changed."""

    def added(self, key: str, used: int) -> None:
        """`key` was indexed (it has no children yet) at clock `used`."""

    def removed(self, keys: list[str], new_leaf: str | None) -> None:
        """`keys` (one block and every block after it) left the index; `new_leaf` is the block
        before them when it has no other child left (None otherwise)."""

    def cleared(self, keys: Collection[str]) -> None:
        """Every block left the index at once; `keys` were indexed (a collection no one changes)."""


class PrefixIndex:
    """A prefix trie of stored Full Block keys: which prefix of a prompt is already stored."""

    def __init__(self, block_size: int) -> None:
        _check_block_size(block_size)
        self.block_size = block_size
        self._nodes: dict[str, _Node] = {}
        self._observer: IndexObserver | None = None
        # Counts publishes and hits: each block's `used` is its value at the block's last one,
        # so the blocks' recency needs no table of its own (kv/eviction.py orders by it).
        self.clock = 0

    def observe(self, observer: IndexObserver | None) -> None:
        """Tell `observer` of every later change (one observer; None: nobody)."""
        self._observer = observer

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def clear(self) -> None:
        # A new dict, so the old one can be handed on as it is (O(1) here: the observer's deleter
        # walks it on its own thread) and is never changed again.
        dropped, self._nodes = self._nodes, {}
        if self._observer is not None:
            self._observer.cleared(dropped.keys())

    def keys(self) -> list[str]:
        return list(self._nodes)

    def touch(self, keys: Iterable[str]) -> int:
        """These blocks were just hit or published: most recently used. `keys` is a chain, first
        block first (a lookup's hits, a turn's published blocks), walked like a lookup: one
        search of the whole index, then each block's children (a block not found that way is
        searched in the whole index). Returns how many are indexed."""
        nodes, clock, touched = self._nodes, self.clock, 0
        node: _Node | None = None
        for key in keys:
            child = node.children.get(key) if node is not None else None
            if child is None:
                child = nodes.get(key)
            node = child
            if child is not None:
                clock += 1
                child.used = clock
                touched += 1
        self.clock = clock
        return touched

    def last_used(self, key: str) -> int | None:
        """The clock at the block's last publish or hit; None if it is not indexed."""
        node = self._nodes.get(key)
        return None if node is None else node.used

    def leaf_used(self, key: str) -> int | None:
        """last_used of an indexed leaf (no indexed block follows it); None for any other key."""
        node = self._nodes.get(key)
        return None if node is None or node.children else node.used

    def is_leaf(self, key: str) -> bool:
        """Whether no indexed block follows `key` (KeyError if absent)."""
        return not self._nodes[key].children

    def parent_of(self, key: str) -> str | None:
        """The key of the block before `key` (None for a first block); KeyError if absent."""
        parent = self._nodes[key].parent
        return None if parent is None else parent.key

    def insert_block(self, key: str, parent: str | None) -> bool:
        """Add one block under `parent` (None: a first block); False if it was already there."""
        existing = self._nodes.get(key)
        if existing is not None:
            existing_parent = None if existing.parent is None else existing.parent.key
            if existing_parent != parent:
                raise ValueError(
                    f"block {key} is indexed under parent {existing_parent}, not {parent}: "
                    "a key names its whole prefix, so its parent can never change"
                )
            return False
        parent_node = None
        if parent is not None:
            parent_node = self._nodes.get(parent)
            if parent_node is None:
                raise ValueError(
                    f"cannot index block {key}: its parent {parent} is not indexed "
                    "(insert a chain parent first)"
                )
        self.clock = used = self.clock + 1
        node = _Node(key, parent_node, used)
        if parent_node is not None:
            parent_node.children[key] = node
        self._nodes[key] = node
        if self._observer is not None:
            self._observer.added(key, used)
        return True

    def publish(self, blocks: Iterable[tuple[str, str | None]]) -> int:
        """Index a turn's persisted (key, parent) blocks in chain order, as far as their chain
        holds: from the first block whose parent is not indexed (taken out meanwhile by a
        repair, an eviction or reset_prefix_cache) none is, since no lookup could reach them
        (an orphan chain is simply not published). Returns how many are indexed now."""
        indexed = 0
        for key, parent in blocks:
            existing = self._nodes.get(key)
            if existing is not None:
                if (None if existing.parent is None else existing.parent.key) != parent:
                    break  # another chain under this key: a collision no lookup must follow
            elif parent is not None and parent not in self._nodes:
                break
            else:
                self.insert_block(key, parent)
            indexed += 1
        return indexed

    def insert(self, keys: Sequence[str]) -> int:
        """Add a key chain (parent first, the first key a first block); returns how many were new."""
        added = 0
        parent: str | None = None
        for key in keys:
            added += self.insert_block(key, parent)
            parent = key
        return added

    def match_keys(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of the key chain `keys` held by the trie."""
        if not keys:
            return 0
        node = self._nodes.get(keys[0])
        if node is None:
            return 0
        matched = 1
        for key in keys[1:]:
            node = node.children.get(key)
            if node is None:
                break
            matched += 1
        return matched

    def chain(self, token_ids: Sequence[int] | np.ndarray, namespace: str) -> list[str]:
        """Every full block key of a prompt, stored or not (in-flight sharing names promises by them)."""
        return block_keys(token_ids, self.block_size, namespace)

    def match(self, token_ids: Sequence[int] | np.ndarray, namespace: str) -> PrefixHit:
        """The longest stored prefix of a prompt, in whole blocks."""
        keys = block_keys(token_ids, self.block_size, namespace)
        hit = self.match_keys(keys)
        return PrefixHit(hit_blocks=hit, hit_tokens=hit * self.block_size, keys=keys[:hit])

    def remove(self, key: str) -> int:
        """Remove a block and every block after it (they can never be hit); returns the count."""
        node = self._nodes.get(key)
        if node is None:
            return 0
        parent = node.parent
        if parent is not None:
            del parent.children[key]
        removed: list[str] = [key]
        del self._nodes[key]
        # Iterative on purpose: a long conversation is a chain thousands of blocks deep. (A leaf,
        # what eviction removes once per victim, skips it.)
        stack = list(node.children.values())
        while stack:
            current = stack.pop()
            del self._nodes[current.key]
            removed.append(current.key)
            stack.extend(current.children.values())
        if self._observer is not None:
            self._observer.removed(removed, parent.key if parent is not None and not parent.children else None)
        return len(removed)

    @classmethod
    def rebuild(cls, store: BlockStore, block_size: int) -> PrefixIndex:
        """An index of every hittable block in `store`: those whose whole parent chain is stored.

        Blocks that cannot be read (corrupted, another layout, deleted while scanning) and
        blocks whose parent chain is broken are left out, because no lookup could hit them.
        """
        if store.layout.block_size != block_size:
            raise ValueError(
                f"block_size {block_size} differs from the store's layout block_size "
                f"{store.layout.block_size}"
            )
        parents = _scan_parents(store)
        index = cls(block_size)
        children: dict[str | None, list[str]] = {}
        for key, parent in parents.items():
            children.setdefault(parent, []).append(key)
        frontier: list[str | None] = [None]
        while frontier:
            parent = frontier.pop()
            for key in children.get(parent, ()):
                index.insert_block(key, parent)
                frontier.append(key)
        orphans = len(parents) - len(index)
        if orphans:
            _LOG.info("index rebuild left out %d blocks whose parent chain is not stored", orphans)
        return index


def _scan_parents(store: BlockStore) -> dict[str, str | None]:
    parents: dict[str, str | None] = {}
    unreadable = 0
    for key in store.keys():
        try:
            parents[key] = store.parent_of(key)
        except (BlockNotFoundError, BlockCorruptedError, IncompatibleBlockError):
            unreadable += 1
    if unreadable:
        _LOG.warning("index rebuild skipped %d unreadable blocks", unreadable)
    return parents
