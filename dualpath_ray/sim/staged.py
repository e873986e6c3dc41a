"""Tool-time staging, the readers' side: staged extents on the decode nodes, read behind real reads.

The scheduler core orders a finished turn's context staged on a decode node when its caller
hints that the session continues (scheduling/staging.py, `SchedulerCore.take_stage_orders`).
Here each decode node's reader acts on its orders as the runtime's reader does, with the rules
and the lifecycle of kv/staged.py that the runtime's reader applies too (`StagedTable`: which
order is skipped, which staged extents a real lease cancels, each extent's moves):

- **Lease without waiting**: the order's blocks are leased in the node's buffer at once
  (`SimBufferPool.try_lease`), or the order is skipped: no room, a real lease waiting, its
  stage_id still live (the live extent holds those blocks and keeps its deadline), or the node's
  staged extents would pass `scheduler.stage_buffer_fraction` of its buffer.
- **Read at low priority**: the blocks are read through the node's SNIC (and its DRAM)
  `options.stage_chunk_blocks` at a time, a chunk only while no real read is queued or in service
  on that SNIC; so a real read that comes waits at most one chunk. Staged reads are not in the
  node's read queue (what its reader reports) and not in the per-path read bytes; they are in
  the SNIC's bytes (`snic_read_bytes`, the balance) and in `SimResult.staging`.
- **Hold until `ttl_s` after receipt**: then the extent is freed (expired). Expiry is applied
  when the reader next looks (an order, a claim, a real lease finding the buffer short, the next
  chunk, the end of the run): nothing but these reads the buffer's free count, so this is the
  same as freeing on time, and keeps the event loop's clock at the last real event.
- **Cancelled for real leases**: a real lease that has to wait cancels the oldest unclaimed
  staged extents first, until every waiter fits (`SimBufferPool.reclaim`).
- **Claimed by a prefill job** whose task carries `staged` for this node (`claim`, called by
  sim/staging.py's Stager): an extent still held becomes the job's decode-node extent, grown to
  the prompt's blocks; one still reading is promoted (its unread blocks join the job's real DE
  read, no longer behind real reads); one gone (expired, cancelled, skipped) is a miss, and the
  job reads every hit as a normal DE read.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import count

from dualpath_ray.kv.staged import LIVE, StagedExtent, StagedTable, StageEvent, StageState
from dualpath_ray.scheduling.staging import StageOrder
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.nodes import SimNode
from dualpath_ray.sim.settings import SimSettings


@dataclass
class StagingCounters:
    """What the decode nodes' readers did with the core's staging orders (SimResult.staging)."""

    orders: int = 0  # orders the readers received
    ordered_blocks: int = 0
    skipped: int = 0  # not leased: no room, a real lease waiting, or over the staged share
    staged_blocks: int = 0  # blocks read behind real reads
    used: int = 0  # claims that found their extent held (read, or still reading: promoted)
    used_blocks: int = 0  # staged blocks those jobs did not read again as real reads
    promoted: int = 0  # of `used`, the claims that found their extent still reading
    expired: int = 0  # held past ttl_s unclaimed, freed
    cancelled: int = 0  # unclaimed, freed for a real lease that found the buffer short
    missed: int = 0  # claims that found nothing (skipped, expired or cancelled before the job came)


@dataclass(eq=False)
class SimStagedExtent:
    """An order's extent: its entry in the node's `StagedTable` (state, deadline) and how far
    its read has gone on the simulated SNIC."""

    order: StageOrder
    entry: StagedExtent
    issued: int = 0  # blocks handed to the SNIC (read, or in the chunk in service)
    last_done: float = 0.0  # when the last issued chunk is through

    @property
    def blocks(self) -> int:
        return self.order.blocks

    @property
    def expires_at(self) -> float:
        return self.entry.deadline

    @property
    def live(self) -> bool:
        """Reading or held, unclaimed (not once claimed, expired or cancelled)."""
        return self.entry.state in LIVE


@dataclass(eq=False)
class NodeStaging:
    """One decode node's reader: its staged extents, by receipt, and its staged-read state."""

    node: SimNode
    table: StagedTable = field(default_factory=StagedTable)  # the live entries and the blocks they hold
    extents: dict[str, SimStagedExtent] = field(default_factory=dict)  # the table's live entries' reads
    to_read: deque[SimStagedExtent] = field(default_factory=deque)
    expiries: list[tuple[float, int, SimStagedExtent]] = field(default_factory=list)  # heap
    reading: bool = False  # a chunk is in service, or a wake-up is set for when the SNIC is free


class StagedReads:
    """The decode nodes' readers' staging, driven by the scheduler core's orders."""

    def __init__(self, loop: EventLoop, settings: SimSettings, decode_nodes: list[SimNode]) -> None:
        self.loop = loop
        self.settings = settings
        self.counters = StagingCounters()
        self.nodes = {node.node_id: NodeStaging(node) for node in decode_nodes}
        self.limit = int(settings.stage_buffer_fraction * settings.buffer_blocks)
        self.chunk = max(1, settings.options.stage_chunk_blocks)
        self._sequence = count()
        for staging in self.nodes.values():
            staging.node.buffer.reclaim = lambda now, blocks, s=staging: self._reclaim(s, now, blocks)

    # --- orders -----------------------------------------------------------------------------

    def order(self, order: StageOrder, now: float) -> None:
        """The node's reader receives `order`: lease its blocks now or skip it, then read them."""
        counters = self.counters
        counters.orders += 1
        counters.ordered_blocks += order.blocks
        staging = self.nodes.get(order.node_id)
        if staging is None:
            counters.skipped += 1
            return
        self._expire(staging, now)
        refused = staging.table.refuses(order.stage_id, order.blocks, self.limit)
        if refused or not staging.node.buffer.try_lease(order.blocks):
            counters.skipped += 1
            return
        sequence = next(self._sequence)
        entry = StagedExtent(order.stage_id, order.keys, sequence, now + order.ttl_s)
        extent = SimStagedExtent(order, entry, last_done=now)
        staging.table.add(entry)
        staging.extents[order.stage_id] = extent
        heapq.heappush(staging.expiries, (extent.expires_at, sequence, extent))
        staging.to_read.append(extent)
        self._pump(staging)

    # --- reading behind real reads ------------------------------------------------------------

    def _pump(self, staging: NodeStaging) -> None:
        """Issue the next chunk if the SNIC has no real read queued; else wake when it is free."""
        if staging.reading:
            return
        now = self.loop.now
        to_read = staging.to_read
        while to_read:
            head = to_read[0]
            if head.live and now >= head.expires_at:
                self._expire(staging, now)
            if head.live and head.issued < head.blocks:
                break
            if head.entry.state is StageState.READING:
                # Every chunk of it is through (no chunk is in service here): read, now held.
                staging.table.move(head.entry, StageEvent.READ_DONE)
            to_read.popleft()
        if not to_read:
            return
        node = staging.node
        staging.reading = True
        if node.snic_read.busy_until > now:
            self.loop.at(node.snic_read.busy_until, self._wake, staging)
            return
        extent = to_read[0]
        blocks = min(self.chunk, extent.blocks - extent.issued)
        nbytes = blocks * self.settings.block_bytes
        snic_done = node.snic_read.take(now, nbytes)
        done = max(snic_done, node.dram.take(now, nbytes))
        node.snic_windows.add(snic_done, nbytes)
        extent.issued += blocks
        extent.last_done = done
        self.counters.staged_blocks += blocks
        self.loop.at(done, self._wake, staging)

    def _wake(self, staging: NodeStaging) -> None:
        staging.reading = False
        self._pump(staging)

    # --- claims, expiry, cancellation -------------------------------------------------------

    def claim(self, node_id: str, stage_id: str, now: float) -> SimStagedExtent | None:
        """A prefill job's task names the extent staged as `stage_id` on `node_id`: the extent,
        now the job's (its unread blocks are the job's to read, no longer staged), or None."""
        staging = self.nodes.get(node_id)
        if staging is not None:
            self._expire(staging, now)
        extent = staging.extents.pop(stage_id, None) if staging is not None else None
        if staging is None or extent is None or not extent.live:
            self.counters.missed += 1
            return None
        entry = extent.entry
        if entry.state is StageState.HELD:
            staging.table.move(entry, StageEvent.CLAIM)
        else:
            # Still reading: promoted, and the job takes its unread blocks over as its own read,
            # so the staged read is over as the claim takes it.
            staging.table.move(entry, StageEvent.PROMOTE)
            staging.table.move(entry, StageEvent.READ_DONE)
        staging.table.released(entry)  # the job's extent now, no longer the staging's
        counters = self.counters
        counters.used += 1
        counters.used_blocks += extent.issued
        if extent.issued < extent.blocks:
            counters.promoted += 1
        return extent

    def _expire(self, staging: NodeStaging, now: float) -> None:
        expiries = staging.expiries
        while expiries and expiries[0][0] <= now:
            extent = heapq.heappop(expiries)[2]
            if extent.live:
                staging.table.move(extent.entry, StageEvent.EXPIRE)
                self._free(staging, extent, now)
                self.counters.expired += 1

    def _reclaim(self, staging: NodeStaging, now: float, blocks: int) -> None:
        """A real lease waits for `blocks` more: free expired extents, then the oldest unclaimed."""
        self._expire(staging, now)
        for entry in staging.table.victims(blocks):
            staging.table.move(entry, StageEvent.CANCEL)
            self._free(staging, staging.extents[entry.stage_id], now)
            self.counters.cancelled += 1

    def _free(self, staging: NodeStaging, extent: SimStagedExtent, now: float) -> None:
        """Give an ended extent's blocks back (the simulated reader frees at once, even one whose
        chunk is still in service: its SNIC time is spent either way)."""
        staging.extents.pop(extent.order.stage_id, None)
        staging.table.released(extent.entry)
        staging.node.buffer.release(now, extent.blocks)

    def close(self, now: float) -> None:
        """The run is over: every extent still held is freed as expired (its session never came)."""
        for staging in self.nodes.values():
            for extent in list(staging.extents.values()):
                staging.table.move(extent.entry, StageEvent.EXPIRE)
                self._free(staging, extent, now)
                self.counters.expired += 1

    def held_blocks(self) -> int:
        return sum(staging.table.held_blocks for staging in self.nodes.values())
