"""A bounded set of block keys: what a reader remembers of the blocks it damaged (fault plan) or
found bad (corrupt, unreadable), for the integrity report and its metrics.

A long-lived reader on a failing disk could otherwise grow these without bound. At most `cap`
keys are held, the oldest dropped first; `total` counts every key added that was not held, so a
counter of distinct bad blocks keeps counting past the cap (a key dropped and found bad again
counts again). Two sets of one reader compare exactly (the chaos suite checks damaged == corrupt)
while neither dropped any (`dropped == 0`): the default cap, 65536 keys (about 6 MiB), is far
above what a chaos run damages (hundreds of blocks).
"""

from __future__ import annotations

from typing import Iterator

DEFAULT_KEY_CAP = 65536


class RecentKeys:
    """Insertion-ordered, bounded; not thread-safe (the reader core's lock guards it)."""

    def __init__(self, cap: int = DEFAULT_KEY_CAP) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self.total = 0  # keys added that were not held at the time
        self.dropped = 0  # oldest keys let go to stay within the cap
        self._keys: dict[str, None] = {}

    def add(self, key: str) -> None:
        if key in self._keys:
            return
        self._keys[key] = None
        self.total += 1
        while len(self._keys) > self.cap:
            del self._keys[next(iter(self._keys))]
            self.dropped += 1

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)
