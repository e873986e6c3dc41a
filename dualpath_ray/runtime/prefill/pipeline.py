"""One prefill batch, layer by layer, with its KV transfers double-buffered around compute.

Layer l uses window slot l % 3. The order of one batch (L layers):

    post_in(0), post_in(1)
    for l in 0..L-1:  finish_in(l); compute(l); record(l); post_out(l); finish_out(l-1); post_in(l+2)

so while layer l computes, layer l+1's past KV is landing and layer l-1's KV is leaving, and a
slot is loaded again only after its previous layer's KV has left (the window's lifecycle checks
it). Each post is one transfer per peer for the whole batch: all requests whose past KV sits on
that reader in one read, all requests whose KV goes to that reader in one write. At most one
wait per layer and direction is on the critical path, and only if the transfer is slower than
the compute it overlaps. post_out(l) waits for the event `record(l)` put after layer l's compute
(kv_ready.py) before it posts a write: on a GPU the compute is asynchronous, and the transport
must not read the slot before the layer's kernels have written it.

Oracle requests move nothing: their KV lives in a host tensor of the whole prompt (`oracle_kv`),
filled from the store at staging; loads and sends are local copies.

A partial-block hit (PrefillTask.partial_hit: the last read block holds the prompt's last token,
which is computed for its logits) loads the whole read span, [0, read_end), not only the past
[0, start): the compute writes the computed token's K/V over the loaded one at its position and
attends to it (so its logits are the recompute's), and after the layer the loaded bytes are put
back (`_Restore`). The loaded bytes win: every position a stored block covers leaves the window
holding the stored bytes, in its digests and in what goes to the decode node, so the decode side's
check against the store (runtime.verify_kv) holds bit for bit and nothing stored is written again.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dualpath_ray.kv.digest import mismatched_tokens, window_digests
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.window import LayerWindow, SlotEvent, SlotState
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.engine.failures import KVMismatchError
from dualpath_ray.runtime.engine.ports import Pending, TransportPort
from dualpath_ray.runtime.prefill.job import PrefillJob
from dualpath_ray.runtime.prefill.kv_ready import KVReady, kv_ready_for
from dualpath_ray.runtime.transport.moves import Move, Region, end_all
from dualpath_ray.protocol.types import ReadPath



@dataclass
class PipelineStats:
    """Transfers and memory of every batch an engine ran."""

    layers: int = 0
    reads: int = 0
    writes: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    max_in_flight_bytes: int = 0
    max_transfers_per_layer_peer: int = 0  # reads + writes of one layer with one reader
    window_layers_held_max: int = 0
    digest_mismatches: int = 0  # tokens whose loaded past KV differed from its digests
    digest_rereads: int = 0  # loads read once more after a mismatch, and then right
    compute_s: float = 0.0  # inside the model's layers
    wait_in_s: float = 0.0  # the critical path waiting for past KV to land
    wait_out_s: float = 0.0  # waiting for a slot's KV to leave before it is loaded again

    def transfers_per_layer(self) -> float:
        return (self.reads + self.writes) / self.layers if self.layers else 0.0


@dataclass
class _Posted:
    pending: Pending[int]
    nbytes: int


@dataclass
class _Check:
    """Past KV of tokens [lo, hi) of one request loaded into a layer's slot from one peer, and
    how to read it again."""

    job: PrefillJob
    chunk: ChunkSpec
    peer: str
    moves: list[Move]
    lo: int
    hi: int


@dataclass
class _Restore:
    """Loaded KV of tokens [lo, hi) of a chunk's span that its compute writes over (a partial
    hit's last token): saved after the load, put back after the compute (module doc)."""

    offset: int
    lo: int
    hi: int
    saved: torch.Tensor | None = None


def loaded_end(job: PrefillJob, chunk: ChunkSpec) -> int:
    """The end of the KV loaded into the chunk's span: its past, and on the first chunk of a
    partial hit the read blocks' last token too (module doc)."""
    if job.chunks:
        return chunk.start
    return max(chunk.start, min(job.task.read_end, chunk.end))


@dataclass
class _Layer:
    reads: list[_Posted] = field(default_factory=list)
    checks: list[_Check] = field(default_factory=list)
    writes: list[_Posted] = field(default_factory=list)
    per_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    restores: list[_Restore] = field(default_factory=list)


class LayerPipeline:
    def __init__(
        self,
        layout: KVLayout,
        window: LayerWindow,
        transport: TransportPort,
        timeout_s: float,
        stats: PipelineStats,
        counters: NodeCounters,
        links: tuple[Link, Link],
        check_digests: bool = True,
        kv_ready: Callable[[], KVReady] | None = None,
    ) -> None:
        self.layout = layout
        # One event per layer, recorded after its compute and waited on before its KV is sent.
        self.kv_ready = kv_ready or kv_ready_for(window.tensor.device)
        self.check_digests = check_digests
        # Digests [n_layer, chunk end] of each request's KV as this batch leaves it (by owner).
        self.digests: dict[str, np.ndarray] = {}
        self.window = window
        self.transport = transport
        self.timeout_s = timeout_s
        self.stats = stats
        self.counters = counters
        self.cnic_in, self.cnic_out = links
        self._layers: dict[int, _Layer] = defaultdict(_Layer)
        self._in_flight = 0

    def run(self, jobs: Sequence[PrefillJob], chunks: Sequence[ChunkSpec], compute: Callable[[int], None]) -> None:
        n_layer = self.layout.n_layer
        if self.check_digests:
            self.digests = {
                job.owner: np.empty((n_layer, chunk.end), dtype=np.int64)
                for job, chunk in zip(jobs, chunks) if not job.task.oracle and job.digests is not None
            }
        self._post_in(jobs, chunks, 0)
        if n_layer > 1:
            self._post_in(jobs, chunks, 1)
        for layer in range(n_layer):
            self._finish_in(layer)
            restores = self._layers[layer].restores
            slot = self.window.slot(layer)
            for restore in restores:
                restore.saved = slot[restore.offset + restore.lo : restore.offset + restore.hi].clone()
            started = time.perf_counter()
            compute(layer)
            for restore in restores:  # before the event: the transport must see the loaded bytes
                slot[restore.offset + restore.lo : restore.offset + restore.hi].copy_(restore.saved)
            ready = self.kv_ready()
            ready.record()
            self.stats.compute_s += time.perf_counter() - started
            self.window.move(layer, SlotEvent.COMPUTE)
            self._digest_computed(jobs, chunks, layer)
            self._post_out(jobs, chunks, layer, ready)
            if layer + 2 < n_layer:
                if layer >= 1:
                    self._finish_out(layer - 1)
                self._post_in(jobs, chunks, layer + 2)
        for layer in range(max(0, n_layer - 3), n_layer):
            if self.window.state(layer) is not SlotState.FREE:
                self._finish_out(layer)
        self.stats.layers += n_layer
        self.stats.window_layers_held_max = max(self.stats.window_layers_held_max, self.window.max_held)

    def drain(self) -> None:
        """After a failure: let every posted transfer end (either way) before the window is reused."""
        end_all((posted.pending for layer in self._layers.values() for posted in layer.reads + layer.writes), self.timeout_s)
        self._layers.clear()

    # --- incoming: past KV into the window ----------------------------------------------

    def _post_in(self, jobs: Sequence[PrefillJob], chunks: Sequence[ChunkSpec], layer: int) -> None:
        slot = self.window.slot(layer)
        by_peer: dict[str, list[Move]] = defaultdict(list)
        for job, chunk in zip(jobs, chunks):
            if chunk.start == 0:
                continue
            end = loaded_end(job, chunk)
            if end > chunk.start:
                self._layers[layer].restores.append(_Restore(chunk.offset, chunk.start, end))
            if job.task.oracle:
                slot[chunk.offset : chunk.offset + end].copy_(job.oracle_kv[layer, :end])
                continue
            for grant, lo, hi, side in self.past_sources(job, chunk, end):
                assert grant is not None, f"request {job.request_id}: no extent holds its past KV [{lo}, {hi})"
                moves = self._moves(grant.slots, layer, lo, hi, chunk.offset)
                by_peer[grant.reader].extend(moves)
                if self.check_digests and job.digests is not None:
                    self._layers[layer].checks.append(_Check(job, chunk, grant.reader, moves, lo, hi))
                self.counters.cnic_in[side] += sum(m[0].nbytes for m in moves)
        if not by_peer:
            self.window.move(layer, SlotEvent.SKIP_LOAD)
            return
        self.window.move(layer, SlotEvent.LOAD)
        for peer, moves in by_peer.items():
            nbytes = sum(m[0].nbytes for m in moves)
            self.cnic_in.take(nbytes)
            self._layers[layer].reads.append(self._post(self.transport.read(peer, moves), nbytes))
            self._count(layer, peer)
            self.stats.reads += 1
            self.stats.bytes_in += nbytes

    @staticmethod
    def past_sources(job: PrefillJob, chunk: ChunkSpec, end: int) -> list[tuple[Any, int, int, str]]:
        """(extent, first token, end token, counter side) of each part of a request's loaded KV,
        [0, end) (`loaded_end`). The first chunk reads its first `pe_tokens` hit tokens from the
        prefill node's extent (all of them on the PE path, none on the DE path, the first blocks
        of a split read) and the rest from the decode node's, which holds everything once that
        chunk was sent."""
        task = job.task
        side = ReadPath(task.path).side.value
        if job.chunks:
            return [(job.de, 0, end, side)]
        pe_end = min(task.pe_tokens, end)
        parts = [(job.pe, 0, pe_end, ReadPath.PE.value), (job.de, pe_end, end, side)]
        return [part for part in parts if part[2] > part[1]]

    def _finish_in(self, layer: int) -> None:
        if self.window.state(layer) is SlotState.LOADING:
            started = time.perf_counter()
            self._wait(self._layers[layer].reads)
            self.stats.wait_in_s += time.perf_counter() - started
            self._check_loaded(layer)
            self.window.move(layer, SlotEvent.LOADED)

    def _check_loaded(self, layer: int) -> None:
        """Every request's past KV in this slot against the digests of whoever last verified it
        (the reader for hits, this engine's previous chunk otherwise). A mismatch is read once
        more (a transfer that went wrong); if it still differs the batch fails: no request
        computes on KV it cannot vouch for."""
        slot = self.window.slot(layer)
        for check in self._layers[layer].checks:
            want = check.job.digests[layer, check.lo : check.hi]  # type: ignore[index]
            bad = self._mismatches(slot, check, want)
            if not len(bad):
                continue
            self.stats.digest_mismatches += len(bad)
            self.transport.read(check.peer, check.moves).wait(self.timeout_s)
            again = self._mismatches(slot, check, want)
            self.stats.digest_mismatches += len(np.setdiff1d(again, bad))
            if len(again):
                raise KVMismatchError(
                    f"request {check.job.request_id}: layer {layer} past KV from {check.peer} differs from its "
                    f"digests at {len(again)} tokens after a second read"
                )
            self.stats.digest_rereads += 1

    @staticmethod
    def _mismatches(slot: torch.Tensor, check: _Check, want: np.ndarray) -> np.ndarray:
        start = check.chunk.offset
        return mismatched_tokens(window_digests(slot[start + check.lo : start + check.hi]), want)

    def _digest_computed(self, jobs: Sequence[PrefillJob], chunks: Sequence[ChunkSpec], layer: int) -> None:
        """Digests of each request's KV of this layer, hits and new tokens, before it is sent."""
        slot = self.window.slot(layer)
        for job, chunk in zip(jobs, chunks):
            if job.owner in self.digests:
                self.digests[job.owner][layer] = window_digests(slot[chunk.offset : chunk.offset + chunk.end])

    # --- outgoing: computed KV to the decode node's extent -------------------------------

    def _post_out(self, jobs: Sequence[PrefillJob], chunks: Sequence[ChunkSpec], layer: int, ready: KVReady) -> None:
        slot = self.window.slot(layer)
        by_peer: dict[str, list[Move]] = defaultdict(list)
        for job, chunk in zip(jobs, chunks):
            if job.task.oracle:
                job.oracle_kv[layer, chunk.start : chunk.end].copy_(slot[chunk.offset + chunk.start : chunk.offset + chunk.end])
                continue
            assert job.de is not None, f"request {job.request_id}: no decode-side extent to send to"
            for lo, hi, side in self.sent_parts(job, chunk):
                moves = self._moves(job.de.slots, layer, lo, hi, chunk.offset)
                by_peer[job.de.reader].extend(moves)
                self.counters.cnic_out[side] += sum(m[0].nbytes for m in moves)
        if not by_peer:
            self.window.move(layer, SlotEvent.DROP)
            return
        self.window.move(layer, SlotEvent.SEND)
        ready.wait()  # the layer's kernels have written the slot before any transport reads it
        for peer, moves in by_peer.items():
            nbytes = sum(m[0].nbytes for m in moves)
            self.cnic_out.take(nbytes)
            self._layers[layer].writes.append(self._post(self.transport.write(peer, moves), nbytes))
            self._count(layer, peer)
            self.stats.writes += 1
            self.stats.bytes_out += nbytes

    @staticmethod
    def sent_parts(job: PrefillJob, chunk: ChunkSpec) -> list[tuple[int, int, str]]:
        """(first token, end token, counter side) of what goes to the decode node's extent: the
        new tokens, and on the first chunk the hits the prefill node's reader read (the decode
        node has the others already)."""
        task = job.task
        side = ReadPath(task.path).side.value
        parts = [(chunk.start, chunk.end, side)]
        if not job.chunks and task.pe_tokens:
            parts.insert(0, (0, min(task.pe_tokens, chunk.start), ReadPath.PE.value))
        return [part for part in parts if part[1] > part[0]]

    def _finish_out(self, layer: int) -> None:
        if self.window.state(layer) is SlotState.SENDING:
            started = time.perf_counter()
            self._wait(self._layers[layer].writes)
            self.stats.wait_out_s += time.perf_counter() - started
            self.window.move(layer, SlotEvent.SENT)
        self._layers.pop(layer, None)

    # --- shared -------------------------------------------------------------------------

    def _moves(self, slots: tuple[int, ...], layer: int, start: int, end: int, offset: int) -> list[Move]:
        """(window region, buffer region) pairs for tokens [start, end) of one request's layer."""
        moves = []
        for seg in self.layout.slot_segments(slots, layer, start, end):
            local = Region(Pool.WINDOW, self.window.token_offset(layer, offset + seg.token), seg.nbytes)
            moves.append((local, Region(Pool.BUFFER, seg.offset, seg.nbytes)))
        return moves

    def _post(self, pending: Pending[int], nbytes: int) -> _Posted:
        self._in_flight += nbytes
        self.stats.max_in_flight_bytes = max(self.stats.max_in_flight_bytes, self._in_flight)
        return _Posted(pending, nbytes)

    def _wait(self, posted: list[_Posted]) -> None:
        for item in posted:
            item.pending.wait(self.timeout_s)
            self._in_flight -= item.nbytes
        posted.clear()

    def _count(self, layer: int, peer: str) -> None:
        """Transfers of one layer with one peer (reads + writes): the actor calls per layer per
        source side when the transport needs a call per transfer (gloo)."""
        per_peer = self._layers[layer].per_peer
        per_peer[peer] += 1
        self.stats.max_transfers_per_layer_peer = max(self.stats.max_transfers_per_layer_peer, per_peer[peer])


def oracle_kv_for(layout: KVLayout, prompt_tokens: int, hits: torch.Tensor | None) -> torch.Tensor:
    """Oracle mode's whole-prompt KV [n_layer, prompt_tokens, bytes], hit tokens from the store."""
    kv = torch.empty((layout.n_layer, prompt_tokens, layout.bytes_per_token_per_layer), dtype=torch.uint8)
    if hits is not None:
        n = hits.shape[0] * layout.block_size
        kv[:, :n] = hits.permute(1, 0, 2, 3).reshape(layout.n_layer, n, layout.bytes_per_token_per_layer)
    return kv
