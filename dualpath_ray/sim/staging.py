"""Staging a prefill job: buffer extents on the nodes it reads from and sends to, hit reads.

As the runtime's PrefillCore._stage does at accept: the side(s) that read hits lease an extent
for them and read them through their node's SNIC; the decode node always leases one extent for
the whole prompt (the KV sent there, and on the DE path the hits read into it). As the runtime's
reader counts them (runtime/reader/core.py): PE-path hits are in the prefill node's read queue from
accept until read, their extent wait included (a cost of that path alone); DE-path hits enter the
decode node's queue once their extent is leased, since every request waits for that extent
whichever path it reads through. Oracle jobs move nothing and are ready at once.

A task whose first hits were staged on its decode node during the session's tool time
(`task.staged`, sim/staged.py) claims that extent: if the node still holds it, the decode-node
extent is the staged one grown to the prompt's blocks (only the difference is leased) and only
the hits beyond the staged blocks, plus any staged blocks not read yet (the claim promotes them
to a real read), are read on the DE path; the job is staged no earlier than the staged chunks in
service are through. If the extent is gone, the job stages as any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.nodes import SimNode
from dualpath_ray.sim.prefill import SimPrefillJob
from dualpath_ray.sim.settings import SimSettings

if TYPE_CHECKING:
    from dualpath_ray.sim.staged import StagedReads


class Stager:
    def __init__(
        self, loop: EventLoop, settings: SimSettings, kick: Callable[[str, float], None],
        read_started: Callable[[str], None], staged: StagedReads | None = None,
    ) -> None:
        self.loop = loop
        self.settings = settings
        self.kick = kick  # kick(prefill engine id, now): a job of that engine became ready
        self.read_started = read_started  # read_started(node id): its read queue changed
        self.staged = staged  # the decode nodes' staged extents (None: tool-time staging off)

    def stage(self, job: SimPrefillJob, prefill_node: SimNode, now: float) -> None:
        """Start staging `job`; it becomes ready (and its unit is kicked) once every part is done."""
        if job.task.oracle:
            self._ready(job)
            return
        size = self.settings.block_size
        job.pending = 2 if job.pe_blocks else 1
        if job.pe_blocks:
            prefill_node.read_queue.waiting += job.pe_blocks * size
            prefill_node.buffer.lease(
                now, job.pe_blocks, lambda t: self._read(job, prefill_node, job.pe_blocks, ReadPath.PE, t)
            )
        decode_node = job.decode_node
        prompt_blocks = -(-job.prompt // size)
        staged = job.task.staged
        extent = None
        if staged is not None and self.staged is not None and not job.pe_blocks and staged.blocks <= job.de_blocks:
            extent = self.staged.claim(staged.node_id, staged.stage_id, now)
        if extent is None:
            decode_node.buffer.lease(
                now, prompt_blocks, lambda t: self._read(job, decode_node, job.de_blocks, ReadPath.DE, t)
            )
            return
        reads = job.de_blocks - extent.issued  # the hits beyond the staged ones, and staged ones not read yet
        decode_node.buffer.lease(
            now, prompt_blocks - extent.blocks,
            lambda t: self._read(job, decode_node, reads, ReadPath.DE, t, extent.last_done),
        )

    def _read(
        self, job: SimPrefillJob, node: SimNode, blocks: int, path: ReadPath, now: float, not_before: float = 0.0,
    ) -> None:
        if not blocks:
            if not_before > now:
                self.loop.at(not_before, self._part_done, job)
            else:
                self._part_done(job)
            return
        tokens = blocks * self.settings.block_size
        if path is ReadPath.PE:
            node.read_queue.waiting -= tokens
        done = node.read(now, tokens, blocks * self.settings.block_bytes, path)
        self.read_started(node.node_id)
        self.loop.at(max(done, not_before), self._part_done, job)

    def _part_done(self, job: SimPrefillJob) -> None:
        job.pending -= 1
        if job.pending == 0:
            self._ready(job)

    def _ready(self, job: SimPrefillJob) -> None:
        job.ready = True
        job.staged_at = self.loop.now
        self.kick(job.task.prefill_engine, self.loop.now)
