"""What the scheduling policy reads and returns: engine load reports, queued requests, assignments.

These are the only types the policy functions take, so the Ray runtime (live reports) and the
simulator (simulated reports) hand the policy the very same values. All are immutable: a policy
call works on its own copies of the counters and never changes what it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# Engines send it (protocol/loads.py); the policy reads it: one of the types it takes.
from dualpath_ray.protocol.loads import EngineLoad

__all__ = ["Assignment", "EngineLoad", "QueuedRequest", "decode_tokens", "prefill_tokens"]


def prefill_tokens(prompt_tokens: int, hit_tokens: int) -> int:
    """What one request weighs on a prefill engine: the tokens it computes (prompt - hits, at
    least one, as the hit lookup always leaves one to compute).

    A prefill engine's work is computing; a request of 60K cached and 400 new tokens costs about
    what 400 new tokens alone cost (cached tokens add only attention reads), and a cold 8K prompt
    costs twenty times more. Counting whole prompts let one leader's first pull take every cold
    first turn of a rollout while the other nodes idled (the simulator's 8P16D p0: 113 s TTFT
    p99), so tok and beta both count computed tokens.
    """
    return max(1, prompt_tokens - hit_tokens)


def decode_tokens(prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """What one request weighs on a decode engine: the HBM it holds there, prompt + max new
    tokens in whole pages of block_size tokens (decode engines hold KV in whole pages, so the
    scheduler's free-HBM arithmetic equals the engine's exactly)."""
    pages = -(-(prompt_tokens + max_new_tokens) // block_size)
    return pages * block_size


@dataclass(frozen=True)
class QueuedRequest:
    """A waiting request; `tokens` is the load it adds to an engine's tok: for a prefill engine
    the tokens it computes (`prefill_tokens`), for a decode engine its whole length."""

    request_id: str
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(
                f"QueuedRequest.tokens must be >= 1 (got {self.tokens} for {self.request_id!r}); "
                "a request always has at least one token to compute and to hold"
            )


class Assignment(NamedTuple):
    """Request `request_id` goes to `target` (an engine id, or a decode group id in phase 1)."""

    request_id: str
    target: str
