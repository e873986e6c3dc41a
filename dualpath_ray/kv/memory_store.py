"""MemoryStore: an in-memory BlockStore for tests, with hooks that inject faults.

It keeps LocalDirStore's contract (same key checks, same errors, a read verifies the checksum
of the bytes it delivers), so code tested against it behaves the same against the real store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath_ray.kv.block_format import BlockHeader, checksum, verify_payload
from dualpath_ray.kv.block_store import (
    BlockCheck,
    BlockNotFoundError,
    BlockStore,
    byte_view,
    check_host_block,
    validate_key,
)
from dualpath_ray.kv.layout import KVLayout

KeyHook = Callable[[str], None]



if TYPE_CHECKING:
    import torch

class InjectedPutError(OSError):
    """A put failed on purpose (MemoryStore.fail_next_puts)."""


@dataclass
class _Entry:
    payload: bytearray
    header: BlockHeader
    published_at: float  # wall clock of its put, or of a later put that found it (see discard)


class MemoryStore(BlockStore):
    """Full Blocks in a dict; fault hooks: corrupt_next_read, corrupt, fail_next_puts, hooks."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._corrupt_next: set[str] = set()
        self._failing_puts = 0
        self._before_get: KeyHook | None = None
        self._before_put: KeyHook | None = None
        self.reads = 0
        self.writes = 0

    def corrupt_next_read(self, key: str) -> None:
        """The next read of `key` delivers one flipped byte and so raises BlockCorruptedError."""
        with self._lock:
            self._corrupt_next.add(validate_key(key))

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Flip one stored payload byte of `key`: every later read raises BlockCorruptedError."""
        with self._lock:
            entry = self._entry(validate_key(key))
            entry.payload[offset] ^= 0xFF

    def fail_next_puts(self, count: int = 1) -> None:
        """The next `count` puts raise InjectedPutError before anything is published."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with self._lock:
            self._failing_puts = count

    def set_before_get(self, hook: KeyHook | None) -> None:
        """Run `hook(key)` before each read (to delay, count, or raise); None removes it."""
        self._before_get = hook

    def set_before_put(self, hook: KeyHook | None) -> None:
        """Run `hook(key)` before each put is published (raising leaves a miss); None removes it."""
        self._before_put = hook

    def put(
        self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None
    ) -> bool:
        validate_key(key)
        if parent is not None:
            validate_key(parent)
        check_host_block(self.layout, block, "block")
        payload = bytearray(byte_view(block))
        header = BlockHeader.for_block(self.layout, key, parent, checksum(payload))
        if verify is not None:  # the bytes as this store holds them
            import torch

            verify(torch.frombuffer(payload, dtype=torch.uint8).view(block.shape))
        with self._lock:
            if self._failing_puts:
                self._failing_puts -= 1
                raise InjectedPutError(f"injected failure of put {key}")
        if self._before_put is not None:
            self._before_put(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.published_at = time.time()
                return False
            self._entries[key] = _Entry(payload, header, time.time())
            self.writes += 1
            return True

    def get_into(self, key: str, out: torch.Tensor) -> None:
        validate_key(key)
        check_host_block(self.layout, out, "out")
        if self._before_get is not None:
            self._before_get(key)
        target = byte_view(out)
        with self._lock:
            entry = self._entry(key)
            target[:] = entry.payload
            if key in self._corrupt_next:
                self._corrupt_next.discard(key)
                target[0] ^= 0xFF
            self.reads += 1
        verify_payload(target, entry.header.payload_checksum, f"memory block {key}")

    def contains(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return self._entries.pop(key, None) is not None

    def discard(self, key: str, published_before: float) -> bool:
        validate_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.published_at >= published_before:
                return False
            del self._entries[key]
            return True

    def keys(self) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def parent_of(self, key: str) -> str | None:
        validate_key(key)
        with self._lock:
            return self._entry(key).header.parent

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise BlockNotFoundError(f"block {key} is not in the memory store")
        return entry
