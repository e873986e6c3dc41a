"""Damage to stored blocks, as the store_read corrupt fault applies it: one payload byte of the
block's file flipped on disk just before it is read, so the real checksum check must catch it."""

from __future__ import annotations

import random

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.block_store import BlockStore


def can_damage(store: BlockStore) -> bool:
    return hasattr(store, "path_of")


def damage_stored_block(store: BlockStore, key: str, rng: random.Random) -> bool:
    """Flip one payload byte of `key`'s file; False when it is not there (evicted meanwhile)."""
    path = store.path_of(key)  # type: ignore[attr-defined]
    try:
        with open(path, "r+b") as handle:
            size = handle.seek(0, 2)
            if size <= HEADER_SIZE:
                return False
            position = HEADER_SIZE + rng.randrange(size - HEADER_SIZE)
            handle.seek(position)
            byte = handle.read(1)[0]
            handle.seek(position)
            handle.write(bytes([byte ^ 0xFF]))
    except FileNotFoundError:
        return False
    return True
