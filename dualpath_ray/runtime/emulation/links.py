"""Emulated NIC bandwidth: a token bucket per NIC direction, and an exact byte counter.

Every NIC is full duplex, so each has one bucket per direction: a node's SNIC one for hit-KV
reads and one for persists, each engine's CNIC one in and one out. With emulation off, `Link.take` only counts and returns at
once: the real hardware sets the pace.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dualpath_ray.config import DualPathConfig


class TokenBucket:
    """A byte-rate limiter: `take(n)` blocks until n bytes of credit have accrued.

    Credit accrues at `rate_bytes_s` up to `burst_bytes`; a take larger than the burst is paid in
    full (the bucket goes into debt), so large transfers are not starved and the long-run rate is
    exact. Thread-safe: the reader and engine actors call it from several threads.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: float) -> None:
        if rate_bytes_s <= 0 or burst_bytes <= 0:
            raise ValueError("rate_bytes_s and burst_bytes must be positive")
        self.rate = float(rate_bytes_s)
        self.burst = float(burst_bytes)
        self._credit = self.burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Reserve nbytes and sleep until they are paid for; returns seconds waited."""
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._credit = min(self.burst, self._credit + (now - self._stamp) * self.rate)
            self._stamp = now
            self._credit -= nbytes
            wait = -self._credit / self.rate if self._credit < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


class FifoTurns:
    """Requests take turns on an emulated link, one at a time, in the order they asked.

    A bucket shared by concurrent requests block by block serves them all at once (processor
    sharing): a wave of reads finishes together and the link then idles while that wave computes.
    A storage reader's queue is FIFO (the paper's read_q, and the simulator's link): the first
    request finishes first and its compute overlaps the reads behind it. Holding a turn costs
    nothing when the link is not emulated; real hardware sets its own order.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def wait_turn(self) -> int:
        """Block until every earlier ticket is done; returns this turn's ticket."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._cond.wait()
            return ticket

    def done(self, ticket: int) -> None:
        """End turn `ticket` (the one being served); the next in line starts."""
        with self._cond:
            if ticket != self._serving:
                raise RuntimeError(f"turn {ticket} ended while turn {self._serving} is being served")
            self._serving += 1
            self._cond.notify_all()


@dataclass
class Link:
    """One NIC direction: an optional bucket plus an exact byte counter. An emulated link
    also has `turns`, for callers that queue whole requests on it in FIFO order."""

    name: str
    bucket: TokenBucket | None = None
    turns: FifoTurns | None = None
    bytes_total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_total += nbytes
        if self.bucket is not None:
            self.bucket.take(nbytes)


def gbps_to_bytes_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def make_link(cfg: DualPathConfig, name: str, gbps: float) -> Link:
    """A NIC direction at `gbps`, paced only when emulation is enabled."""
    if not cfg.emulation.active():
        return Link(name)
    rate = gbps_to_bytes_s(gbps)
    return Link(name, TokenBucket(rate, rate * cfg.emulation.burst_seconds), FifoTurns())
