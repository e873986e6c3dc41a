"""A decode engine's persistence: every block its requests fill, on its way to the store.

One stage of a request's life on a decode engine, an object its DecodeCore (runtime/decode/core.py)
holds. Persistence has one owner per block: the request that filled it. Prompt blocks that were
not hits are written by the node's reader straight from the extent (they are already in the
buffer), which is freed after; a block that fills up while decoding is pulled from its page by
the reader (D2H) and written. At most `max_persists_in_flight` pulled blocks are on their way at
once; more wait in the request's queue (back-pressure, never a failure). The core reports a turn
only after every one of its blocks is settled (`pending`), so the next turn never misses a
block this one produced. Keys extend the chain block by block (`next_block_key`), O(n) per
request. Oracle mode writes each block from its page into the store in place. Where a filled
block is pulled from is the engine's `FilledBlocks` (runtime/decode/filled_blocks.py): its page,
the engine's own or, when the compute keeps the KV, the compute's (vLLM's), straight into the
reader's buffer; the engine keeps no copy of it.

Each block carries the digest of the KV this engine holds for it (runtime.kv_digests: the prefill
engine's digests for a computed prompt block, the page's for one filled while decoding); the
reader publishes it only if the bytes the store wrote match (runtime/reader/core.py write_block),
and a mismatch is refused like a full disk.

A block the store refuses (a full disk, an I/O error: the reader answers with how many leading
blocks of a persist it stored) never fails the turn: its tokens are served, and the turn
publishes (`publish`) only its chain up to the first block not stored, since the index is a
chain of prefixes and nothing after a gap could be hit; nothing more of it is persisted. A
persist that fails otherwise (its reader died, its call was lost, the D2H read failed) still
fails the request, whose retry persists again: whether its blocks were written is unknown.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.digest import full_block_digest, persist_digest
from dualpath_ray.kv.index import next_block_key
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.runtime.decode.filled_blocks import FilledBlocks
from dualpath_ray.runtime.decode.job import DecodeJob, DecodeSettings, DecodeStats
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.engine.ports import ReaderPort
from dualpath_ray.runtime.reader.store_errors import WriteRefusals
from dualpath_ray.protocol.types import ReadPath


class DecodePersistence:
    """The blocks of every job on one decode engine from filled to published. It owns the count of
    pulled blocks in flight (the back-pressure budget); each job carries its own queue, its
    persists on their way and the blocks published so far."""

    def __init__(
        self,
        settings: DecodeSettings,
        layout: KVLayout,
        filled: FilledBlocks,
        readers: ReaderPort,
        store: BlockStore | None,
        metering: tuple[Link, NodeCounters, DecodeStats],
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.filled = filled
        self.readers = readers
        self.store = store
        self.cnic_out, self.counters, self.stats = metering
        self._in_flight = 0  # pulled blocks posted and not yet settled, over all jobs
        self.oracle_refusals = WriteRefusals(settings.node_id)  # oracle mode writes the store itself

    def persist_prompt(self, job: DecodeJob) -> None:
        """Prompt blocks that were not hits: written from the extent, which is then freed."""
        assert job.handoff is not None
        task = job.handoff.task
        size = self.layout.block_size
        first = task.stored_tokens // size
        blocks = []
        for block in range(first, job.prompt_len // size):
            blocks.append((block, self._next_key(job, block, self._prompt_digest(job, block))))
        if task.oracle:
            for data, (_, persisted) in zip(self.filled.read(job, [block for block, _ in blocks]), blocks):
                self._oracle_write(job, data, persisted)
            return
        extent = job.handoff.extent
        assert extent is not None
        if not blocks:
            self.readers.free(extent)
            return
        # Not counted against max_persists_in_flight: these blocks already sit in a leased extent;
        # the budget bounds the reader's pulls of filled pages.
        job.extent_persist = self.readers.persist_extent(extent, blocks)
        job.extent_blocks = tuple(p for _, p in blocks)

    def block_filled(self, job: DecodeJob, block: int) -> None:
        """A decode step filled the job's `block`: keyed now (the chain is in token order), and
        written at once in oracle mode or queued for the reader to pull from its page."""
        assert job.handoff is not None
        oracle = job.handoff.task.oracle
        if job.refused:
            self._next_key(job, block)
            return  # a block after a refused one could never be hit: not written at all
        if oracle:
            self._oracle_write(job, self.filled.read(job, [block])[0], persisted=self._next_key(job, block))
            return
        # The block as this engine computed it: the reader publishes it only if what it pulled
        # and the store wrote is this (the pull may come much later).
        digest = full_block_digest(self.filled.read(job, [block])[0]) if self.settings.kv_digests else None
        job.queued.append((self.filled.capture(job, block), self._next_key(job, block, digest)))

    def pending(self, job: DecodeJob) -> bool:
        """Whether a block of the job is still queued or on its way (its turn cannot end yet)."""
        return bool(job.persists or job.queued or job.extent_persist is not None)

    def post(self, jobs: Sequence[DecodeJob]) -> bool:
        """Post queued blocks of `jobs`, in order, while the in-flight budget has room; True when
        any was posted. A job that finds no room waits for the next step, as do those after it."""
        did = False
        for job in jobs:
            if job.refused:
                job.queued.clear()
            if not job.queued:
                continue
            room = self.settings.max_persists_in_flight - self._in_flight
            if room <= 0:
                self.stats.persist_waits += 1
                break
            blocks = [job.queued.popleft() for _ in range(min(room, len(job.queued)))]
            nbytes = len(blocks) * self.layout.full_block_bytes
            self.cnic_out.take(nbytes)
            self.counters.cnic_out[ReadPath(job.handoff.task.path).side.value] += nbytes  # type: ignore[union-attr]
            pending = self.readers.persist_pages(self.settings.node_id, job.owner, blocks, self.filled.paged)
            job.persists.append((pending, tuple(p for _, p in blocks)))
            self._in_flight += len(blocks)
            self.stats.max_persists_in_flight = max(self.stats.max_persists_in_flight, self._in_flight)
            did = True
        return did

    def in_flight(self, job: DecodeJob) -> bool:
        """Whether a persist of the job is on its way (posted, not yet settled)."""
        return bool(job.persists) or job.extent_persist is not None

    def settle(self, job: DecodeJob) -> tuple[bool, BaseException | None]:
        """Collect the job's finished persists: (whether any settled, the error of a failed one).
        A persist that failed (not one the store refused: that one answers how many blocks it
        stored) fails the request; the caller does that."""
        if not job.persists and job.extent_persist is None:
            return False, None  # nothing on its way (every running job, every step: the common case)
        still, settled, error = [], False, None
        if job.extent_persist is not None:
            try:
                if job.extent_persist.done():
                    self._stored(job, job.extent_blocks, job.extent_persist.wait(0))
                    job.extent_persist, settled = None, True
            except Exception as exc:  # noqa: BLE001 - whether its blocks were written is unknown
                job.extent_persist, error = None, exc
        for pending, blocks in job.persists:
            try:
                done = pending.done()
                stored = pending.wait(0) if done else 0
            except Exception as exc:  # noqa: BLE001 - whether its blocks were written is unknown
                self._in_flight -= len(blocks)
                error = exc
                continue
            if done:
                self._in_flight -= len(blocks)
                self._stored(job, blocks, stored)
                settled = True
            else:
                still.append((pending, blocks))
        job.persists = still
        return settled, error

    def publish(self, job: DecodeJob) -> tuple[PersistedBlock, ...]:
        """The blocks the job's finished turn publishes (asked once, as it finishes): its chain
        up to the first block not stored; the rest are counted unpublished."""
        count = 0
        while count < len(job.chain) and job.chain[count].key in job.stored:
            count += 1
        self.stats.unpublished_blocks += len(job.chain) - count
        return tuple(job.chain[:count])

    def _stored(self, job: DecodeJob, blocks: Sequence[PersistedBlock], stored: int) -> None:
        """A persist of `blocks` ended with its first `stored` ones in the store."""
        job.stored.update(block.key for block in blocks[:stored])
        self.stats.persisted_blocks += stored
        if stored < len(blocks):
            job.refused = True

    def abandon(self, job: DecodeJob) -> None:
        """The job failed and its transfers ended (the caller waited for them): its blocks in
        flight leave the budget, and nothing more of it is persisted."""
        self._in_flight -= sum(len(blocks) for _, blocks in job.persists)
        job.persists, job.queued, job.extent_persist = [], deque(), None

    def _prompt_digest(self, job: DecodeJob, block: int) -> int | None:
        """The digest of a computed prompt block, from the prefill engine's per-token digests
        of the KV it computed (which the load into this engine's pages was checked against);
        None when runtime.kv_digests is off or the handoff carries none (oracle mode)."""
        assert job.handoff is not None
        digests = job.handoff.digests
        size = self.layout.block_size
        if not self.settings.kv_digests or digests is None or digests.shape[1] < (block + 1) * size:
            return None
        return persist_digest(digests[:, block * size : (block + 1) * size])

    def _next_key(self, job: DecodeJob, block: int, digest: int | None = None) -> PersistedBlock:
        assert job.handoff is not None
        size = self.layout.block_size
        key = next_block_key(job.parent_key, job.tokens[block * size : (block + 1) * size], job.handoff.task.request.namespace)
        persisted = PersistedBlock(key, job.parent_key, digest)
        job.parent_key = key
        job.chain.append(persisted)
        return persisted

    def _oracle_write(self, job: DecodeJob, page: torch.Tensor, persisted: PersistedBlock) -> None:
        assert self.store is not None
        if job.refused:
            return
        try:
            self.store.put(persisted.key, page.cpu() if page.device.type != "cpu" else page, parent=persisted.parent)
        except OSError as exc:  # refused as a reader's write is: the turn goes on unpublished from here
            self.oracle_refusals.refused(persisted.key, exc)
            self._stored(job, (persisted,), 0)
            return
        self.oracle_refusals.succeeded()
        self._stored(job, (persisted,), 1)
