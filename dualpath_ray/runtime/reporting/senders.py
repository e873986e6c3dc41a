"""What a report channel server remembers of its senders: the last frame it handled from each,
so that a frame sent again after a reconnect is handled once (runtime/reporting/channel.py).

Every sending process has its own client id (a restarted engine is a new sender), so the table
would grow by one entry per process ever seen. It is trimmed when a new sender arrives (the only
moment it grows): a sender with no open connection is forgotten once it has been idle for
`forget_after_s`, or earlier, oldest first, while the table holds `capacity` senders. A sender
with an open connection is never forgotten (its frames are being numbered against its entry).

Why forgetting keeps the exactly-once rule where it matters: a live sender reconnects within
about a second (ReportClient's backoff) of losing its connection, far inside the horizon, and
finds its entry. A forgotten sender that comes back is taken as new: its first frame's number
starts it again, so of its frames only the ones the server handled but had not acknowledged when
the connection broke can be handled a second time; after forget_after_s (an hour by default,
far beyond the watchdog's runtime.heartbeat_timeout_s) the scheduler has long failed that
sender's attempts, and a result of an attempt that is no longer current is counted stale and
dropped (Attempts.complete), a reader's queue report is a state. Counting by capacity instead
would only forget the longest idle first: with 65,536 entries that takes as many processes
started and gone within the horizon.
"""

from __future__ import annotations

from collections import OrderedDict


class SequenceGap(ValueError):
    """A frame numbered beyond the next one its sender owes: refused, never handled."""


class Senders:
    """Client id -> the highest sequence number handled, trimmed as the module says. Pure: the
    caller passes the time (its event loop's clock)."""

    def __init__(self, forget_after_s: float, capacity: int) -> None:
        self.forget_after_s = forget_after_s
        self.capacity = capacity
        self.handled: dict[bytes, int] = {}
        self.forgotten = 0  # senders trimmed away
        self.given_up = 0  # frames senders gave up before this server had them (see `begin`)
        self._live: dict[bytes, int] = {}  # client id -> open connections (a reconnect may overlap the old one's end)
        self._idle: OrderedDict[bytes, float] = OrderedDict()  # no open connection: since when, oldest first

    def begin(self, client_id: bytes, first: int, now: float) -> None:
        """A connection of `client_id` authenticated; its first frame is numbered `first`.

        A sender new to this server (a restarted scheduler, or one that forgot it) starts at
        `first`. A known sender whose `first` lies beyond its next frame gave the frames between
        up (ReportClient's MAX_UNACKED, while no scheduler took them): they were never handled
        here, and their senders were told so; the count starts after them, or every later frame
        would be refused."""
        known = self.handled.get(client_id)
        if known is None:
            self._trim(now)
            self.handled[client_id] = first - 1
        elif first > known + 1:
            self.given_up += first - 1 - known
            self.handled[client_id] = first - 1
        self._idle.pop(client_id, None)
        self._live[client_id] = self._live.get(client_id, 0) + 1

    def end(self, client_id: bytes, now: float) -> None:
        """A connection of `client_id` (one `begin` counted) closed."""
        left = self._live[client_id] - 1
        if left:
            self._live[client_id] = left
            return
        del self._live[client_id]
        self._idle[client_id] = now

    def take(self, client_id: bytes, seq: int) -> bool:
        """True if frame `seq` of a connected sender is to be handled now (its next one); False
        if it was handled already (sent again after a reconnect). SequenceGap past the next one:
        a connection's frames are numbered on from its `begin`, one by one, so a gap is a broken
        or forged sender, and handling it would make the server skip that sender's real frames."""
        last = self.handled[client_id]
        if seq <= last:
            return False
        if seq != last + 1:
            raise SequenceGap(f"frame {seq} where {last + 1} was due")
        self.handled[client_id] = seq
        return True

    def _trim(self, now: float) -> None:
        while self._idle:
            client_id, since = next(iter(self._idle.items()))
            if now - since <= self.forget_after_s and len(self.handled) < self.capacity:
                return
            del self._idle[client_id]
            del self.handled[client_id]
            self.forgotten += 1
