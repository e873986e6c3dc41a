"""Idle expiry of what the serving side keeps per caller-chosen key: a conversation's turn
numbering (api/sessions.py) and an aborted trajectory's mark (runtime/control/aborts.py).

Such keys come from callers (session ids, trajectory prefixes), so without expiry the tables
holding them grow with every conversation ever seen. A key not used for `ttl_s` is forgotten.
Keys are kept in the order of their last use, so a sweep stops at the first key still fresh:
forgetting costs O(1) per key forgotten, and a use costs O(1). The clock is a parameter (the
actors pass time.monotonic, unit tests a fake one).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator


class IdleExpiry:
    """The keys in use and when each was last used; `sweep` forgets those idle for `ttl_s`."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if not ttl_s > 0:
            raise ValueError(f"an idle expiry needs ttl_s > 0 (got {ttl_s!r}); set runtime.session_ttl_s above 0")
        self.ttl_s = ttl_s
        self.clock = clock
        self._last_use: OrderedDict[str, float] = OrderedDict()

    def touch(self, key: str) -> None:
        """`key` is used now (kept, or added)."""
        self._last_use[key] = self.clock()
        self._last_use.move_to_end(key)

    def sweep(self) -> list[str]:
        """Forget every key idle for `ttl_s` or longer; returns them, oldest first."""
        horizon = self.clock() - self.ttl_s
        forgotten = []
        while self._last_use:
            key, used = next(iter(self._last_use.items()))
            if used > horizon:
                break  # later keys were used later still
            del self._last_use[key]
            forgotten.append(key)
        return forgotten

    def discard(self, key: str) -> None:
        self._last_use.pop(key, None)

    def clear(self) -> None:
        self._last_use.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._last_use

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._last_use))

    def __len__(self) -> int:
        return len(self._last_use)
