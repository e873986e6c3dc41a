"""Finished turns waiting for the client that submitted them (`Scheduler.submit` / `collect`).

A client (runtime/../api/client.py: a rollout driver, the rollout server) submits turns in
batches and collects their results with one long-poll call that returns as soon as any is ready,
so a busy client makes two calls for many turns. A client that stops collecting (its process
died) would leave its results here forever: a mailbox untouched for `expiry_s` is dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from dualpath_ray.protocol.messages import TurnResult


@dataclass
class _Box:
    results: list[TurnResult] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    touched: float = 0.0


class Mailboxes:
    def __init__(self, expiry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.expiry_s = expiry_s
        self.clock = clock
        self.dropped = 0  # results of clients that stopped collecting
        self._boxes: dict[str, _Box] = {}

    def _box(self, client: str) -> _Box:
        box = self._boxes.get(client)
        if box is None:
            box = self._boxes[client] = _Box()
        box.touched = self.clock()
        return box

    def deliver(self, client: str, result: TurnResult) -> None:
        self._expire()
        box = self._boxes.get(client)
        if box is None:
            box = self._box(client)
        box.results.append(result)
        box.ready.set()

    async def collect(self, client: str, wait_s: float) -> list[TurnResult]:
        """The client's results; waits up to wait_s for the first when there are none."""
        box = self._box(client)
        if not box.results and wait_s > 0:
            box.ready.clear()
            try:
                await asyncio.wait_for(box.ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        box = self._box(client)
        results, box.results = box.results, []
        self._expire()
        return results

    def _expire(self) -> None:
        now = self.clock()
        for client, box in list(self._boxes.items()):
            if now - box.touched > self.expiry_s:
                self.dropped += len(box.results)
                del self._boxes[client]

    def __len__(self) -> int:
        return len(self._boxes)
