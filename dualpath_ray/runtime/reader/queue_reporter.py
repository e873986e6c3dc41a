"""A storage reader's read queue, told to the scheduler when it changes, never on a timer.

The scheduler's read-path choice compares the read queues of a request's two nodes (paper
section 6). A reader tells the scheduler its queue when it changed, at most once per
`interval_s` (a burst of block reads is one report, not one per block), and once at start (which
also tells the scheduler this process's incarnation). An idle reader sends nothing and its
reporting thread sleeps until the queue changes.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

LOG = logging.getLogger("dualpath_ray.reader")


class QueueReporter:
    def __init__(self, read_q: Callable[[], int], send: Callable[[int], None], interval_s: float, name: str) -> None:
        self.read_q = read_q
        self.send = send
        self.interval_s = interval_s
        self.name = name
        self.sent = 0  # reports sent, for tests and benchmarks
        self._dirty = True  # the first report goes out at start
        self._stopped = False
        self._cond = threading.Condition()

    def changed(self) -> None:
        """The queue changed (called by the reader core, possibly under its own lock)."""
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def start(self) -> QueueReporter:
        threading.Thread(target=self._run, name=self.name, daemon=True).start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        last: int | None = None
        while True:
            with self._cond:
                while not self._dirty and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._dirty = False
            value = self.read_q()
            if value != last:
                try:
                    self.send(value)
                    self.sent += 1
                    last = value
                except Exception as exc:  # noqa: BLE001 - the scheduler is restarting or gone; the next change retries
                    LOG.warning("%s: read queue report failed: %r", self.name, exc)
            # The rate limit: changes meanwhile are reported together once it has passed.
            with self._cond:
                self._cond.wait_for(lambda: self._stopped, timeout=self.interval_s)
