"""One record per request the scheduler holds, and its lifecycle.

submit -> QUEUED_DECODE (global decode queue, then a group's private queue)
       -> QUEUED_PREFILL (its decode engine reserved HBM; FIFO prefill queue)
          <-> WAITING_PREFIX (held while a producer in flight computes its prefix, out of the
              queue; released back to its head: scheduling/sharing.py)
       -> PREFILLING (a prefill engine and a read path are chosen)
       -> DECODING (the prompt's KV reached the decode engine)
       -> DONE | FAILED (FAILED from any live state)

`transition` is the only way a state changes; an illegal move raises. The runtime and the
simulator hold the very same records, so a request's whole state at the scheduler is here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath_ray.protocol.messages import RequestSpec
from dualpath_ray.scheduling.loads import prefill_tokens
from dualpath_ray.protocol.types import ReadPath

if TYPE_CHECKING:
    from dualpath_ray.scheduling.staging import StageOrder


class RequestState(enum.Enum):
    QUEUED_DECODE = "queued_decode"
    QUEUED_PREFILL = "queued_prefill"
    WAITING_PREFIX = "waiting_prefix"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        return self not in (RequestState.DONE, RequestState.FAILED)

    @property
    def queued(self) -> bool:
        """It waits at the scheduler: no engine has been handed it yet (scheduling/admission.py)."""
        return self in (RequestState.QUEUED_DECODE, RequestState.QUEUED_PREFILL, RequestState.WAITING_PREFIX)


_LEGAL = {
    RequestState.QUEUED_DECODE: {RequestState.QUEUED_PREFILL, RequestState.FAILED},
    RequestState.QUEUED_PREFILL: {RequestState.PREFILLING, RequestState.WAITING_PREFIX, RequestState.FAILED},
    RequestState.WAITING_PREFIX: {RequestState.QUEUED_PREFILL, RequestState.FAILED},
    RequestState.PREFILLING: {RequestState.DECODING, RequestState.DONE, RequestState.FAILED},
    RequestState.DECODING: {RequestState.DONE, RequestState.FAILED},
    RequestState.DONE: set(),
    RequestState.FAILED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Request:
    """A request (one attempt of one turn) at the scheduler.

    prompt_tokens: the whole prompt (cached + new); hit_keys / hit_tokens: its stored prefix,
    as the scheduler found it at submit and again when it was considered for a prefill engine
    (late binding, scheduling/binding.py: the latest, longest answer; bound_at: the binder's
    generation at that look); decode_tokens: the HBM its decode engine reserves (prompt +
    max new tokens, in whole pages); partial_hit: its last hit block holds the prompt's last
    token, which it computes anyway (the logits): hit_tokens = prompt_tokens - 1 while its hit
    blocks hold prompt_tokens (a partial-block hit, scheduling/binding.py). Every other hit
    block is whole, so `hit_block_tokens` (the store's block size) is exact either way. `spec` is what the caller submitted, carried to the
    engines unchanged: SchedulerCore.submit always sets it; only a policy test that places
    requests no engine serves leaves it None.
    """

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    decode_tokens: int
    hit_keys: tuple[str, ...] = ()
    spec: RequestSpec | None = None
    state: RequestState = RequestState.QUEUED_DECODE
    decode_engine: str = ""
    decode_node: str = ""
    prefill_engine: str = ""
    prefill_node: str = ""
    path: ReadPath | None = None
    pe_hit_blocks: int = 0  # of its hit blocks, how many the prefill-side reader reads (the first ones)
    # Its first hit blocks staged on a decode node while the session's tool ran (claimed at
    # submit; placement prefers that node, and drops this when it cannot honour it).
    staged: StageOrder | None = None
    # Of its hit blocks, how many are read; the rest are computed with its miss tokens (the
    # compute path, scheduling/compute_path.py). None: all of them (set when it is placed).
    read_blocks: int | None = None
    bound_at: int = 0  # HitBinder.generation when its hits were last looked up
    partial_hit: bool = False  # see the class doc
    # Whether it may wait for a producer's prefix (scheduling/sharing.py); False once a producer
    # it waited for failed or left: it computes.
    may_wait: bool = True
    # A node whose reader it must not read through (its previous attempt's read failed there).
    avoid_reader: str = ""

    @property
    def read_keys(self) -> tuple[str, ...]:
        """The hit blocks it reads (a prefix of hit_keys)."""
        return self.hit_keys if self.read_blocks is None else self.hit_keys[: self.read_blocks]

    @property
    def hit_block_tokens(self) -> int:
        """Tokens one hit block holds (0 without hits): the read queues count these, a partial
        last block's too, since it is read whole."""
        return (self.hit_tokens + self.partial_hit) // len(self.hit_keys) if self.hit_keys else 0

    @property
    def read_tokens(self) -> int:
        """The prompt tokens whose KV it reads and does not compute (a partial last block,
        read whole, gives all but its last token); the rest are computed."""
        if self.read_blocks is None or not self.hit_keys:
            return self.hit_tokens
        return min(self.hit_tokens, self.hit_block_tokens * self.read_blocks)

    @property
    def recomputed_hit_tokens(self) -> int:
        """Tokens of its hit it computes instead of reading (the compute path)."""
        return self.hit_tokens - self.read_tokens

    @property
    def prefill_tokens(self) -> int:
        """The load it adds to a prefill engine (scheduling/loads.py)."""
        return prefill_tokens(self.prompt_tokens, self.read_tokens)

    def engines(self) -> tuple[str, ...]:
        """The engines that hold something of it now: its decode engine (HBM), and its
        prefill engine until the KV has been handed over."""
        holders = [self.decode_engine]
        if self.state is not RequestState.DECODING:
            holders.append(self.prefill_engine)
        return tuple(e for e in holders if e)

    def uses_node(self, node_id: str) -> bool:
        """Whether it holds buffer extents on `node_id` now: staged or being prefilled (both
        sides' buffers), or decoding (its decode node's reader persists its blocks)."""
        if self.state is RequestState.PREFILLING:
            return node_id in (self.prefill_node, self.decode_node)
        return self.state is RequestState.DECODING and node_id == self.decode_node


def transition(request: Request, new: RequestState) -> None:
    """The one way a request's state changes; an illegal move raises."""
    if new not in _LEGAL[request.state]:
        raise IllegalTransition(f"request {request.request_id}: {request.state.value} -> {new.value}")
    request.state = new
