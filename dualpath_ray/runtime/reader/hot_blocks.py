"""A decode node's hot tier: freshly computed prompt blocks its reader keeps in memory.

In-flight sharing (scheduling/sharing.py) lets G samples of one prompt wait for the one that
computes it. That producer's prompt KV reaches its decode node's buffer right after its prefill
(the prefill -> decode transfer), long before the store has it back through a slow SNIC. When the
reader is asked to persist those blocks from the extent (`persist_extent`), it first copies them
here (`hold`), checking each against the digest of the KV its engine computed, and only then
says so to the scheduler, which publishes them and releases the waiters; a waiter decoding on the
same node reads them on its DE path, and this reader serves them from here (`serve`: a memory
copy into the waiter's extent, checked against the same digest again) instead of reading the
store. The prefill engine then pulls them over its CNIC as it pulls any DE-path hit. Real bytes
move; nothing is emulated here.

Invariants: a held block leaves only once its write to the store has ended (`written`: then
the store serves it) or failed (`dropped`: the index entry a waiter may still follow fails like
any missing block and is repaired: docs/reliability.md), so every published block is in memory
here or in the store. A held block's bytes are the store's bytes under its key, or the store has
none yet: two attempts that compute the same prompt (a retried producer and its released
waiters) compute its blocks in different batches, whose kernels may round differently, and the
store keeps the first write of a key (a later put answers "already stored"). So a key the store
has is not held; a persist of a key held already writes the held copy, not its own (a waiter
may have been served it while both writes raced: runtime/reader/core.py write_extent); each
copy is held for the persist that holds it (`holder`), and a write that did not store that
copy's bytes (another persist's put stored the key, or the store had it already) drops it: the
store serves the key from then on, and every reader of it gets the same bytes.

Room is made by dropping written blocks, oldest write first; a persist
whose blocks do not all fit is not held (`hold` answers False) and its producer's waiters read
the store after its turn, as without this tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from dualpath_ray.kv.digest import full_block_digest
from dualpath_ray.protocol.messages import PersistedBlock


class HotBlocks:
    """key -> (a copy of the block, its engine's digest, its holder), at most `capacity` blocks;
    thread-safe (the reader's io threads hold and serve, its persists mark written)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"scheduler.share_buffer_blocks must be >= 0 (0: off), not {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._blocks: dict[str, tuple[torch.Tensor, int | None, int]] = {}
        self._written: OrderedDict[str, None] = OrderedDict()  # held and stored: may leave, oldest first
        self.served = 0  # blocks read from here instead of the store
        self.held = 0  # blocks ever held
        self.refused = 0  # persists not held: no room, or a block that failed its digest

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def hold(self, blocks: Sequence[tuple[torch.Tensor, PersistedBlock]], holder: int) -> bool:
        """Copy every block of a prompt's persist (`holder`: an id no other persist has, its
        extent's), all or none; False when they do not fit (after dropping written blocks) or one
        differs from its engine's digest. A key held already keeps its copy."""
        checked = []
        for data, block in blocks:
            if block.digest is not None and full_block_digest(data) != block.digest:
                with self._lock:
                    self.refused += 1
                return False
            checked.append((block.key, data.clone(), block.digest))
        with self._lock:
            new = [entry for entry in checked if entry[0] not in self._blocks]
            if len(self._blocks) - len(self._written) + len(new) > self.capacity:
                self.refused += 1
                return False
            while len(self._blocks) + len(new) > self.capacity:
                key, _ = self._written.popitem(last=False)
                del self._blocks[key]
            for key, data, digest in new:
                self._blocks[key] = (data, digest, holder)
            self.held += len(new)
            return True

    def written(self, keys: Sequence[str], holder: int) -> None:
        """`holder`'s persist stored these keys with its bytes: its copies may leave, after those
        written before them; another persist's copy of one of them differs from the store's
        bytes (module doc) and leaves now."""
        with self._lock:
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None:
                    continue
                if entry[2] == holder:
                    self._written[key] = None
                else:  # the store holds `holder`'s bytes now (even if it had dropped an earlier copy's)
                    self._drop(key)

    def stored_already(self, keys: Sequence[str]) -> None:
        """A persist found these keys stored already (by an earlier write, with bytes that may not
        be any held copy's): a copy not yet known to be the store's leaves now (module doc)."""
        with self._lock:
            for key in keys:
                if key in self._blocks and key not in self._written:
                    self._drop(key)

    def held_copy(self, key: str) -> tuple[torch.Tensor, int | None] | None:
        """The held copy of `key` and its digest, if any: what any persist of the key writes,
        so the store gets the bytes readers may have been served already (module doc)."""
        with self._lock:
            entry = self._blocks.get(key)
        return None if entry is None else (entry[0], entry[1])

    def _drop(self, key: str) -> None:
        self._blocks.pop(key, None)
        self._written.pop(key, None)

    def dropped(self, keys: Sequence[str]) -> None:
        """Their write failed or was refused: the store will not have them from this persist."""
        with self._lock:
            for key in keys:
                self._drop(key)

    def serve(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[int]:
        """Copy every held block of `keys` into its `outs` slot, checked against its digest; the
        indices of the others (the caller reads those from the store)."""
        cold = []
        for index, (key, out) in enumerate(zip(keys, outs)):
            with self._lock:
                entry = self._blocks.get(key)
            if entry is None:
                cold.append(index)
                continue
            data, digest, _ = entry
            out.copy_(data)
            if digest is not None and full_block_digest(out) != digest:
                self.dropped([key])  # never served again: the store's copy is read instead
                cold.append(index)
                continue
            with self._lock:
                self.served += 1
        return cold

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"held_now": len(self._blocks), "held": self.held, "served": self.served, "refused": self.refused}
