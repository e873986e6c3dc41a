"""Asynchronous loads into vLLM's pages, and pages held for a reader, per vLLM's connector
contract: `AsyncLoads`.

A request whose external tokens' KV lies elsewhere (a `KVSource`: the decode node's buffer
extent, another engine's pages) can load it between vLLM's steps instead of inside one, as
vLLM's NixlConnector does: the connector's scheduler side answers `get_num_new_matched_tokens`
with (tokens, True), vLLM allocates the request's pages, calls `update_state_after_alloc`, and
holds the request in WAITING_FOR_REMOTE_KVS (skipping the zeroing of the pages the connector
loads) until the worker side reports it in `get_finished`'s received set; only then does vLLM
schedule it, on KV that is whole. Meanwhile vLLM's other requests keep stepping.

This object is the worker side of it (connector.py delegates): `start` posts one transport
read per load (every layer's block-layers of the blocks the load covers, landed straight in
vLLM's backing buffer: block_layers.py), `finished` polls them; a landed load is settled into
the page layout and reported received; a failed one is reported received too, with its
blocks in `load_errors` (`get_block_ids_with_load_errors`: vLLM's `kv_load_failure_policy`
"recompute" then computes the request from its first failed block, "fail" ends it).

The other side of a move between engines' pages: a request added with HOLD (a prefill whose KV
the decode engine reads from its pages) finishes with `request_finished` returning True, so vLLM
keeps its pages (named in its output's kv_transfer_params) until `release` (the reader is done),
which the next `get_finished` reports as sent.

A source is the store's format (landed, then settled) or another vLLM engine's pages of the same
geometry (a prefill engine holding them until read: runs copied to runs, nothing to settle).
A load covers whole blocks, the last one partly: nothing computes into a block of a request
waiting for its KV, so the slots past the loaded tokens are only ever written by vLLM later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import Move, Region, Transfer
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap
from dualpath_ray.runtime.vllm_engine.step_kv import KVSource


@dataclass(frozen=True)
class AsyncLoad:
    """Tokens [lo, hi) of vLLM request `request_id` (our `key`), from `source`, into its pages
    `block_ids` (vLLM block i holds tokens [i * block_size, (i + 1) * block_size))."""

    request_id: str
    key: str
    source: KVSource
    block_ids: tuple[int, ...]
    lo: int
    hi: int

    def blocks(self, block_size: int) -> range:
        """The request's blocks the load covers; `lo` is vLLM's prefix-cache hit, whole blocks."""
        if self.lo % block_size or not 0 <= self.lo < self.hi:
            raise ValueError(f"{self.key}: an asynchronous load of tokens [{self.lo}, {self.hi}) in blocks of {block_size}")
        return range(self.lo // block_size, -(-self.hi // block_size))


@dataclass
class _Receiving:
    load: AsyncLoad
    blocks: list[int]  # vLLM blocks landed in
    transfer: Transfer | None  # None: posting it failed
    error: BaseException | None = None


@dataclass
class AsyncLoads:
    """The worker side of asynchronous loads (see the module doc): `bind` names the transport
    and the pool vLLM's backing buffer is registered under before any load is started."""

    block_map: BlockLayerMap
    buffer: torch.Tensor  # vLLM's backing buffer (block_layers.backing_buffer)
    n_layer: int
    transport: Transport | None = None
    pool: str = ""
    _receiving: dict[str, _Receiving] = field(default_factory=dict)
    _load_errors: set[int] = field(default_factory=set)
    _released: set[str] = field(default_factory=set)  # held requests whose pages were read
    # our key of the request -> (its vLLM blocks, the error that failed its load or None), for
    # whoever waits on one load (VllmCompute.load_prompt) rather than on vLLM's scheduling of it.
    _outcomes: dict[str, tuple[tuple[int, ...], BaseException | None]] = field(default_factory=dict)
    _unwanted: set[str] = field(default_factory=set)  # keys that left while loading: no outcome is kept
    block_layers_posted: int = 0
    failed: int = 0

    def bind(self, transport: Transport, pool: str) -> None:
        self.transport, self.pool = transport, pool

    def start(self, loads: list[AsyncLoad]) -> None:
        """Post each load's read; a read that cannot be posted is a failed load (reported by
        `finished`), never an exception out of vLLM's step."""
        size = self.block_map.codec.block_size
        for load in loads:
            blocks = list(load.block_ids)  # what a load that cannot even be planned fails
            try:
                blocks = [load.block_ids[b] for b in load.blocks(size)]
                if self.transport is None:
                    raise RuntimeError("no transport bound for vLLM's pages (AsyncLoads.bind)")
                moves = [
                    move
                    for layer in range(self.n_layer)
                    for b in load.blocks(size)
                    for move in self._moves(load.source, layer, b, load.block_ids[b])
                ]
                transfer = self.transport.read(load.source.peer, moves)
                self.block_layers_posted += len(blocks) * self.n_layer
                self._receiving[load.request_id] = _Receiving(load, blocks, transfer)
            except Exception as exc:  # noqa: BLE001 - reported as a failed load, the request recomputes or fails
                self._receiving[load.request_id] = _Receiving(load, blocks, None, exc)

    def _moves(self, source: KVSource, layer: int, block: int, vllm_block: int) -> list[Move]:
        """The moves of one block-layer: store format into the block's runs (settled once
        landed), or another vLLM engine's runs of the same geometry into the same runs."""
        if not source.pages:
            region = Region(*source.block_layer(block, layer, self.block_map.block_layer_bytes))
            return self.block_map.landing_moves(self.pool, layer, vllm_block, region)
        if not 0 <= block < len(source.blocks):
            raise ValueError(f"block {block} of a request whose source pages are {len(source.blocks)} blocks")
        theirs = self.block_map.runs(layer, source.blocks[block])
        return [
            (Region(self.pool, offset, nbytes), Region(source.pool, their_offset, nbytes))
            for (offset, nbytes), (their_offset, _) in zip(self.block_map.runs(layer, vllm_block), theirs)
        ]

    def finished(self) -> set[str]:
        """Requests whose loads ended since the last call, landed (and settled) or failed."""
        done = set()
        for request_id, receiving in list(self._receiving.items()):
            if receiving.transfer is not None and receiving.error is None:
                try:
                    if not receiving.transfer.done():
                        continue
                except Exception as exc:  # noqa: BLE001 - the transfer failed: its blocks are load errors
                    receiving.error = exc
            if receiving.error is None and not receiving.load.source.pages:
                for layer in range(self.n_layer):
                    self.block_map.settle(self.buffer, layer, receiving.blocks)
            elif receiving.error is not None:
                self.failed += 1
                self._load_errors.update(receiving.blocks)
            del self._receiving[request_id]
            key = receiving.load.key
            if key in self._unwanted:
                self._unwanted.discard(key)
            else:
                self._outcomes[key] = (receiving.load.block_ids, receiving.error)
            done.add(request_id)
        return done

    def outcome(self, key: str) -> tuple[tuple[int, ...], BaseException | None] | None:
        """Once the load of the request we call `key` ended (reported by `finished`): its vLLM
        blocks and the error that failed it (None: landed and settled); None while it is in
        flight or after it was asked for once."""
        return self._outcomes.pop(key, None)

    def forget(self, key: str) -> None:
        """The request we call `key` left (aborted): an outcome nobody will ask for is dropped,
        now or when its load ends."""
        loading = any(receiving.load.key == key for receiving in self._receiving.values())
        if self._outcomes.pop(key, None) is None and loading:
            self._unwanted.add(key)

    def load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def release(self, request_id: str) -> None:
        """A held request's pages were read by whoever loads from them: vLLM may free them."""
        self._released.add(request_id)

    def released(self) -> set[str]:
        """Held requests released since the last call (vLLM's finished-sending set)."""
        released, self._released = self._released, set()
        return released

    def receiving(self, request_id: str) -> bool:
        """Whether vLLM request `request_id`'s load was started and not yet reported ended: what
        the scheduler side knows between steps too (connector.py request_finished)."""
        return request_id in self._receiving

    def in_flight(self) -> int:
        return len(self._receiving)
