"""The block store contract: keys, errors, and the BlockStore interface every backend implements.

A store maps a block key (32 lowercase hex chars, see kv/index.py) to one Full Block and the key
of the block before it. Invariants every backend keeps:
- a key that is not exactly 32 lowercase hex chars is rejected before it touches a path, so no
  key can name anything outside the store;
- a read either fills the caller's buffer with the exact bytes that were put, or raises
  (BlockNotFoundError, BlockCorruptedError, IncompatibleBlockError); after a raise the buffer's
  contents are unspecified and must not be used;
- a put is all or nothing: a crash or error before publish leaves a miss, never a torn block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath_ray.kv.errors import (
    BlockCorruptedError,
    BlockNotFoundError,
    IncompatibleBlockError,
)
from dualpath_ray.kv.keys import KEY_PATTERN, validate_key
from dualpath_ray.kv.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "KEY_PATTERN", "BlockCheck", "BlockCorruptedError", "BlockHook", "BlockNotFoundError", "BlockStore",
    "IncompatibleBlockError", "byte_view", "check_batch", "check_host_block", "validate_key",
]

BlockHook = Callable[[int], object]
# on_failed(i, error): block i of a multi-block read was bad (missing, corrupt, unreadable).
BlockFailureHook = Callable[[int, BaseException], object]
# Checks a block's bytes as a put wrote them, before they are published; raises to refuse them.
BlockCheck = Callable[["torch.Tensor"], None]


def check_host_block(layout: KVLayout, block: torch.Tensor, what: str) -> None:
    """Raise ValueError unless `block` is a contiguous uint8 host Full Block of `layout`."""
    layout.check_full_block(block)
    if block.device.type != "cpu":
        raise ValueError(f"{what} must be a host tensor, got device {block.device}")


def check_batch(layout: KVLayout, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless keys and outs pair up, every key is valid, every out a host block."""
    if len(keys) != len(outs):
        raise ValueError(f"got {len(keys)} keys but {len(outs)} output blocks: pass one out per key")
    import torch

    for key in keys:
        validate_key(key)
    shape = torch.Size(layout.full_block_shape)
    for i, out in enumerate(outs):
        if not (out.dtype is torch.uint8 and out.shape == shape and out.is_cpu and out.is_contiguous()):
            check_host_block(layout, out, f"outs[{i}]")


def byte_view(block: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor, sharing its memory."""
    return memoryview(block.numpy()).cast("B")


class BlockStore(ABC):
    """Full Blocks of one KV layout, addressed by block key."""

    layout: KVLayout

    @property
    def root(self) -> Path | None:
        """The directory holding the blocks; None for a store without one."""
        return None

    @abstractmethod
    def put(
        self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None
    ) -> bool:
        """Store `block` under `key`, after block `parent`. False only if a valid block of this
        layout is already stored under `key` (a key names its content: it is this block; its
        publish time is refreshed, so a `discard` decided before this put keeps it); what is
        stored there and is not (another layout, a damaged file) is replaced.

        `verify`, if given, is called with the block once its bytes are written and before they
        are published; if it raises, nothing is published under `key` (a miss, as a failed
        write leaves) and the error propagates. It is the end-to-end check of persisted KV
        (runtime/reader/core.py write_block): the bytes the store took, against the engine's
        digest of what it computed."""

    @abstractmethod
    def get_into(self, key: str, out: torch.Tensor) -> None:
        """Fill `out` (a contiguous uint8 host Full Block, maybe a pool view) with block `key`."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `key` is stored (without verifying it)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; False if it was not stored."""

    def discard(self, key: str, published_before: float) -> bool:
        """Delete `key` unless it was published, or put again while stored, at or after
        `published_before` (wall-clock seconds, as file times are): then a writer that found it
        may be reporting it to an index right now, and deleting it would leave that index naming
        a missing block. True if deleted; False if kept or absent. A store without publish times
        (this default) deletes."""
        return self.delete(key)

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Every stored key, in no particular order."""

    @abstractmethod
    def parent_of(self, key: str) -> str | None:
        """The key of the block before `key` (None for a first block)."""

    def get_many_into(
        self,
        keys: Sequence[str],
        outs: Sequence[torch.Tensor],
        before_read: BlockHook | None = None,
        on_verified: BlockHook | None = None,
        on_failed: BlockFailureHook | None = None,
    ) -> None:
        """Fill outs[i] with block keys[i]; raises like get_into for the first failing key.

        The hooks take a block index. before_read(i) runs just before block i is read (to pace
        reads, e.g. by a NIC token bucket) on the thread that reads it: a backend may read
        blocks on several threads at once, so the hook must be thread-safe. on_verified(i) runs
        on the caller's thread once block i has passed verification, for i = 0, 1, ... in
        order. Only blocks reported to on_verified may be used; after a raise, the out of every
        block that was read but not reported holds zeros, never unverified bytes.

        on_failed(i, error) runs on the caller's thread, before the raise, for every block the
        read found bad, in key order: a backend reading several blocks at once may find more than
        the one it raises for (each was read because before_read(i) ran), and a caller that
        counts or repairs bad blocks must hear of all of them.
        """
        check_batch(self.layout, keys, outs)
        for i, (key, out) in enumerate(zip(keys, outs)):
            if before_read is not None:
                before_read(i)
            try:
                self.get_into(key, out)
            except BlockNotFoundError as exc:
                if on_failed is not None:
                    on_failed(i, exc)
                raise
            except BaseException as exc:
                out.zero_()
                if on_failed is not None:
                    on_failed(i, exc)
                raise
            if on_verified is not None:
                on_verified(i)

    def get(self, key: str) -> torch.Tensor:
        """A freshly allocated copy of block `key`."""
        out = self.layout.empty_full_block()
        self.get_into(key, out)
        return out

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def remove_stale_temporaries(self, max_age_s: float) -> int:
        """Delete leftovers of puts that crashed over `max_age_s` ago; stores without any: 0."""
        return 0

    def close(self) -> None:
        """Release what the store holds open (threads, handles); reads still work afterwards."""
