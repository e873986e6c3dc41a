"""Blocks promised by requests in flight: the prefix index's companion for in-flight sharing.

A request placed on a prefill engine computes, and its turn then persists and publishes, every
full block of its prompt past its stored prefix. Until that turn publishes them the index does
not hold those blocks, but they are promised: this book names each promised block's producer
(the request that computes it) and when the producer is expected to publish it, so a request
with the same prefix that is about to be placed can wait for them instead of computing the same
prefix on a second engine (scheduling/sharing.py decides).

A block is promised by one producer at a time, the first to promise it: a later request with
the same prefix is that producer's waiter or computes it itself, and then its blocks past the
first producer's run are its own promise. A producer's promise ends when its turn finishes
(its blocks are published) or fails, is aborted or abandoned (`withdraw`): a block it promised
becomes promisable again. Keys are whatever the index's chain gives (kv/index.py block keys, or
the simulator's integer keys).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Promise:
    """One producer's promised blocks, in chain order, and when it is expected to publish them."""

    producer: str
    keys: tuple[Hashable, ...]
    ready_at: float  # the core's clock; an estimate (scheduling/sharing.py)
    node: str = ""  # the producer's decode node, whose buffer its prompt's KV reaches first

    @property
    def blocks(self) -> int:
        return len(self.keys)


class PromisedBlocks:
    """key -> (producer, position in its promise), and each producer's promise."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, tuple[str, int]] = {}
        self._promises: dict[str, Promise] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, producer: object) -> bool:
        return producer in self._promises

    def promise(self, producer: str, keys: Sequence[Hashable], ready_at: float, node: str = "") -> Promise:
        """`producer` (decoding on `node`) will publish `keys` (a chain, first block first) at about `ready_at`. Only
        the blocks no one has promised yet are its promise, from the first one (a run: a block
        promised by another producer ends it, since what follows depends on it)."""
        if producer in self._promises:
            raise ValueError(f"request {producer} has promised blocks already; withdraw them first")
        run = []
        for key in keys:
            if key in self._by_key:
                if run:
                    break
                continue
            run.append(key)
        promise = Promise(producer, tuple(run), ready_at, node)
        self._promises[producer] = promise
        for position, key in enumerate(promise.keys):
            self._by_key[key] = (producer, position)
        return promise

    def withdraw(self, producer: str) -> Promise | None:
        """The producer's promise ends (it published, failed or left); None if it had none."""
        promise = self._promises.pop(producer, None)
        if promise is not None:
            for key in promise.keys:
                del self._by_key[key]
        return promise

    def get(self, producer: str) -> Promise | None:
        return self._promises.get(producer)

    def run(self, chain: Sequence[Hashable], start: int, end: int) -> tuple[Promise, int] | None:
        """The promise covering chain[start] and how many blocks of chain[start:end] it covers
        in a row; None when chain[start] is promised by no one (or start >= end)."""
        if start >= end:
            return None
        found = self._by_key.get(chain[start])
        if found is None:
            return None
        producer, position = found
        promise = self._promises[producer]
        covered = 0
        while start + covered < end and position + covered < promise.blocks and (
            promise.keys[position + covered] == chain[start + covered]
        ):
            covered += 1
        return promise, covered
