"""In-flight sharing: a request whose prefix another request is computing right now waits for it.

When the dispatcher considers a request for a prefill engine (after its late lookup,
scheduling/binding.py) and its next blocks past its hit are promised by a producer in flight
(kv/promised.py: a request placed before it with the same prefix, whose turn will publish them),
the wait-or-compute rule (scheduling/share_rule.py) decides: if waiting for the producer and
then reading the blocks ends it sooner than computing them again, it is held (`waiting_prefix`,
scheduling/requests.py) as that producer's waiter, out of the prefill queue; otherwise it is
placed and computes them, so the same prefix is computed on two engines only when waiting is
dearer.

A producer promises, when it is placed, every full block of its prompt past its stored hit, and
when it expects to publish them: its engine's queue, its prefill (the latency model), the write
of those blocks at the read rate (with a decode-buffer source, below: their transfer to its decode
node at the CNIC's rate) and, where a turn publishes what it persisted only when it ends (the
runtime without that source), its decode (max_new_tokens decode steps, each one token's forward over
the prompt). Where the driver reports the prompt's blocks stored as soon as they are
(`SchedulerCore.prompt_persisted`: the simulator), they are published then. When they are
published, or its turn ends, its waiters are released at once, back at the head of the prefill queue in the order they
were held: they are looked up again and read what it published. A producer that fails, is
aborted or is abandoned releases its waiters just as at once, and they may not wait again (they
compute: whatever made it fail, they do not depend on it twice).

With a decode-buffer source (the model's buffer_read_tokens_per_s > 0: the runtime's decode
nodes keep a producer's freshly computed prompt blocks in memory, runtime/reader/hot_blocks.py)
the producer publishes as soon as its prompt's KV is on its decode node (`prompt_persisted`,
right after the prefill -> decode transfer, before the store has written it), the rule may pick
that source for a waiter on the same decode node, and until the producer's turn ends (its blocks
are then known stored) a request that reads any of those blocks is read on the DE path of that
node (`in_buffer`): its reader serves them from memory, and no other reader's store may have
them yet.

The counts (`SharingStats`, per prefill engine a waiter was then placed on): prefix tokens
found after waiting (shared in flight), waits and their seconds, and waiters released by a
failed producer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpath_ray.kv.promised import PromisedBlocks
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.share_rule import ShareInputs, ShareSource, wait_source


class ChainSource(Protocol):
    """The index's block keys of a whole prompt (kv/index.py PrefixIndex.chain, sim/index.py)."""

    def chain(self, token_ids: Any, namespace: str) -> Sequence[Hashable]: ...


@dataclass
class SharingStats:
    """Per prefill engine (the one a waiter was placed on after its wait)."""

    shared_tokens: dict[str, int] = field(default_factory=dict)  # prefix tokens it read instead of computing
    waits: dict[str, int] = field(default_factory=dict)  # placements that had waited
    wait_s: dict[str, float] = field(default_factory=dict)  # their summed wait
    released_on_failure: int = 0  # waiters whose producer failed or left (they compute)
    buffer_waits: int = 0  # waits whose rule chose the producer's decode-node buffer as the source

    def placed(self, engine: str, waited_s: float, shared_tokens: int) -> None:
        self.waits[engine] = self.waits.get(engine, 0) + 1
        self.wait_s[engine] = self.wait_s.get(engine, 0.0) + waited_s
        self.shared_tokens[engine] = self.shared_tokens.get(engine, 0) + shared_tokens


@dataclass
class _Hold:
    producer: str
    since: float
    hit_tokens: int  # its hit when it was held: what it gained by waiting is measured from it


class InFlightSharing:
    """Promises, holds and releases (module doc). `model` gives the rule its estimates; `chains`
    the prompts' block keys."""

    def __init__(
        self, model: ComputePathModel, chains: ChainSource, block_size: int, early_publish: bool = False,
        partial: bool = False,
    ) -> None:
        self.model = model
        # Whether a waiter may wait for the block holding its prompt's last token too (partial-
        # block hits, scheduling/binding.py): then it computes only that token.
        self.partial = partial
        # Whether the driver reports a producer's prompt blocks stored before its turn ends
        # (SchedulerCore.prompt_persisted: the simulator does, and the runtime with a decode-buffer
        # source); if not, a producer publishes them with its turn's result, after its decode.
        self.early_publish = early_publish
        self.chains = chains
        self.block_size = block_size
        self.promises = PromisedBlocks()
        self._holds: dict[str, _Hold] = {}  # waiters, held or released and not placed yet
        self._waiters: dict[str, list[str]] = {}  # producer -> its held waiters, in hold order
        # Published blocks its decode node holds in memory and the store may not have yet: key ->
        # node, by producer, from its early publish until its turn ends (module doc).
        self._in_buffer: dict[Hashable, str] = {}
        self._buffered_by: dict[str, tuple[Hashable, ...]] = {}
        self.stats = SharingStats()

    def counts(self) -> dict[str, int]:
        """Prefix tokens shared in flight, waits, requests waiting now, and waiters released by a
        producer that failed or left."""
        stats = self.stats
        return {"shared_prefix_tokens": sum(stats.shared_tokens.values()), "prefix_waits": sum(stats.waits.values()),
                "waiting_prefix": len(self.waiters()), "released_on_failure": stats.released_on_failure,
                "buffer_waits": stats.buffer_waits}

    def waiters(self) -> list[str]:
        """Every request held now (released ones no longer are), producer by producer."""
        return [rid for waiting in self._waiters.values() for rid in waiting]

    def _chain(self, request: Request) -> Sequence[Hashable]:
        return self.chains.chain(request.spec.prompt, request.spec.namespace)

    def consider(self, request: Request, now: float, read_q_tokens: int, engine_q_tokens: int) -> bool:
        """Whether `request` waits (then it is held as its producer's waiter) or is placed now."""
        if not request.may_wait or not len(self.promises) or request.request_id in self.promises:
            return False
        size, last = self.block_size, request.prompt_tokens - 1
        found = self.promises.run(self._chain(request), len(request.hit_keys), request.prompt_tokens // size if self.partial else last // size)
        if found is None:
            return False
        promise, covered = found
        promised = covered * size  # whole blocks, read whole; hit + promised <= prompt_tokens
        inputs = ShareInputs(
            request.hit_tokens, promised, request.prompt_tokens - request.hit_tokens - promised,
            max(0.0, promise.ready_at - now), read_q_tokens, engine_q_tokens,
            same_decode_node=self.buffer_source and bool(promise.node) and promise.node == request.decode_node,
        )
        source = wait_source(inputs, self.model)
        if source is None:
            return False
        if source is ShareSource.BUFFER:
            self.stats.buffer_waits += 1
        earlier = self._holds.get(request.request_id)  # held before (released, held again): one wait
        since, hit = (earlier.since, earlier.hit_tokens) if earlier else (now, request.hit_tokens)
        self._holds[request.request_id] = _Hold(promise.producer, since, hit)
        self._waiters.setdefault(promise.producer, []).append(request.request_id)
        return True

    def promise(self, request: Request, now: float, engine_q_tokens: int) -> None:
        """`request` is being placed: it promises its prompt's full blocks past its hit."""
        size, model = self.block_size, self.model
        first, last = len(request.hit_keys), request.prompt_tokens // size
        if first >= last or request.request_id in self.promises:
            return
        max_new = request.spec.sampling.max_new_tokens
        # Published once its blocks are written to the store, or, with a decode-buffer source,
        # once they reached its decode node (the transfer over the CNIC).
        reach_rate = model.buffer_read_tokens_per_s if self.buffer_source else model.read_tokens_per_s
        ready_in = (
            engine_q_tokens / model.compute_tokens_per_s
            + model.prefill_s(request.read_tokens, request.prefill_tokens)
            + (last - first) * size / reach_rate
        )
        if not self.early_publish:
            ready_in += max(0, max_new - 1) * model.prefill_s(request.prompt_tokens, 1)
        self.promises.promise(
            request.request_id, tuple(self._chain(request)[first:last]), now + ready_in, request.decode_node,
        )

    @property
    def buffer_source(self) -> bool:
        """Whether producers publish from their decode node's memory (module doc)."""
        return self.early_publish and self.model.buffer_read_tokens_per_s > 0

    def in_buffer(self, request: Request) -> bool:
        """Whether the request reads a block that its own decode node holds in memory and the
        store may not have yet (then it is read on that node's DE path: module doc)."""
        return bool(self._in_buffer) and any(self._in_buffer.get(key) == request.decode_node for key in request.hit_keys)

    def prompt_blocks(self, request: Request) -> list[tuple[Hashable, Hashable | None]]:
        """(key, parent) of each full block of its prompt past its hit: what it persists first."""
        chain = self._chain(request)
        first, last = len(request.hit_keys), request.prompt_tokens // self.block_size
        keys = list(chain[first:last])
        parents = [request.hit_keys[-1] if request.hit_keys else None, *keys[:-1]]
        return list(zip(keys, parents))

    def fulfilled(self, producer: Request) -> list[str]:
        """The producer's prompt blocks were published before its turn ended: its promise ends
        and its waiters are returned, released in the order they were held. With a decode-buffer
        source its blocks are on its decode node and in the store only once its turn ends."""
        rid = producer.request_id
        self.promises.withdraw(rid)
        if self.buffer_source and rid not in self._buffered_by:
            keys = tuple(key for key, _ in self.prompt_blocks(producer))
            self._buffered_by[rid] = keys
            self._in_buffer.update((key, producer.decode_node) for key in keys)
        return self._waiters.pop(rid, [])

    def unpromise(self, request_id: str) -> None:
        """It was considered but not placed (no engine took it): its promise is withdrawn. No one
        waits for it: the policy considers nothing after the first request it cannot place."""
        self.promises.withdraw(request_id)

    def ended(self, request_id: str, published: bool) -> list[str]:
        """`request_id` left (finished, failed, abandoned): as a waiter it is forgotten; as a
        producer its promise ends and its waiters are returned, released in the order they were
        held (after a failure they may not wait again)."""
        hold = self._holds.pop(request_id, None)
        if hold is not None and request_id in self._waiters.get(hold.producer, ()):
            self._waiters[hold.producer].remove(request_id)
        self.promises.withdraw(request_id)
        for key in self._buffered_by.pop(request_id, ()):
            self._in_buffer.pop(key, None)
        released = self._waiters.pop(request_id, [])
        if not published:
            self.stats.released_on_failure += len(released)
        return released

    def placed(self, request: Request, now: float) -> None:
        """A request is placed on its prefill engine: if it had waited, its wait is counted."""
        hold = self._holds.pop(request.request_id, None)
        if hold is not None:
            self.stats.placed(request.prefill_engine, now - hold.since, max(0, request.hit_tokens - hold.hit_tokens))
