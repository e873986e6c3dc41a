"""When a request's hits are bound: looked up at submit, and again when it is placed.

A request's hits are the longest prefix of its prompt the index holds, in whole blocks, leaving
at least one token to compute (it yields the logits). With partial-block hits (`partial`,
scheduler.partial_block_hits) the block that holds the prompt's last token counts too: the
request reads it whole and computes only that last token (hit_tokens = len(prompt) - 1 while
its hit blocks hold len(prompt) tokens: Request.partial_hit). Without, that block is left out
and the request computes all of it (the vLLM engine backend's rule: hits in whole blocks). The early answer (at submit) is what a
request that is placed at once reads. One that waits in the queues (for a decode engine's HBM,
for a prefill engine under beta) is looked up again when the dispatcher considers it for a
prefill engine, and every choice made then (its prefill tokens in the placement, the read
queues it joins, its read path, the compute path's split) uses that late answer: a request that
arrived while another with the same prefix was still queued or computing reads what that one
persisted meanwhile, instead of computing it again.

Hits only grow. Block keys are chained hashes of the whole prefix, so a longer match of the same
prompt extends the shorter one, and a late answer that is shorter (a repair or a reset took
blocks out of the index) keeps the early one: those blocks are pinned (kv/eviction.py) or
spared, and their reads go on as they would have without the second look.

The second look costs a lookup (hashing the prompt, in the runtime) only when blocks were
published since the request's last one: the binder counts publishes (`generation`), and each
request keeps the generation it was bound at (Request.bound_at).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from dualpath_ray.kv.index import PrefixHit

if TYPE_CHECKING:
    from dualpath_ray.kv.eviction import LRUEviction
    from dualpath_ray.protocol.messages import RequestSpec
    from dualpath_ray.scheduling.requests import Request


class HitIndex(Protocol):
    """What the binder asks of an index: kv/index.py PrefixIndex, or the simulator's (sim/index.py)."""

    def match(self, token_ids: Any, namespace: str) -> PrefixHit: ...


class HitBinder:
    """Looks hits up for the core: `lookup` at submit, `rebind` at placement (late=True; with
    late=False, scheduler.bind_hits: early, the submit answer is kept, the behaviour before late
    binding). `eviction`, when the store has a capacity, is told of every hit (LRU order) and
    pins each request's deepest hit while it is in flight."""

    def __init__(
        self, index: HitIndex, block_size: int, eviction: LRUEviction | None = None, late: bool = True,
        partial: bool = False,
    ) -> None:
        self.index = index
        self.partial = partial
        self.block_size = block_size
        self.eviction = eviction
        self.late = late
        self.generation = 0  # publishes that indexed at least one block, so far
        self.late_hit_tokens = 0  # hit tokens found at placement beyond what submit found

    def lookup(self, spec: RequestSpec) -> tuple[tuple[str, ...], int]:
        """Hit blocks of a prompt and the hit tokens they give, leaving at least one token to
        compute; the hits are touched. With partial hits the last block may hold one token more
        than the hit (the prompt's last, computed for its logits); without, hits are whole blocks."""
        size, last = self.block_size, len(spec.prompt) - 1
        hit = self.index.match(spec.prompt, spec.namespace)
        # The prompt's full blocks only (the index holds no other): with partial hits all of them,
        # so the last holds the prompt's last token exactly when the prompt is whole blocks.
        usable = min(hit.hit_blocks, len(spec.prompt) // size if self.partial else last // size)
        if self.eviction is not None:
            self.eviction.touch(hit.keys[:usable])
        return tuple(hit.keys[:usable]), min(usable * size, last)

    def published(self, blocks: int) -> None:
        """A finished turn indexed `blocks` blocks: a request bound before may now hit more."""
        if blocks:
            self.generation += 1

    def bind(self, request: Request) -> None:
        """The request's first answer (at submit). The caller pins its hits once the request is
        queued (SchedulerCore.submit), and unpins them when it leaves (a rebind moves the pin)."""
        request.hit_keys, request.hit_tokens = self.lookup(request.spec)
        request.partial_hit = len(request.hit_keys) * self.block_size > request.hit_tokens
        request.bound_at = self.generation

    def rebind(self, request: Request) -> int:
        """Look the request's hits up again (at placement, before anything is chosen from them);
        returns the hit tokens it gained. Nothing changes for a request whose read is planned
        already, or when nothing was published since its last look."""
        if not self.late or request.read_blocks is not None or request.bound_at == self.generation:
            return 0
        request.bound_at = self.generation
        keys, tokens = self.lookup(request.spec)
        gained = tokens - request.hit_tokens
        if gained <= 0:
            return 0  # see the module doc: hits only grow
        if self.eviction is not None:
            self.eviction.pin(keys)
            self.eviction.unpin(request.hit_keys)
        request.hit_keys, request.hit_tokens = keys, tokens
        request.partial_hit = len(keys) * self.block_size > tokens
        self.late_hit_tokens += gained
        return gained
