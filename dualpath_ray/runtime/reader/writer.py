"""A node reader's block writes (persists): through the SNIC's write direction into the store,
with the store's refusals and the end-to-end check of persisted KV.

Each PersistedBlock carries the digest of the KV its engine computed (`digest`, kv/digest.py
persist_digest; runtime.kv_digests). The write hands the store a check of the bytes it wrote
(BlockStore.put's `verify`), which runs before the block is published: a block whose buffer went
bad between its engine and the store (a stale read into its extent, a bad copy, the store_publish
corrupt fault) is never published with a checksum that passes; it is refused like a full disk's
write (its chain stops there), counted (`persist_mismatches`, exported within
dualpath_store_write_failures) and logged, each one.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Callable, Sequence

import torch

from dualpath_ray.faults.plan import FaultMode, FaultSite
from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.digest import full_block_digest
from dualpath_ray.kv.errors import PersistDigestError
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.runtime.engine.faulty_ports import flip_byte
from dualpath_ray.runtime.reader.settings import ReaderFaults
from dualpath_ray.runtime.reader.snic import SnicLink
from dualpath_ray.runtime.reader.store_errors import WriteRefusals

LOG = logging.getLogger("dualpath_ray.reader")


class BlockWriter:
    """One node's persists. `lock` is the reader core's: the SNIC write counter and the
    mismatch count move under it, as the core's other counters do."""

    def __init__(
        self, node_id: str, layout: KVLayout, store: BlockStore, link: SnicLink, faults: ReaderFaults,
        counters: NodeCounters, lock: threading.Condition,
    ) -> None:
        self.node_id = node_id
        self.layout = layout
        self.store = store
        self.link = link
        self.faults = faults
        self.counters = counters
        self.lock = lock
        self.refusals = WriteRefusals(node_id)
        self.persist_mismatches = 0  # blocks whose bytes failed their engine's digest

    def write_block(self, block: PersistedBlock, data: torch.Tensor) -> bool:
        """Persist one Full Block (already in this node's buffer) through the SNIC: True if
        written, False if already stored; an OSError if the store refused it, PersistDigestError
        if the bytes the store wrote differ from the engine's digest of the KV it computed
        (block.digest): then nothing is published under its key."""
        self.link.take(self.layout.full_block_bytes)
        spec = self.faults.decide(FaultSite.STORE_PUBLISH) if self.faults.active else None
        if spec is not None and spec.mode is FaultMode.FAIL:
            raise OSError(errno.EIO, f"injected store_publish fault: I/O error writing block {block.key}")
        if spec is not None and spec.mode is FaultMode.DROP:
            return True  # a lost write that claims success: a later read of it is a miss
        if spec is not None and spec.mode is FaultMode.CORRUPT:
            flip_byte(data, self.faults.corruption_rng)  # the buffer went bad after its engine computed it
        verify = None if block.digest is None else digest_check(block)
        written = self.store.put(block.key, data, parent=block.parent, verify=verify)
        with self.lock:
            self.counters.snic_write += self.layout.full_block_bytes
        return written

    def write_blocks(self, blocks: Sequence[tuple[torch.Tensor, PersistedBlock]], fresh: list[str] | None = None) -> int:
        """Persist (data, block) pairs in chain order; returns how many leading ones are stored,
        and appends to `fresh` the keys whose bytes this call stored (not those stored already).

        A write the store refuses (any OSError: a full disk, an I/O error, a read-only file
        system) ends the call without raising: the turn that filled these blocks has its tokens
        and must not fail for a cache write; its decode engine just does not publish the refused
        block or any after it (the index is a chain of prefixes, so those could never be hit),
        and a later turn misses them and recomputes. The blocks after a refused one are not
        tried, for the same reason. Refusals are counted and logged once per run of them
        (runtime/reader/store_errors.py). A block whose bytes fail the engine's digest is
        refused the same way (never published with content its engine did not compute), and
        counted and logged, each one: it means KV went wrong in this node's buffer."""
        for stored, (data, block) in enumerate(blocks):
            try:
                if self.write_block(block, data) and fresh is not None:
                    fresh.append(block.key)
            except OSError as exc:
                self.refusals.refused(block.key, exc)
                return stored
            except PersistDigestError as exc:
                with self.lock:
                    self.persist_mismatches += 1
                LOG.warning("node %s: %s; not published, nor the blocks after it in its chain", self.node_id, exc)
                return stored
        if blocks:
            self.refusals.succeeded()
        return len(blocks)


def digest_check(block: PersistedBlock) -> Callable[[torch.Tensor], None]:
    """The store's check of `block`'s bytes as written, before it publishes them."""

    def check(written: torch.Tensor) -> None:
        got = full_block_digest(written)
        if got != block.digest:
            raise PersistDigestError(
                f"block {block.key}: the bytes the store wrote have digest {got}, the KV its engine "
                f"computed {block.digest}"
            )

    return check
