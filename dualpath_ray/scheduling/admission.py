"""Admission: how many turns may wait at the scheduler for an engine (scheduler.max_queued_turns).

A queued turn is one the scheduler holds that no engine has been handed yet: in the global
decode queue, a decode group's private queue or the prefill queue (`RequestState.queued`). The
dispatcher counts them as they enter and leave those states (O(1) per submit; its integrity
check recounts them), so the check is exact. Turns on engines (prefilling, decoding) do not
count: what engines hold is bounded by their memory already.

Only a new turn (attempt 0) is refused. A retry (attempt + 1) belongs to a turn admitted once;
refusing it would fail a turn whose caller was told it is being served, and the retries of the
turns in flight are bounded by those turns. A refusal is `QueueFull`; the runtime answers it as
a TurnResult with ErrorKind.QUEUE_FULL, which the scheduler does not retry (its caller may).
"""

from __future__ import annotations

from dataclasses import dataclass


class QueueFull(RuntimeError):
    """A new turn refused: `limit` turns already wait for an engine."""

    def __init__(self, request_id: str, queued: int, limit: int) -> None:
        self.request_id = request_id
        self.queued = queued
        self.limit = limit
        super().__init__(
            f"request {request_id} refused: {queued} turns already wait for an engine "
            f"(scheduler.max_queued_turns={limit}); submit it again after a pause"
        )


@dataclass(frozen=True)
class Admission:
    """The limit on queued turns; 0 admits everything (the simulator's default)."""

    max_queued_turns: int = 0

    def __post_init__(self) -> None:
        if self.max_queued_turns < 0:
            raise ValueError(
                f"scheduler.max_queued_turns must be >= 0 (got {self.max_queued_turns}); 0 means no limit"
            )

    def check(self, request_id: str, attempt: int, queued: int) -> None:
        """Raise QueueFull when a new turn (`attempt` 0) finds `queued` >= the limit."""
        if self.max_queued_turns and attempt == 0 and queued >= self.max_queued_turns:
            raise QueueFull(request_id, queued, self.max_queued_turns)
