"""ReadHelpers: store-owned threads that read and verify the blocks of a batch beside the caller.

A multi-block read (LocalDirStore.get_many_into) is split by block, not by stage: the caller and
the helpers each claim the next unread block, read it (os.readv, GIL released) and verify its
checksum (python-xxhash releases the GIL for inputs over 64 KiB) on the same thread, so while
one thread checksums block i another is already reading block i+1. Verifying on the thread that
read a block keeps the hash on bytes still in that core's cache; handing each block to a
hash-only thread instead was measured slower on the project machine, and slower than serial when
the second core is busy (benchmarks/README.md, "Store read").

Invariants:
- blocks are claimed in increasing order, so when block j fails every block before it has been
  claimed and completes, and the batch raises for the first failing block in key order;
- no claims are made after a failure or after the caller stops the batch, and `stop` returns only
  when no thread still reads into or hashes any buffer of the batch;
- blocks are reported verified on the caller's thread, in block order, only after their checksum
  matched;
- the caller never waits for a helper that has not claimed a block (it claims whatever is left),
  so a busy, closed or never-started helper pool only makes a batch serial, never stalls it;
- jobs are queued only for idle helpers and carry no data, so the queue never holds more jobs
  than there are helpers: memory does not grow with the batch, the number of batches, or a
  slow helper.

Lifecycle of the pool: IDLE (no threads) -> RUNNING (threads started by the first batch that
asks for help) -> CLOSED; IDLE -> CLOSED. After close, batches run on the caller's thread.
"""

from __future__ import annotations

import enum
import queue
import threading
import weakref
from collections.abc import Callable

from dualpath_ray.kv.block_store import BlockHook
from dualpath_ray.lifecycle import Lifecycle, TransitionError

# Reads block i into its out and verifies it; raises if the block is missing or bad.
BlockRead = Callable[[int], None]

_Job = Callable[[], None]
_Result = tuple[int, BaseException | None]


class HelperState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    CLOSED = "closed"


class HelperEvent(enum.Enum):
    START = "start"
    CLOSE = "close"


class HelperTransitionError(TransitionError):
    """The helper pool was asked to make a move its lifecycle forbids."""


HELPER_LIFECYCLE = Lifecycle(
    moves={
        (HelperState.IDLE, HelperEvent.START): HelperState.RUNNING,
        (HelperState.IDLE, HelperEvent.CLOSE): HelperState.CLOSED,
        (HelperState.RUNNING, HelperEvent.CLOSE): HelperState.CLOSED,
    },
    error=HelperTransitionError,
)


def transition(current: HelperState, event: HelperEvent) -> HelperState:
    """The one place pool moves are decided: the next state, or HelperTransitionError."""
    return HELPER_LIFECYCLE.move("read helpers", current, event)


class _JobBoard:
    """What the helper threads share with their pool: the job queue and the idle count.

    A job is queued only for a helper counted idle, so the queue never holds more jobs than
    there are helpers, whatever the number of batches or how busy the helpers are.
    """

    def __init__(self, size: int) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = size

    def post(self, job: _Job, count: int) -> int:
        with self.lock:
            count = max(0, min(count, self.idle))
            self.idle -= count
        for _ in range(count):
            self.jobs.put(job)
        return count

    def serve(self) -> None:
        """A helper thread: run jobs until the stop sentinel. Jobs report their own errors."""
        while (job := self.jobs.get()) is not None:
            job()
            with self.lock:
                self.idle += 1


def _stop(board: _JobBoard, threads: list[threading.Thread]) -> None:
    for _ in threads:
        board.jobs.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class ReadHelpers:
    """A small persistent pool of helper threads, started on first use, stopped by close()."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 0:
            raise ValueError(f"read_threads must be >= 0 (0 reads on the caller's thread only), got {threads}")
        self.size = threads
        self._name = name
        self._state = HelperState.IDLE
        self._lock = threading.Lock()
        self._board = _JobBoard(threads)
        self._threads: list[threading.Thread] = []
        # The threads hold only the board, so an unclosed store is still collected, and this
        # finalizer stops its threads then.
        self._finalizer = weakref.finalize(self, _stop, self._board, self._threads)

    @property
    def state(self) -> HelperState:
        return self._state

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def offer(self, job: _Job, count: int) -> int:
        """Queue `job` for up to `count` idle helpers (starting the threads once); returns how many."""
        if min(count, self.size) <= 0:
            return 0
        with self._lock:
            if self._state is HelperState.IDLE:
                self._start()
            if self._state is not HelperState.RUNNING:
                return 0
        return self._board.post(job, count)

    def close(self) -> None:
        """Stop the threads once they finish the jobs already queued (idempotent)."""
        with self._lock:
            if self._state is HelperState.CLOSED:
                return
            self._state = transition(self._state, HelperEvent.CLOSE)
        self._finalizer()

    def _start(self) -> None:
        self._state = transition(self._state, HelperEvent.START)
        for i in range(self.size):
            thread = threading.Thread(target=self._board.serve, name=f"{self._name}-read-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)


class BatchRead:
    """Blocks 0..n-1 of one get_many_into, claimed in order by the caller and the helpers."""

    def __init__(self, n_blocks: int, read_block: BlockRead, on_verified: BlockHook | None) -> None:
        self._n = n_blocks
        self._read_block = read_block
        self._on_verified = on_verified
        self._lock = threading.Lock()
        self._stopped = False
        self._results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._outcomes: dict[int, BaseException | None] = {}
        self._failures: dict[int, BaseException] = {}
        self._collected = 0
        # Blocks [0, claimed) were handed to a thread; [0, verified) passed and were reported.
        self.claimed = 0
        self.verified = 0

    def run(self, helpers: ReadHelpers) -> None:
        """Read every block with the helpers' help; raise for the first failing block."""
        helpers.offer(self._help, self._n - 1)
        while (index := self._claim()) is not None:
            self._read(index)
            self._collect(wait=False)
            self._report()
        self.stop()
        self._report()
        if self._failures:
            raise self._failures[min(self._failures)]

    def failures(self) -> list[tuple[int, BaseException]]:
        """Every block found bad so far (after `stop`: every one), in key order."""
        return sorted(self._failures.items())

    def stop(self) -> None:
        """Make no more claims and return once every claimed block has completed."""
        with self._lock:
            self._stopped = True
        while self._collected < self.claimed:
            self._collect(wait=True)

    def _help(self) -> None:
        while (index := self._claim()) is not None:
            self._read(index)

    def _claim(self) -> int | None:
        with self._lock:
            if self._stopped or self.claimed >= self._n:
                return None
            self.claimed += 1
            return self.claimed - 1

    def _read(self, index: int) -> None:
        """Read and verify one block, posting (index, error or None); never raises."""
        error: BaseException | None = None
        try:
            self._read_block(index)
        except BaseException as exc:
            error = exc
            with self._lock:
                self._stopped = True
        self._results.put((index, error))

    def _collect(self, wait: bool) -> None:
        while self._collected < self.claimed and (wait or not self._results.empty()):
            index, error = self._results.get()
            wait = False
            self._collected += 1
            self._outcomes[index] = error
            if error is not None:
                self._failures[index] = error

    def _report(self) -> None:
        while self.verified in self._outcomes and self._outcomes[self.verified] is None:
            del self._outcomes[self.verified]
            self.verified += 1
            if self._on_verified is not None:
                self._on_verified(self.verified - 1)
