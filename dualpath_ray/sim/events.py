"""The discrete-event loop: a clock and a heap of (time, lateness, sequence, action, argument).

Events at the same time run in the order they were scheduled (the sequence number breaks
ties), so a run is a pure function of its inputs: no wall clock, no hash order, no randomness.
A `late` event runs after every ordinary event of its time: what reacts to a moment (a group
leader's pull) then sees everything that happened at it, as one pull.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

Action = Callable[[Any], None]


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, int, Action, Any]] = []
        self._sequence = 0

    def at(self, when: float, action: Action, argument: Any = None, late: bool = False) -> None:
        """Run action(argument) at `when` (never before now: a past time runs now)."""
        self._sequence += 1
        heapq.heappush(self._heap, (when if when > self.now else self.now, late, self._sequence, action, argument))

    def run(self, until: float = float("inf")) -> None:
        """Run events in time order until none is left (or the next is past `until`)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            when, _, _, action, argument = pop(heap)
            self.now = when
            self.events += 1
            action(argument)

    def pending(self) -> int:
        return len(self._heap)
