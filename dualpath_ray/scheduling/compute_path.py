"""The compute path (a third path beside PE and DE reads): recompute a tail of a request's hit
when reading all of it would end the request later than computing part of it.

When both read paths' storage NICs are the bottleneck, the prefill engines wait for bytes with
their compute idle. For a request with `hit` stored blocks the core may then read only blocks
[0, k) over the chosen path and compute [k, hit) together with the miss tokens: KV dependencies
run forward, so a read prefix plus a computed tail is the same KV in meaning (bitwise where the
engine's batched prefill equals what was stored). k = hit is the classic behaviour.

The rule (`blocks_to_read`), for a request placed on a prefill engine whose read goes through
one node's reader (PE or DE path):

    read_done(k)   = read_queue_s + k * block_read_s        (0 when k = 0: nothing to wait for)
    finish(k)      = max(read_done(k), engine_queue_s) + prefill_s(cached = k * B, new = miss + (hit - k) * B)

where read_queue_s is the time the path's reader needs for what is queued before it (its read
queue over the SNIC's rate), engine_queue_s the time the engine needs for the prefill tokens it
already holds, and prefill_s the latency model's time for this request's prefill (attention
included: the new tokens attend to the whole prompt). k minimises finish(k); of equal minima the
largest k wins (reading moves no work onto the engine). Both read_done and the engine wait are
non-decreasing in k and prefill_s, for the cost models here, falls linearly in k (every term is
linear in the new tokens at a fixed prompt length), so finish is convex in k and the minimiser is
found by a binary search on its slope: O(log hit) cost-model calls per request. With a
partial-block hit (the last hit block holds the prompt's last token, miss = 0) reading every block
still computes that one token: cached = min(k * B, prompt - 1), so the last step's prefill saving
is B - 1 tokens, which keeps finish convex.
`tests/unit/scheduling/test_compute_path.py` checks it against a literal scan of every k.

Every request sees the queues the requests placed before it grew (the dispatcher books each
choice), so a long read queue shifts the following requests' tails to compute until the engines'
queues catch up: the SNICs and the GPUs finish their shares together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ComputePathModel:
    """What the core estimates finish times with.

    read_tokens_per_s: one node's SNIC in KV tokens per second (alpha / alpha_seconds).
    compute_tokens_per_s: one prefill engine's prefill rate at a typical request (beta /
      beta_seconds), for the time its queued tokens take.
    prefill_s: one request's prefill time in seconds given (cached, new) tokens, all layers.
    read_nothing: compute every hit whole (scheduler.compute_path: all, the baseline).
    buffer_read_tokens_per_s: one CNIC in KV tokens per second (cnic_gbps over the KV bytes per
      token): what a read of blocks a decode node holds in memory costs (in-flight sharing's
      decode-buffer source, scheduling/share_rule.py); 0 = no such source.
    """

    read_tokens_per_s: float
    compute_tokens_per_s: float
    prefill_s: Callable[[int, int], float]
    read_nothing: bool = False
    buffer_read_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.buffer_read_tokens_per_s < 0:
            raise ValueError(f"the decode-buffer read rate must be >= 0 (0: none), not {self.buffer_read_tokens_per_s} tokens/s")
        if self.read_tokens_per_s <= 0 or self.compute_tokens_per_s <= 0:
            raise ValueError(
                f"compute path rates must be > 0 (read {self.read_tokens_per_s}, compute {self.compute_tokens_per_s} tokens/s)"
            )


@dataclass(frozen=True)
class SplitInputs:
    """One request's figures at its placement."""

    hit_blocks: int
    block_tokens: int
    # The prompt's tokens past its hit blocks: 0 when the last hit block holds the prompt's last
    # token (a partial-block hit: reading every block, it computes that one token, finish_s).
    miss_tokens: int
    read_queue_tokens: int  # queued on the reader its hits would go through, before it
    engine_queue_tokens: int  # prefill tokens its engine holds, before it

    def __post_init__(self) -> None:
        if min(self.hit_blocks, self.block_tokens, self.miss_tokens, self.read_queue_tokens, self.engine_queue_tokens) < 0:
            raise ValueError(f"split inputs must be >= 0: {self}")
        if self.hit_blocks * self.block_tokens + self.miss_tokens < 1:
            raise ValueError(f"split inputs of an empty prompt (no hit blocks and no miss tokens): {self}")


def finish_s(inputs: SplitInputs, model: ComputePathModel, k: int) -> float:
    """The estimated end of the request's prefill when it reads k of its hit blocks (module doc)."""
    if not 0 <= k <= inputs.hit_blocks:
        raise ValueError(f"k = {k} is outside [0, {inputs.hit_blocks}]")
    b = inputs.block_tokens
    read_done = (inputs.read_queue_tokens + k * b) / model.read_tokens_per_s if k else 0.0
    engine_free = inputs.engine_queue_tokens / model.compute_tokens_per_s
    prompt = inputs.hit_blocks * b + inputs.miss_tokens
    cached = min(k * b, prompt - 1)  # the last token is always computed (its logits)
    return max(read_done, engine_free) + model.prefill_s(cached, prompt - cached)


def blocks_to_read(inputs: SplitInputs, model: ComputePathModel) -> int:
    """The largest k in [0, hit_blocks] that minimises finish_s (module doc). On [1, hit] finish
    is convex, so its largest minimiser there is the largest k whose finish is no later than
    k - 1's (a binary search whose probes all have k - 1 >= 1); k = 0 (no read at all, so no
    read queue to wait behind) is off that branch and is compared on its own: it wins only if
    strictly sooner."""
    if inputs.hit_blocks == 0 or model.read_nothing:
        return 0
    lo, hi = 1, inputs.hit_blocks  # invariant: the largest minimiser on [1, hit] lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2  # >= 2
        if finish_s(inputs, model, mid) <= finish_s(inputs, model, mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return 0 if finish_s(inputs, model, 0) < finish_s(inputs, model, lo) else lo
