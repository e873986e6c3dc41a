"""What an engine still names in its heartbeat after letting go of an attempt (runtime/engine/outbox.py)
and what it remembers of cancels (runtime/engine/cancelled.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dualpath_ray.runtime.engine.cancelled import CancelledAttempts
from dualpath_ray.protocol.messages import Holding
from dualpath_ray.runtime.engine.outbox import Outbox
from dualpath_ray.runtime.engine.ports import Failed, Ready


@dataclass
class Gate:
    """A call in flight until `open` is set."""

    open: bool = False

    def done(self) -> bool:
        return self.open

    def wait(self, timeout_s: float | None = None) -> None:
        return None


class StepClock:
    def __init__(self) -> None:
        self.value = 0.0

    def now(self) -> float:
        return self.value


def test_a_call_is_named_until_delivered_and_a_failed_one_is_counted_and_forgotten() -> None:
    outbox = Outbox()
    gate = Gate()
    outbox.sent("a#0", "a", Holding(0, True), gate)
    outbox.sent("b#1", "b", Holding(1, True), Failed(RuntimeError("receiver died")))
    outbox.sent("c#0", "c", Holding(0, True), Ready(None))
    outbox.settle()
    assert outbox.holdings() == [("a", Holding(0, True))], "only the undelivered call is still named"
    assert outbox.undelivered == 1, "the failed call is counted"
    gate.open = True
    outbox.settle()
    assert outbox.holdings() == [] and len(outbox) == 0, "a delivered call is forgotten"


def test_cancels_are_remembered_for_the_horizon_only() -> None:
    clock = StepClock()
    cancelled = CancelledAttempts(10.0, clock)
    cancelled.add("old#0")
    clock.value = 5.0
    cancelled.add("new#0")
    assert "old#0" in cancelled and "new#0" in cancelled, "both are within the horizon"
    clock.value = 12.0
    cancelled.add("newer#0")
    assert "old#0" not in cancelled and "new#0" in cancelled, "a record older than the horizon is pruned"
    assert len(cancelled) == 2, "the table stays bounded"
    with pytest.raises(ValueError, match="horizon_s"):
        CancelledAttempts(0.0, clock)
