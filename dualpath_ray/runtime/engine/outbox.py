"""Messages an engine sent about an attempt that their receiver may not have yet.

The scheduler decides that an attempt was lost when no engine names it in a heartbeat for
heartbeat_timeout_s. Between the moment an engine lets go of an attempt (a prefill engine hands
it to its decode engine; an engine reports its result) and the moment the receiver has it,
neither side would name it, and on a loaded host that gap can outlast the grace: a healthy
attempt would be failed and retried. So an engine keeps each such call here until it is
delivered, and its heartbeat names the attempt meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dualpath_ray.protocol.messages import Holding
from dualpath_ray.runtime.engine.ports import Pending


class Outbox:
    """Calls in flight per owner ("request#attempt"), with the request id and the holding the
    heartbeat names meanwhile; thread-safe (the worker sends, the control thread answers)."""

    def __init__(self) -> None:
        self._calls: dict[str, tuple[str, Holding, Pending[Any]]] = {}
        self._lock = threading.Lock()
        self.undelivered = 0  # calls that failed: their receiver died (or the call was lost)

    def sent(self, owner: str, request_id: str, holding: Holding, call: Pending[Any]) -> None:
        with self._lock:
            self._calls[owner] = (request_id, holding, call)

    def settle(self) -> None:
        """Forget the calls that were delivered or failed. A failed one is the receiver's death
        (or a lost message): the scheduler's heartbeat or its death detection takes it from
        there, exactly as if the call had never been made."""
        with self._lock:
            calls = list(self._calls.items())
        finished = []
        for owner, (_, _, call) in calls:
            try:
                if not call.done():
                    continue
            except Exception:  # noqa: BLE001 - see the docstring
                self.undelivered += 1
            finished.append(owner)
        with self._lock:
            for owner in finished:
                self._calls.pop(owner, None)

    def drain(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the calls on their way to be delivered, then settle. Between
        rollouts the receiver has them all but their replies may still be on the wire: an engine
        asked to sleep right after its last turn must not count them as work."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            calls = [call for _, _, call in self._calls.values()]
        for call in calls:
            try:
                call.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - failed or not there in time: settle says which
                pass
        self.settle()

    def holdings(self) -> list[tuple[str, Holding]]:
        """(request id, holding) of every call still on its way."""
        with self._lock:
            return [(rid, holding) for rid, holding, _ in self._calls.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)
