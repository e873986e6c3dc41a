"""StorageReader: one per node. Owns the node's host staging buffer and its storage NIC.

Every byte between the store and a node passes through its reader: reads of hit Full Blocks
into buffer extents, and writes of persisted blocks out of it. Engines move Layer Blocks into
and out of the buffer themselves, with one-sided transport reads and writes of its registered
pool ("buffer"), so the reader is not on that path at all; it only leases extents and frees
them when their owner says so, which is what keeps a slot from being reused under a transfer.
The logic (extents, the read queue it reports, reads and persists) is ReaderCore's
(runtime/reader/core.py); this module builds it from the config (`build_core`) and serves it
as a Ray actor with a transport, metrics and the read-queue reporter.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultCount, FaultInjector
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.kv.store import open_store
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.names import Pool
from dualpath_ray.protocol.names import reader_name
from dualpath_ray.runtime.telemetry.actor_metrics import ReaderMetrics
from dualpath_ray.runtime.telemetry.node_setup import NodeSetup
from dualpath_ray.runtime.emulation import make_link
from dualpath_ray.runtime.engine.directory import ActorDirectory
from dualpath_ray.protocol.messages import ExtentGrant, PersistedBlock, ReaderReport, StagedRead
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.reader.core import ReaderCore, ReaderSettings
from dualpath_ray.runtime.reader.expiry_timer import ExpiryTimer
from dualpath_ray.runtime.reader.page_pulls import pull_moves, settle_pulled
from dualpath_ray.runtime.reader.stage_queue import StageQueue
from dualpath_ray.kv.staged import StagingCounts
from dualpath_ray.scheduling.staging import StageOrder
from dualpath_ray.runtime.reader.queue_reporter import QueueReporter
from dualpath_ray.runtime.engine.ray_ports import scheduler_channel
from dualpath_ray.runtime.reporting.client import ReportClient
from dualpath_ray.runtime.placement.qos import kv_transport_knobs
from dualpath_ray.runtime.restarts.incarnations import TransportKeeper, was_restarted
from dualpath_ray.runtime.transport.moves import PeerDiedError
from dualpath_ray.runtime.transport.endpoint import TransportEndpoint, endpoint_actor_options
from dualpath_ray.runtime.transport.factory import make_transport


LOG = logging.getLogger("dualpath_ray.reader")


def build_core(
    cfg: DualPathConfig, node_id: str, store_root: str | None, incarnation: str = "", restarted: bool = False
) -> ReaderCore:
    """Node `node_id`'s reader core as the config describes it: its store (at `store_root` if
    given), the two directions of its SNIC and its fault injector (`reader/<node>`; a restarted
    process's has no kill left to fire). The actor's only source of a core; the in-process
    harness (tests/engine_harness.py) uses it too, so both run the same wiring."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    settings = ReaderSettings(
        node_id=node_id,
        buffer_blocks=cfg.cluster.buffer_blocks_per_node,
        # Longer than a transfer's timeout: a full pool drains as the transfers holding it end or time out.
        lease_timeout_s=cfg.runtime.transfer_timeout_s * 2,
        kv_digests=cfg.runtime.kv_digests,
        stale_temporary_s=cfg.store.stale_temporary_s,
        pin_host_buffers=cfg.cluster.pin_host_buffers,
        incarnation=incarnation,
        stage_buffer_fraction=cfg.scheduler.stage_buffer_fraction,
        hot_blocks=cfg.scheduler.share_buffer_blocks if cfg.scheduler.share_in_flight else 0,
    )
    # cluster.snic_gbps is per direction: the NIC is full duplex.
    links = (
        make_link(cfg, f"snic-read/{node_id}", cfg.cluster.snic_gbps),
        make_link(cfg, f"snic-write/{node_id}", cfg.cluster.snic_gbps),
    )
    store = open_store(cfg.store, layout, root=store_root)
    return ReaderCore(settings, layout, store, links, FaultInjector(cfg.faults, reader_name(node_id), restarted))


# "io" methods may wait for free buffer blocks or the SNIC; freeing runs on "ctl", so a full
# pool can always drain. Staging orders are queued on arrival (runtime/reader/stage_queue.py) and
# read by one thread of their own, one at a time: they wait while real reads are active, and on
# "io" threads that wait would keep real reads from starting.
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
        self.core = build_core(cfg, node_id, store_root, self.incarnation, restarted)
        self.emulated = cfg.emulation.active()
        self.transport.register(Pool.BUFFER, self.core.pool.buffer)
        self.transport.seal()
        self.metrics = ReaderMetrics.start(cfg, self.core)
        # Staged extents are freed at their deadlines (receipt + ttl_s) on this process's
        # monotonic clock, which the stage queue stamps orders with on arrival: no polling while
        # none is staged.
        self.clock = time.monotonic
        self.expiry = ExpiryTimer(self.core.expire, self.clock)
        self.core.stager.on_deadline = self.expiry.scheduled
        # Orders wait here for the staging thread, bounded, timed from their arrival.
        self.stage_queue = StageQueue(max(1, self.core.settings.stage_cap_blocks), self.clock, self.core.stager.dropped)
        self.stager = threading.Thread(target=self._stage_orders, name=f"stage-{endpoint}", daemon=True)
        self.stager.start()
        # The scheduler learns this node's read queue from here, when it changes (and this
        # incarnation at once: a new one tells it the old process and its extents are gone).
        self.reporter = QueueReporter(
            self.core.read_q, self._send_report, cfg.scheduler.report_interval_ms / 1000.0, name=f"queue-{endpoint}"
        )
        self.core.on_read_q = self.reporter.changed
        self.directory = ActorDirectory(cfg.runtime.namespace)
        self.reports = ReportClient(scheduler_channel(self.directory), name=f"{endpoint}-reports")
        self.keeper = TransportKeeper(self.transport, cfg.runtime.namespace, cfg.runtime.request_timeout_s)
        if restarted:
            # A new gloo world once this __init__ returned (the join needs it to serve). The
            # scheduler learns this incarnation (its first report, a heartbeat answer) only then:
            # one it knew earlier was given reads its peers could not yet move, each failing at
            # once until the attempts ran out. Until then it is only silent: routed around.
            self.keeper.rejoin_then(self.reporter.start)
        else:
            self.reporter.start()

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
    def read_hits(
        self, owner: str, keys: list[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> ExtentGrant:
        with self.metrics.kv_load(path, len(keys)):
            return self.core.read_hits(owner, keys, total_blocks, path, self.name, first_block, staged)

    @ray.method(concurrency_group="ctl")
    def stage_ahead(self, orders: list[StageOrder]) -> None:
        """Queue tool-time staging orders (scheduling/staging.py), read ahead one after another
        behind every real read; each lives until its arrival here + its ttl_s, waiting or held."""
        self.stage_queue.submit(orders)

    def _stage_orders(self) -> None:
        """The staging thread: the queue's orders, oldest first, each read by the core."""
        while (queued := self.stage_queue.take()) is not None:
            try:
                self.core.stage_ahead(queued.order, queued.received)
            except Exception:  # noqa: BLE001 - one order's failure must not stop staging
                LOG.exception("%s: staging order %s failed", self.name, queued.order.stage_id)

    @ray.method(concurrency_group="ctl")
    def staging_counts(self) -> StagingCounts:
        """Staged blocks by outcome: staged, used, expired, cancelled, skipped, failed, missed."""
        return self.core.staging_counts()

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
        """Write blocks from an extent, then free it; returns how many leading blocks are stored
        (fewer than asked when the store refused one: ReaderCore.write_blocks)."""
        if self._stale(incarnation):
            raise PeerDiedError(f"{self.name} restarted: extent {extent_id} of its dead incarnation is gone")
        return self.core.write_extent(extent_id, blocks, on_hot=self._prompt_on_node)

    def _prompt_on_node(self, owner: str) -> None:
        """An attempt's computed prompt blocks are held in this node's memory (hot_blocks.py):
        the scheduler publishes them now (in-flight sharing), before they are written. Sent after
        they are held, so a read the scheduler places on hearing it finds them here."""
        self.reports.send(ReaderReport(self.core.node_id, self.name, self.incarnation, self.core.read_q(), (owner,)))

    @ray.method(concurrency_group="io")
    def persist_pages(
        self, owner: str, engine: str, blocks: list[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> int:
        """D2H: pull whole pages of a decode engine's KV into a leased extent, then write them;
        returns how many leading blocks are stored (ReaderCore.write_blocks). `paged`: the
        pages are a compute's own (vLLM's), pulled run by run and made token-major in the
        slots (page_pulls.py); None: Full Block pages of the engine's Pool.HBM."""
        layout = self.core.layout
        extent = self.core.lease(owner, len(blocks))
        self.core.begin_write(extent.extent_id)  # reclaim must not free it under the D2H
        moves = pull_moves(extent.slots, [page for page, _ in blocks], layout.full_block_bytes, paged)
        try:
            self.transport.read(engine, moves).wait(self.timeout_s)
            slots = [self.core.pool.full_block(slot) for slot in extent.slots]
            settle_pulled(slots, paged)
            return self.core.write_blocks([(data, block) for data, (_, block) in zip(slots, blocks)])
        finally:
            self.core.end_write(extent.extent_id)

    @ray.method(concurrency_group="ctl")
    def hot_counts(self) -> dict[str, int]:
        """The hot tier's blocks held now, ever held, served instead of a store read, and persists
        not held (runtime/reader/hot_blocks.py); empty without one."""
        return self.core.hot.counts() if self.core.hot is not None else {}

    @ray.method(concurrency_group="ctl")
    def read_q(self) -> int:
        return self.core.read_q()

    @ray.method(concurrency_group="ctl")
    def queue_report(self) -> tuple[str, int]:
        """(this process's incarnation, read_q): the scheduler's heartbeat to a reader of a node in
        use. Refused while a restarted reader rejoins the transport (the scheduler takes it for
        silent, not yet for its new incarnation)."""
        self.keeper.require_joined()
        return self.incarnation, self.core.read_q()

    @ray.method(concurrency_group="ctl")
    def fault_counts(self) -> dict[str, FaultCount]:
        return self.core.fault_counts()

    @ray.method(concurrency_group="ctl")
    def integrity_keys(self) -> tuple[list[str], list[str]]:
        """(keys this reader damaged by the fault plan, keys it found corrupt at read)."""
        return self.core.integrity_keys()

    @ray.method(concurrency_group="ctl")
    def store_faults(self) -> tuple[list[str], int]:
        """(keys of hit blocks the store could not read, block writes the store refused)."""
        return self.core.store_faults()

    @ray.method(concurrency_group="ctl")
    def persist_mismatches(self) -> int:
        """Blocks not published because the bytes the store wrote failed their engine's digest."""
        return self.core.persist_mismatches

    @ray.method(concurrency_group="ctl")
    def retired_reads(self) -> int:
        """Store reads stopped because their extent was freed or reclaimed while they ran."""
        return self.core.retired_reads

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

    @ray.method(concurrency_group="ctl")
    def pool_holders(self) -> dict[str, int]:
        """Owner -> blocks it holds in this node's buffer (what a pool not free is held by)."""
        return self.core.pool.holders()

    @ray.method(concurrency_group="ctl")
    def node_setup(self) -> NodeSetup:
        """How this node's hardware is used (`dualpath status`): whether the staging buffer is
        pinned and why (not), and whether its SNIC is emulated (token buckets)."""
        pinning = self.core.pool.pinning
        return NodeSetup(pinning.pinned, pinning.detail, self.emulated)

