"""What the scheduling policy reads and returns: engine load reports, queued requests, assignments.

These are the only types the policy functions take, so the Ray runtime (live reports) and the
simulator (simulated reports) hand the policy the very same values. All are immutable: a policy
call works on its own copies of the counters and never changes what it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


def _require_non_negative(owner: str, field: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{owner}.{field} must be >= 0 (got {value}); counters never go negative")


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load report (paper section 6).

    seq: unfinished requests on the engine; tok: their summed prompt tokens;
    free_hbm_tokens: KV capacity still free in its HBM, in tokens (used by decode engines only).
    """

    engine_id: str
    node_id: str
    seq: int
    tok: int
    free_hbm_tokens: int = 0

    def __post_init__(self) -> None:
        _require_non_negative("EngineLoad", "seq", self.seq)
        _require_non_negative("EngineLoad", "tok", self.tok)
        _require_non_negative("EngineLoad", "free_hbm_tokens", self.free_hbm_tokens)


@dataclass(frozen=True)
class QueuedRequest:
    """A waiting request; `tokens` is its prompt length (cached + new), the load it adds."""

    request_id: str
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(
                f"QueuedRequest.tokens must be >= 1 (got {self.tokens} for {self.request_id!r}); "
                "it is the prompt length, which always has at least one token"
            )


class Assignment(NamedTuple):
    """Request `request_id` goes to `target` (an engine id, or a decode group id in phase 1)."""

    request_id: str
    target: str
