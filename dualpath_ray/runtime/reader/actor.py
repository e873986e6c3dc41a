"""StorageReader: one per node. Owns the node's host staging buffer and its storage NIC.

Every byte between the store and a node passes through its reader: reads of hit Full Blocks
into buffer extents, and writes of persisted blocks out of it. Engines move Layer Blocks into
and out of the buffer themselves, with one-sided transport reads and writes of its registered
pool ("buffer"), so the reader is not on that path at all; it only leases extents and frees
them when their owner says so, which is what keeps a slot from being reused under a transfer.
The read queue it reports (`read_q`) is the number of hit tokens whose blocks are waiting for,
or being read through, the SNIC. A PE-path read counts from the moment it is asked, while it
waits for its extent too: that extent is a cost of the PE path alone. A DE-path read counts only
once its extent is leased: every request leases that decode-node extent whichever path reads its
hits (the KV it sends lands there), so waiting for it says nothing about which side should read,
and counting it made congested decode buffers push reads onto the prefill nodes' SNICs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultCount, FaultInjector, InjectedFault
from dualpath_ray.faults.plan import FaultMode, FaultSite
from dualpath_ray.faults.store import damage_stored_block
from dualpath_ray.kv.digest import block_digests
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool, Extent, ExtentState
from dualpath_ray.kv.errors import BadBlockError, BlockCorruptedError, BlockNotFoundError
from dualpath_ray.kv.store import open_store
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.telemetry.actor_metrics import ReaderMetrics
from dualpath_ray.runtime.emulation import FifoTurns, make_link
from dualpath_ray.runtime.engine.directory import ActorDirectory
from dualpath_ray.protocol.messages import ExtentGrant, PersistedBlock, ReaderReport
from dualpath_ray.runtime.reader.queue_reporter import QueueReporter
from dualpath_ray.runtime.engine.ray_ports import scheduler_channel
from dualpath_ray.runtime.control.report_channel import ReportClient
from dualpath_ray.runtime.deploy.qos import kv_transport_knobs
from dualpath_ray.runtime.engine.restarts import TransportKeeper, was_restarted
from dualpath_ray.runtime.transport.base import (
    PeerDiedError,
    Region,
    TransportEndpoint,
    endpoint_actor_options,
    make_transport,
)

BUFFER_POOL = "buffer"
HBM_POOL = "hbm"


class ReaderCore:
    """The reader's logic, independent of Ray so the tests and the actor share it."""

    def __init__(
        self, cfg: DualPathConfig, node_id: str, store_root: str | None, incarnation: str = "", restarted: bool = False
    ) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.incarnation = incarnation
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        # A writer that crashed between write and publish left a temporary no reader will ever
        # see (publish is an atomic rename); sweep those once at start so they do not pile up.
        self.swept_temporaries = self.store.remove_stale_temporaries(cfg.store.stale_temporary_s)
        self.pool = BufferPool(cfg.cluster.buffer_blocks_per_node, self.layout, pin=cfg.cluster.pin_host_buffers)
        # A NIC is full duplex: persists (NIC transmit) never slow hit-KV reads (NIC receive),
        # as the paper counts CNIC read and write separately. cluster.snic_gbps is per direction.
        self.snic_read = make_link(cfg, f"snic-read/{node_id}", cfg.cluster.snic_gbps)
        self.snic_write = make_link(cfg, f"snic-write/{node_id}", cfg.cluster.snic_gbps)
        self.lease_timeout_s = cfg.runtime.transfer_timeout_s * 2
        self.counters = NodeCounters()
        self.faults = FaultInjector(cfg.faults, f"reader/{node_id}", restarted)
        # Keys whose stored block this reader damaged (fault plan) and keys it found corrupt:
        # a chaos test proves every damage was caught by comparing the two.
        self.damaged_keys: set[str] = set()
        self.corrupt_keys: set[str] = set()
        self._read_q_tokens = 0
        # Called (under this core's lock) whenever the read queue changed: the actor's reporter.
        self.on_read_q: Callable[[], None] = lambda: None
        self._extents: dict[int, Extent] = {}
        self._cond = threading.Condition()

    # --- extents ------------------------------------------------------------------------

    def lease(self, owner: str, n_blocks: int) -> Extent:
        """Lease n_blocks slots, waiting while the pool is full (back-pressure, not failure)."""
        if n_blocks < 1:
            raise ValueError(f"request {owner}: an extent needs at least one block")
        if n_blocks > self.pool.capacity:
            raise ValueError(
                f"request {owner} needs {n_blocks} buffer blocks but node {self.node_id} has "
                f"{self.pool.capacity}; raise cluster.buffer_blocks_per_node"
            )
        deadline = time.monotonic() + self.lease_timeout_s
        with self._cond:
            while (extent := self.pool.lease(owner, n_blocks)) is None:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(
                        f"node {self.node_id}: no {n_blocks} free buffer blocks in {self.lease_timeout_s}s"
                    )
            self._extents[extent.extent_id] = extent
            return extent

    def free(self, extent_id: int) -> None:
        """Give an extent back. Freeing one already reclaimed is a no-op: extent ids are never
        reused, so a late free can only name that extent, never another lease. One being
        written to the store is freed by that write when it ends."""
        with self._cond:
            if extent_id not in self._extents or self.pool.state_of(extent_id) is ExtentState.IN_FLIGHT:
                return
            del self._extents[extent_id]
            self.pool.release(extent_id)
            self._cond.notify_all()

    def begin_write(self, extent_id: int) -> Extent:
        """The extent is a store write's source from now on: reclaim and free leave it alone."""
        with self._cond:
            extent = self._extents[extent_id]
            self.pool.begin_transfer(extent_id)
            return extent

    def end_write(self, extent_id: int) -> None:
        with self._cond:
            self.pool.end_transfer(extent_id)
        self.free(extent_id)

    def reclaim(self, owner: str) -> int:
        """Free the extents leased to one attempt whose engine died (the scheduler knows it did);
        returns how many. One in a transfer is left to that transfer's own end."""
        freed = 0
        with self._cond:
            for extent_id, extent in list(self._extents.items()):
                if extent.owner == owner and self.pool.state_of(extent_id) is ExtentState.LEASED:
                    del self._extents[extent_id]
                    self.pool.release(extent_id)
                    freed += 1
            self._cond.notify_all()
        return freed

    def grant(self, extent: Extent, reader: str) -> ExtentGrant:
        return ExtentGrant(self.node_id, reader, extent.extent_id, extent.slots, incarnation=self.incarnation)

    def stage(
        self, owner: str, keys: Sequence[str], total_blocks: int, path: str, reader: str, first_block: int = 0
    ) -> ExtentGrant:
        """read_blocks, granted with the digests of the verified hit KV (runtime.kv_digests)."""
        extent = self.read_blocks(owner, keys, total_blocks, path, first_block)
        digests = None
        if self.cfg.runtime.kv_digests and keys:
            hits = torch.stack([self.pool.full_block(slot) for slot in extent.slots[first_block : first_block + len(keys)]])
            digests = block_digests(hits, len(keys) * self.layout.block_size)
        return ExtentGrant(self.node_id, reader, extent.extent_id, extent.slots, digests, self.incarnation)

    # --- storage I/O --------------------------------------------------------------------

    def read_blocks(self, owner: str, keys: Sequence[str], total_blocks: int, path: str, first_block: int = 0) -> Extent:
        """Lease an extent of total_blocks and read the hit blocks `keys` into its slots from
        `first_block` on (the prompt's block positions; a split read's decode side starts past
        the blocks the prefill side reads).

        One store read of all hit blocks (the store overlaps them on its helper threads); the
        SNIC bucket is taken per block just before that block's read, and each block leaves the
        read queue (and enters the SNIC read counter) once it is verified. On a failure the
        extent is freed and the queue drops every block that was not read.
        """
        if first_block < 0 or first_block + len(keys) > total_blocks:
            raise ValueError(
                f"request {owner}: blocks [{first_block}, {first_block + len(keys)}) do not fit an extent of {total_blocks}"
            )
        block_bytes = self.layout.full_block_bytes
        block_tokens = self.layout.block_size
        pending = len(keys) * block_tokens
        verified = 0
        queued = False  # whether pending is in the read queue yet (see the module doc)

        def enqueue() -> None:
            nonlocal queued
            with self._cond:
                self._read_q_tokens += pending
                self.on_read_q()
            queued = True

        if path != "de":
            enqueue()

        turn = _ReadTurn(self.snic_read.turns if keys else None, len(keys))

        def before_read(index: int) -> None:
            if self.faults.active:
                self._store_read_fault(keys[index])
            self.snic_read.take(block_bytes)
            turn.took_one()

        def on_verified(_: int) -> None:
            nonlocal pending, verified
            verified += 1
            with self._cond:
                self.counters.snic_read[path] += block_bytes
                self._read_q_tokens -= block_tokens
                pending -= block_tokens
                self.on_read_q()

        try:
            extent = self.lease(owner, total_blocks)
            if not queued:
                enqueue()
            try:
                outs = [self.pool.full_block(slot) for slot in extent.slots[first_block : first_block + len(keys)]]
                turn.begin()
                self.store.get_many_into(list(keys), outs, before_read=before_read, on_verified=on_verified)
            except (BlockNotFoundError, BlockCorruptedError) as exc:
                # The store raises for the first bad block in key order, the one after the
                # verified ones: name it, so the scheduler repairs that block and no other.
                self.free(extent.extent_id)
                kind = "missing" if isinstance(exc, BlockNotFoundError) else "corrupt"
                if kind == "corrupt":
                    with self._cond:
                        self.corrupt_keys.add(keys[verified])
                raise BadBlockError(kind, keys[verified], str(exc)) from None
            except BaseException:
                self.free(extent.extent_id)
                raise
            return extent
        finally:
            turn.end()
            if queued and pending:
                with self._cond:
                    self._read_q_tokens -= pending
                    self.on_read_q()

    def _store_read_fault(self, key: str) -> None:
        spec = self.faults.decide(FaultSite.STORE_READ)
        if spec is None:
            return
        if spec.mode is FaultMode.FAIL:
            raise InjectedFault("store_read", f"I/O error reading block {key}")
        if damage_stored_block(self.store, key, self.faults.corruption_rng):
            with self._cond:
                self.damaged_keys.add(key)

    def read_q(self) -> int:
        with self._cond:
            return self._read_q_tokens

    def fault_counts(self) -> dict[str, FaultCount]:
        return self.faults.counts()

    def integrity_keys(self) -> tuple[list[str], list[str]]:
        with self._cond:
            return sorted(self.damaged_keys), sorted(self.corrupt_keys)

    def write_block(self, block: PersistedBlock, data: torch.Tensor) -> bool:
        """Persist one Full Block (already in this node's buffer) through the SNIC."""
        self.snic_write.take(self.layout.full_block_bytes)
        spec = self.faults.decide(FaultSite.STORE_PUBLISH) if self.faults.active else None
        if spec is not None and spec.mode is FaultMode.FAIL:
            raise InjectedFault("store_publish", f"I/O error writing block {block.key}")
        if spec is not None and spec.mode is FaultMode.DROP:
            return True  # a lost write that claims success: a later read of it is a miss
        written = self.store.put(block.key, data, parent=block.parent)
        with self._cond:
            self.counters.snic_write += self.layout.full_block_bytes
        return written

    def write_extent(self, extent_id: int, blocks: Sequence[tuple[int, PersistedBlock]]) -> int:
        """Write blocks (index in the extent, key) from an extent, then free it in any case."""
        extent = self.begin_write(extent_id)
        try:
            return sum(self.write_block(block, self.pool.full_block(extent.slots[index])) for index, block in blocks)
        finally:
            self.end_write(extent_id)


# "io" methods may wait for free buffer blocks or the SNIC; freeing runs on "ctl", so a full
# pool can always drain.
@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"io": 16, "ctl": 8}))
class StorageReader(TransportEndpoint):
    """The per-node reader actor (`reader/<node>`): a thin shell around ReaderCore."""

    def __init__(self, cfg: DualPathConfig, node_id: str, store_root: str | None, endpoint: str) -> None:
        torch.set_num_threads(1)
        self.name = endpoint
        self.timeout_s = cfg.runtime.transfer_timeout_s
        self.transport = self.attach_transport(
            make_transport(
                cfg.runtime.transport, endpoint, namespace=cfg.runtime.namespace, timeout_s=self.timeout_s,
                verbs_settings=cfg.verbs, verbs_device=cfg.verbs.device_for(None), **kv_transport_knobs(cfg.qos),
            )
        )
        self.incarnation = self.transport.incarnation
        restarted = was_restarted()
        self.core = ReaderCore(cfg, node_id, store_root, self.incarnation, restarted)
        self.transport.register(BUFFER_POOL, self.core.pool.buffer)
        self.transport.seal()
        self.metrics = ReaderMetrics.start(cfg, self.core)
        # The scheduler learns this node's read queue from here, when it changes (and this
        # incarnation at once: a new one tells it the old process and its extents are gone).
        self.reporter = QueueReporter(
            self.core.read_q, self._send_report, cfg.scheduler.report_interval_ms / 1000.0, name=f"queue-{endpoint}"
        )
        self.core.on_read_q = self.reporter.changed
        self.directory = ActorDirectory(cfg.runtime.namespace)
        self.reports = ReportClient(scheduler_channel(self.directory), name=f"{endpoint}-reports")
        self.reporter.start()
        self.keeper = TransportKeeper(self.transport, cfg.runtime.namespace, cfg.runtime.request_timeout_s)
        if restarted:
            self.keeper.heal()  # a new gloo world once this __init__ returned (the join needs it to serve)

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return getattr(self, "name", type(self).__name__)

    def _send_report(self, read_q: int) -> None:
        report = ReaderReport(self.core.node_id, self.name, self.incarnation, read_q)
        self.reports.send(report)

    def node_labels(self) -> dict[str, str]:
        return dict(ray.get_runtime_context().get_node_labels())

    @ray.method(concurrency_group="ctl")
    def env(self, keys: list[str]) -> dict[str, str | None]:
        """These variables of this process's environment (None: unset), e.g. to check the
        traffic classes its runtime_env gave it."""
        return {key: os.environ.get(key) for key in keys}

    def ready(self) -> bool:
        return True

    def _stale(self, incarnation: str) -> bool:
        """Whether a message names an extent of another (dead) incarnation of this reader."""
        return bool(incarnation) and incarnation != self.incarnation

    @ray.method(concurrency_group="io")
    def stage(self, owner: str, keys: list[str], total_blocks: int, path: str, first_block: int = 0) -> ExtentGrant:
        with self.metrics.kv_load(path, len(keys)):
            return self.core.stage(owner, keys, total_blocks, path, self.name, first_block)

    @ray.method(concurrency_group="io")
    def lease(self, owner: str, n_blocks: int) -> ExtentGrant:
        return self.core.grant(self.core.lease(owner, n_blocks), self.name)

    @ray.method(concurrency_group="ctl")
    def free(self, extent_id: int, incarnation: str = "") -> None:
        if not self._stale(incarnation):
            self.core.free(extent_id)

    @ray.method(concurrency_group="ctl")
    def forget_peers(self) -> None:
        """An engine woke with new memory addresses: fetch every peer's addressing again."""
        self.transport.forget_peers()

    @ray.method(concurrency_group="ctl")
    def reclaim(self, owner: str) -> int:
        return self.core.reclaim(owner)

    @ray.method(concurrency_group="io")
    def persist_extent(self, extent_id: int, blocks: list[tuple[int, PersistedBlock]], incarnation: str = "") -> int:
        if self._stale(incarnation):
            raise PeerDiedError(f"{self.name} restarted: extent {extent_id} of its dead incarnation is gone")
        return self.core.write_extent(extent_id, blocks)

    @ray.method(concurrency_group="io")
    def persist_pages(self, owner: str, engine: str, blocks: list[tuple[int, PersistedBlock]]) -> int:
        """D2H: pull whole pages of a decode engine's HBM into a leased extent, then write them."""
        layout = self.core.layout
        extent = self.core.lease(owner, len(blocks))
        self.core.begin_write(extent.extent_id)  # reclaim must not free it under the D2H
        moves = [
            (Region(BUFFER_POOL, slot * layout.full_block_bytes, layout.full_block_bytes),
             Region(HBM_POOL, page * layout.full_block_bytes, layout.full_block_bytes))
            for slot, (page, _) in zip(extent.slots, blocks)
        ]
        try:
            self.transport.read(engine, moves).wait(self.timeout_s)
            return sum(
                self.core.write_block(block, self.core.pool.full_block(slot))
                for slot, (_, block) in zip(extent.slots, blocks)
            )
        finally:
            self.core.end_write(extent.extent_id)

    @ray.method(concurrency_group="ctl")
    def read_q(self) -> int:
        return self.core.read_q()

    @ray.method(concurrency_group="ctl")
    def queue_report(self) -> tuple[str, int]:
        """(this process's incarnation, read_q): the scheduler's heartbeat to a reader of a node in use."""
        return self.incarnation, self.core.read_q()

    @ray.method(concurrency_group="ctl")
    def fault_counts(self) -> dict[str, FaultCount]:
        return self.core.fault_counts()

    @ray.method(concurrency_group="ctl")
    def integrity_keys(self) -> tuple[list[str], list[str]]:
        """(keys this reader damaged by the fault plan, keys it found corrupt at read)."""
        return self.core.integrity_keys()

    @ray.method(concurrency_group="ctl")
    def counters(self) -> NodeCounters:
        return self.core.counters

    @ray.method(concurrency_group="ctl")
    def reports_sent(self) -> int:
        """Read-queue reports this reader sent the scheduler."""
        return self.reporter.sent

    @ray.method(concurrency_group="ctl")
    def pool_integrity(self) -> tuple[int, int, int, int]:
        counts = self.core.pool.check_integrity()
        return (counts.free, counts.leased, counts.in_flight, counts.capacity)


class _ReadTurn:
    """One request's turn on an emulated SNIC (FifoTurns): taken before its first block's bucket
    take, given up once its last block has paid (its reads then finish while the next request's
    are paced) or when the read ends early; a no-op for a real SNIC or a read of no blocks."""

    def __init__(self, turns: FifoTurns | None, blocks: int) -> None:
        self.turns = turns
        self.left = blocks
        self.ticket: int | None = None
        self._lock = threading.Lock()

    def begin(self) -> None:
        if self.turns is not None:
            self.ticket = self.turns.wait_turn()

    def took_one(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.end()

    def end(self) -> None:
        with self._lock:
            ticket, self.ticket = self.ticket, None
        if ticket is not None and self.turns is not None:
            self.turns.done(ticket)
