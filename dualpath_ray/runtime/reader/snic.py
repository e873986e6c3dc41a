"""A storage reader's view of its SNIC: one direction (`SnicLink`) and a read's FIFO turn on it.

The reader core never builds its links: the actor hands it the two directions of the node's SNIC
(`make_link`, runtime/emulation/links.py: paced only when emulation is on), the tests may hand in
an in-process fake (tests/fakes.py). Either way a link only needs to be charged per block
(`take`) and, when emulated, to let whole requests take turns (`turns`).
"""

from __future__ import annotations

import threading
from typing import Protocol

from dualpath_ray.runtime.emulation.links import FifoTurns


class SnicLink(Protocol):
    """One direction of a node's storage NIC, as the reader core uses it."""

    @property
    def turns(self) -> FifoTurns | None:
        """The FIFO queue of whole requests on an emulated link; None for a real (or fake) one."""
        ...

    def take(self, nbytes: int) -> None:
        """Charge nbytes to the link, waiting while an emulated link's bucket pays for them."""
        ...


class ReadTurn:
    """One request's turn on an emulated SNIC (FifoTurns): taken before its first block's bucket
    take, given up once its last block has paid (its reads then finish while the next request's
    are paced) or when the read ends early; a no-op for a real SNIC or a read of no blocks."""

    def __init__(self, turns: FifoTurns | None, blocks: int) -> None:
        self.turns = turns
        self.left = blocks
        self.ticket: int | None = None
        self._lock = threading.Lock()

    def begin(self) -> None:
        if self.turns is not None:
            self.ticket = self.turns.wait_turn()

    def took_one(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.end()

    def end(self) -> None:
        """Give the turn up; safe to call more than once (only the first call hands it on)."""
        with self._lock:
            ticket, self.ticket = self.ticket, None
        if ticket is not None and self.turns is not None:
            self.turns.done(ticket)
