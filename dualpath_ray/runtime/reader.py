"""StorageReader: one per node. Owns the node's host staging buffer and its storage NIC.

Every byte between the store and a node passes through its reader: reads of hit Full Blocks
into buffer extents, and writes of persisted blocks out of it. Engines move Layer Blocks into
and out of the buffer through the transport: the reader offers views of an extent for a pull,
or pulls an engine's offered KV into an extent. The read queue it reports (`read_q`) is the
number of hit tokens whose blocks are waiting for, or being read through, the SNIC.
"""

from __future__ import annotations

import threading
import time

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout, block_segments
from dualpath_ray.kv.pool import BufferPool, Extent
from dualpath_ray.kv.store import open_store
from dualpath_ray.runtime.emulation import make_link
from dualpath_ray.runtime.messages import NodeCounters, PersistedBlock
from dualpath_ray.runtime.transport import (
    TransferTicket,
    TransportEndpoint,
    endpoint_actor_options,
    make_transport,
)


class ReaderCore:
    """The reader's logic, independent of Ray so the tests and the actor share it."""

    def __init__(self, cfg: DualPathConfig, node_id: str, store_root: str | None) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        self.pool = BufferPool(cfg.cluster.buffer_blocks_per_node, self.layout)
        self.snic = make_link(cfg, f"snic/{node_id}", cfg.cluster.snic_gbps)
        self.counters = NodeCounters()
        self._read_q_tokens = 0
        self._extents: dict[int, Extent] = {}
        self._cond = threading.Condition()

    # --- extents ------------------------------------------------------------------------

    def lease(self, owner: str, n_blocks: int, timeout_s: float = 120.0) -> Extent:
        """Lease n_blocks slots, waiting while the pool is full (back-pressure, not failure)."""
        if n_blocks < 1:
            raise ValueError(f"request {owner}: an extent needs at least one block")
        if n_blocks > self.pool.capacity:
            raise ValueError(
                f"request {owner} needs {n_blocks} buffer blocks but node {self.node_id} has "
                f"{self.pool.capacity}; raise cluster.buffer_blocks_per_node"
            )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (extent := self.pool.lease(owner, n_blocks)) is None:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"node {self.node_id}: no {n_blocks} free buffer blocks in {timeout_s}s")
            self._extents[extent.extent_id] = extent
            return extent

    def free(self, extent_id: int) -> None:
        with self._cond:
            self._extents.pop(extent_id)
            self.pool.release(extent_id)
            self._cond.notify_all()

    def token_views(self, extent_id: int, layer: int, start: int, end: int) -> list[torch.Tensor]:
        """Views [n, bpt] of tokens [start, end) of one layer, one per block they touch."""
        extent = self._extents[extent_id]
        return [
            self.pool.full_block(extent.slots[block])[layer, lo:hi]
            for block, lo, hi in block_segments(start, end, self.layout.block_size)
        ]

    # --- storage I/O --------------------------------------------------------------------

    def read_blocks(self, owner: str, keys: list[str], total_blocks: int, path: str) -> int:
        """Lease an extent of total_blocks and read the hit blocks `keys` into its first slots.

        One store read of all hit blocks (the store overlaps them on its helper threads); the
        SNIC bucket is taken per block just before that block's read, and each block leaves the
        read queue (and enters the SNIC read counter) once it is verified. On a failure the
        extent is freed and the queue drops every block that was not read.
        """
        block_bytes = self.layout.full_block_bytes
        block_tokens = self.layout.block_size
        pending = len(keys) * block_tokens
        with self._cond:
            self._read_q_tokens += pending

        def before_read(_: int) -> None:
            self.snic.take(block_bytes)

        def on_verified(_: int) -> None:
            nonlocal pending
            with self._cond:
                self.counters.snic_read[path] += block_bytes
                self._read_q_tokens -= block_tokens
                pending -= block_tokens

        try:
            extent = self.lease(owner, total_blocks)
            try:
                outs = [self.pool.full_block(slot) for slot in extent.slots[: len(keys)]]
                self.store.get_many_into(keys, outs, before_read=before_read, on_verified=on_verified)
            except BaseException:
                self.free(extent.extent_id)
                raise
            return extent.extent_id
        finally:
            with self._cond:
                self._read_q_tokens -= pending

    def read_q(self) -> int:
        with self._cond:
            return self._read_q_tokens

    def write_block(self, block: PersistedBlock, data: torch.Tensor) -> bool:
        """Persist one Full Block (already in this node's buffer) through the SNIC."""
        self.snic.take(self.layout.full_block_bytes)
        written = self.store.put(block.key, data, parent=block.parent)
        with self._cond:
            self.counters.snic_write += self.layout.full_block_bytes
        return written


# "io" methods may wait for free buffer blocks; everything that frees blocks or moves bytes out
# of an extent runs on "ctl", so a full pool can always drain.
@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"io": 16, "ctl": 8}))
class StorageReader(TransportEndpoint):
    """The per-node reader actor (`reader/<node>`): a thin shell around ReaderCore."""

    def __init__(self, cfg: DualPathConfig, node_id: str, store_root: str | None, endpoint: str) -> None:
        torch.set_num_threads(1)
        self.core = ReaderCore(cfg, node_id, store_root)
        self.transport = self.attach_transport(
            make_transport(cfg.runtime.transport, endpoint, namespace=cfg.runtime.namespace)
        )
        self.transport.register(self.core.pool.buffer)
        self.offered: dict[str, int] = {}

    def node_labels(self) -> dict[str, str]:
        return dict(ray.get_runtime_context().get_node_labels())

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="io")
    def read_blocks(self, owner: str, keys: list[str], total_blocks: int, path: str) -> int:
        return self.core.read_blocks(owner, keys, total_blocks, path)

    @ray.method(concurrency_group="io")
    def lease(self, owner: str, n_blocks: int) -> int:
        return self.core.lease(owner, n_blocks).extent_id

    @ray.method(concurrency_group="ctl")
    def free(self, extent_id: int) -> None:
        self.core.free(extent_id)

    @ray.method(concurrency_group="ctl")
    def offer(self, extent_id: int, layer: int, start: int, end: int, path: str) -> TransferTicket:
        """Offer tokens [start, end) of one layer of an extent for a pull by an engine."""
        views = self.core.token_views(extent_id, layer, start, end)
        self.core.pool.begin_transfer(extent_id)
        ticket = self.transport.offer(views)
        self.offered[ticket.transfer_id] = extent_id
        self.core.counters.cnic_out[path] += ticket.nbytes
        return ticket

    @ray.method(concurrency_group="ctl")
    def release(self, ticket: TransferTicket) -> None:
        self.transport.release(ticket)
        self.core.pool.end_transfer(self.offered.pop(ticket.transfer_id))

    @ray.method(concurrency_group="ctl")
    def receive(self, extent_id: int, layer: int, start: int, ticket: TransferTicket, path: str) -> int:
        """Pull an engine's offered KV of tokens [start, start + n) of one layer into an extent."""
        tokens = sum(shape[0] for shape in ticket.shapes)
        views = self.core.token_views(extent_id, layer, start, start + tokens)
        self.core.pool.begin_transfer(extent_id)
        try:
            moved = self.transport.pull(ticket, views)
        finally:
            self.core.pool.end_transfer(extent_id)
        self.core.counters.cnic_in[path] += moved
        return moved

    @ray.method(concurrency_group="io")
    def persist(self, owner: str, block: PersistedBlock, ticket: TransferTicket) -> bool:
        """D2H of one Full Block from a decode engine into a buffer slot, then the SNIC write."""
        extent = self.core.lease(owner, 1)
        try:
            full = self.core.pool.full_block(extent.slots[0])
            self.transport.pull(ticket, [full])
            return self.core.write_block(block, full)
        finally:
            self.core.free(extent.extent_id)

    @ray.method(concurrency_group="ctl")
    def read_q(self) -> int:
        return self.core.read_q()

    @ray.method(concurrency_group="ctl")
    def counters(self) -> NodeCounters:
        return self.core.counters

    @ray.method(concurrency_group="ctl")
    def pool_integrity(self) -> tuple[int, int, int, int]:
        counts = self.core.pool.check_integrity()
        return (counts.free, counts.leased, counts.in_flight, counts.capacity)
