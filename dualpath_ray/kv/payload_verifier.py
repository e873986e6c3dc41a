"""PayloadVerifier: threads owned by a store that checksum payloads off the reading thread.

The multi-block read pipeline (LocalDirStore.get_many_into): the caller reads block i+1 while a
verifier thread hashes block i. Both halves run without the GIL (os.readv releases it, and
python-xxhash releases it for inputs over 64 KiB), so with a spare core the reading thread pays
only the hand-off for verification, not the hash itself.

Invariants:
- every check is verified exactly once, by whichever thread claims it first (a verifier, or the
  caller when the verifiers are behind, closed or never started), so a batch never waits on a
  check nobody will run, and a starved verifier degrades the pipeline to serial verification
  rather than stalling it;
- a batch hands at most MAX_QUEUED_PER_BATCH checks to the verifiers at a time (the rest are
  verified by the caller, on the block it has just read), so the shared queue stays bounded;
- blocks are reported verified to the caller in block order, on the caller's thread, and only
  after their checksum matched;
- `drain` returns only when no verifier still reads any payload of the batch, so after a batch
  ends (normally or by an error) no store thread touches the caller's buffers.

Lifecycle: IDLE (no threads) -> RUNNING (threads started by the first submit) -> CLOSED; IDLE ->
CLOSED. After close the batches still work, verified on the caller's thread.
"""

from __future__ import annotations

import enum
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Final

from dualpath_ray.kv.block_format import verify_payload
from dualpath_ray.kv.block_store import BlockHook

# Hashing runs ~4x faster than copying from the page cache, so two queued checks keep a verifier
# busy while the caller reads; more would only let a starved verifier fall further behind.
MAX_QUEUED_PER_BATCH: Final = 2


class VerifierState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    CLOSED = "closed"


class VerifierEvent(enum.Enum):
    START = "start"
    CLOSE = "close"


_MOVES = {
    (VerifierState.IDLE, VerifierEvent.START): VerifierState.RUNNING,
    (VerifierState.IDLE, VerifierEvent.CLOSE): VerifierState.CLOSED,
    (VerifierState.RUNNING, VerifierEvent.CLOSE): VerifierState.CLOSED,
}


class VerifierTransitionError(RuntimeError):
    """The verifier was asked to make a move its lifecycle forbids."""


def transition(current: VerifierState, event: VerifierEvent) -> VerifierState:
    """The one place verifier moves are decided: the next state, or VerifierTransitionError."""
    target = _MOVES.get((current, event))
    if target is None:
        raise VerifierTransitionError(f"payload verifier: {event.value} is illegal in state {current.name}")
    return target


_Result = tuple[int, BaseException | None]


class PendingCheck:
    """One payload waiting for its checksum; whoever claims it first verifies it."""

    __slots__ = ("index", "_payload", "_expected", "_where", "_claim", "_results")

    def __init__(
        self, index: int, payload: memoryview, expected: int, where: str, results: queue.SimpleQueue[_Result]
    ) -> None:
        self.index = index
        self._payload = payload
        self._expected = expected
        self._where = where
        self._claim = threading.Lock()
        self._results = results

    def claim(self) -> bool:
        return self._claim.acquire(blocking=False)

    def run(self) -> None:
        """Verify (the claimer only) and post (index, error or None) to the batch's results."""
        error: BaseException | None = None
        try:
            verify_payload(self._payload, self._expected, self._where)
        except BaseException as exc:
            error = exc
        self._payload = memoryview(b"")
        self._results.put((self.index, error))


def _serve(checks: queue.SimpleQueue[PendingCheck | None]) -> None:
    """A verifier thread: run every check it claims until it dequeues the stop sentinel."""
    while (check := checks.get()) is not None:
        if check.claim():
            check.run()


def _stop(checks: queue.SimpleQueue[PendingCheck | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        checks.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class PayloadVerifier:
    """A small persistent pool of checksum threads, started on first use, stopped by close()."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 0:
            raise ValueError(f"verify_threads must be >= 0 (0 verifies on the reading thread), got {threads}")
        self._size = threads
        self._name = name
        self._state = VerifierState.IDLE
        self._lock = threading.Lock()
        self._checks: queue.SimpleQueue[PendingCheck | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # The threads hold only the queue, so an unclosed store is still collected, and this
        # finalizer stops its threads then.
        self._finalizer = weakref.finalize(self, _stop, self._checks, self._threads)

    @property
    def state(self) -> VerifierState:
        return self._state

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def batch(self, on_verified: BlockHook | None) -> VerifyBatch:
        return VerifyBatch(self._submit, on_verified)

    def close(self) -> None:
        """Stop the threads after the checks already queued (idempotent)."""
        with self._lock:
            if self._state is VerifierState.CLOSED:
                return
            self._state = transition(self._state, VerifierEvent.CLOSE)
        self._finalizer()

    def _submit(self, check: PendingCheck) -> bool:
        """Queue `check` for the threads (starting them once); False if closed or sized 0."""
        if not self._size:
            return False
        with self._lock:
            if self._state is VerifierState.IDLE:
                self._start()
            if self._state is not VerifierState.RUNNING:
                return False
        self._checks.put(check)
        return True

    def _start(self) -> None:
        self._state = transition(self._state, VerifierEvent.START)
        for i in range(self._size):
            thread = threading.Thread(target=_serve, args=(self._checks,), name=f"{self._name}-verify-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)


class VerifyBatch:
    """The checks of one multi-block read: added in block order, reported verified in order."""

    def __init__(self, submit: Callable[[PendingCheck], bool], on_verified: BlockHook | None) -> None:
        self._submit = submit
        self._on_verified = on_verified
        self._results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._queued: dict[int, PendingCheck] = {}
        self._outcomes: dict[int, BaseException | None] = {}
        self._outstanding = 0
        self._first_failure: int | None = None
        # Blocks [0, verified) passed their checksum and were reported to on_verified.
        self.verified = 0

    @property
    def failed(self) -> bool:
        return self._first_failure is not None

    def add(self, index: int, payload: memoryview, expected: int, where: str) -> None:
        """Verify block `index` (the next in order): on a verifier, or here if they are behind."""
        check = PendingCheck(index, payload, expected, where, self._results)
        self._outstanding += 1
        if len(self._queued) < MAX_QUEUED_PER_BATCH and self._submit(check):
            self._queued[index] = check
        elif check.claim():
            check.run()
        self._collect(wait=False)
        self._report()

    def finish(self) -> None:
        """Verify what is left, report it, and raise the error of the first failing block."""
        self.drain()
        self._report()
        if self._first_failure is not None:
            raise self._outcomes[self._first_failure]  # type: ignore[misc]

    def drain(self) -> None:
        """Return once no check of this batch is pending: run unclaimed ones here, wait for the rest."""
        for check in list(self._queued.values()):
            if check.claim():
                check.run()
        self._collect(wait=False)
        while self._outstanding:
            self._collect(wait=True)

    def _collect(self, wait: bool) -> None:
        while self._outstanding and (wait or not self._results.empty()):
            index, error = self._results.get()
            wait = False
            self._outstanding -= 1
            self._queued.pop(index, None)
            self._outcomes[index] = error
            if error is not None and (self._first_failure is None or index < self._first_failure):
                self._first_failure = index

    def _report(self) -> None:
        while self.verified in self._outcomes and self._outcomes[self.verified] is None:
            del self._outcomes[self.verified]
            self.verified += 1
            if self._on_verified is not None:
                self._on_verified(self.verified - 1)
