"""Bandwidth resources: NIC directions and DRAM, with FIFO queues and analytic completion times.

A `SimLink` is the runtime's token bucket (runtime/emulation/links.py) in simulated time: credit
accrues at the link's rate up to `burst` bytes, a transfer takes its bytes at once (the bucket
may go into debt) and completes when the debt is paid. With burst 0 this is a FIFO queue at the
link's rate: a transfer submitted at t completes at max(t, previous completion) + bytes / rate.
So a link needs no event of its own: `take` returns the completion time.

A transfer that crosses several resources (say an SNIC and the node's DRAM) takes each of them
(`take_all`) and completes when the slowest of them has carried its bytes: cut-through, each
resource busy for its own bytes / rate.

`ReadQueue` is a node's storage read queue as its reader reports it (read_q, paper section 6):
hit tokens waiting for the SNIC (and, on the PE path, for their buffer extent), and the unread
part of the read in service.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class SimLink:
    """One direction of one NIC, or one node's DRAM: a rate in bytes/s and a burst in bytes."""

    __slots__ = ("name", "rate", "burst", "credit", "stamp", "bytes_total", "busy_until")

    def __init__(self, name: str, rate_bytes_s: float, burst_bytes: float = 0.0) -> None:
        if rate_bytes_s <= 0 or burst_bytes < 0:
            raise ValueError(f"link {name}: rate must be > 0 and burst >= 0 (got {rate_bytes_s}, {burst_bytes})")
        self.name = name
        self.rate = float(rate_bytes_s)
        self.burst = float(burst_bytes)
        self.credit = self.burst
        self.stamp = 0.0
        self.bytes_total = 0
        self.busy_until = 0.0

    def take(self, now: float, nbytes: int) -> float:
        """Submit nbytes at `now` (never earlier than a previous take); returns when they are through."""
        if nbytes <= 0:
            return now
        self.bytes_total += nbytes
        credit = self.credit + (now - self.stamp) * self.rate
        if credit > self.burst:
            credit = self.burst
        credit -= nbytes
        self.credit = credit
        self.stamp = now
        done = now - credit / self.rate if credit < 0 else now
        if done > self.busy_until:
            self.busy_until = done
        return done


def take_all(now: float, transfers: Iterable[tuple[SimLink, int]]) -> float:
    """Submit each (link, bytes) at `now`; the transfer is through when the slowest link is."""
    done = now
    for link, nbytes in transfers:
        finished = link.take(now, nbytes)
        if finished > done:
            done = finished
    return done


class ReadQueue:
    """Hit tokens a node's reader still has to read: waiting for an extent, or for the SNIC."""

    __slots__ = ("waiting", "_reads", "_queued")

    def __init__(self) -> None:
        self.waiting = 0  # tokens of PE-path reads still waiting for a buffer extent
        self._reads: deque[tuple[float, float, int]] = deque()  # (start, done, tokens), FIFO
        self._queued = 0  # tokens of the reads in _reads

    def add_read(self, start: float, done: float, tokens: int) -> None:
        """A read of `tokens` through the SNIC from `start` (when its bytes begin) to `done`."""
        if tokens > 0:
            self._reads.append((start, done, tokens))
            self._queued += tokens

    def tokens(self, now: float) -> int:
        """read_q at `now`: reads not done, the one in service counted by what is left of it."""
        reads = self._reads
        while reads and reads[0][1] <= now:
            self._queued -= reads.popleft()[2]
        if not reads:
            return self.waiting
        start, done, tokens = reads[0]
        served = 0
        if now > start and done > start:
            served = int(tokens * (now - start) / (done - start))
        return self.waiting + self._queued - served
