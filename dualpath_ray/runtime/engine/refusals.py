"""Attempts an engine refused at its door, before anything of them was leased or computed.

A prefill engine's `accept` runs on the actor's control thread; its reports leave from the
worker's step. A task refused there (it names other weights than the engine holds:
runtime/engine/held_weights.py) becomes a failed TurnResult kept here until the worker's next
step reports it with that step's other failures, so the scheduler retries it elsewhere at once
instead of waiting for its heartbeat to find the attempt held by no one.
"""

from __future__ import annotations

import threading

from dualpath_ray.protocol.messages import RequestSpec, TurnResult
from dualpath_ray.runtime.engine.failures import failure_of
from dualpath_ray.runtime.engine.ports import WeightsPort


class Refusals:
    """Thread-safe: the control thread refuses, the worker thread takes."""

    def __init__(self, engine: str, weights: WeightsPort) -> None:
        self.engine = engine
        self.weights = weights
        self._refused: list[TurnResult] = []
        self._lock = threading.Lock()

    def admits(self, spec: RequestSpec) -> bool:
        """Whether the engine may take `spec`; if not, its failure waits for `take`."""
        try:
            self.weights.check(spec)
        except Exception as exc:  # noqa: BLE001 - StaleWeightsError, classified by failure_of
            with self._lock:
                self._refused.append(failure_of(spec, self.engine, exc))
            return False
        return True

    def take(self) -> list[TurnResult]:
        with self._lock:
            refused, self._refused = self._refused, []
        return refused

    def __len__(self) -> int:
        with self._lock:
            return len(self._refused)
