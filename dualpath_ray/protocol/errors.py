"""Why a turn failed (`ErrorKind`), and what the scheduler and callers may do about it.

A leaf module of the protocol (protocol/messages.py re-exports it with the messages that carry it).
"""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    """Why a turn failed; the scheduler retries the retryable kinds with attempt + 1, and a
    caller may submit a `resubmittable` one again later."""

    KV_MISSING = "kv_missing"  # a hit block was gone from the store (evicted, deleted)
    KV_CORRUPT = "kv_corrupt"  # a hit block failed its checksum at read
    # A hit block's read raised the file system's I/O error on one reader (a bad sector, or that
    # node's storage client failing): read again through the other side's reader first.
    KV_UNREADABLE = "kv_unreadable"
    KV_MISMATCH = "kv_mismatch"  # assembled KV differed at the decode side (runtime.verify_kv)
    TRANSFER = "transfer"  # a KV transfer failed or timed out
    CALL_FAILED = "call_failed"  # an actor call or its reply was lost (the callee is alive)
    STORE_IO = "store_io"  # the store raised an I/O error (not a bad block)
    PEER_DIED = "peer_died"  # an engine or reader this request depended on died
    HBM_FULL = "hbm_full"  # its decode engine had no free pages for it in time (pages held by an abandoned attempt)
    STALE_WEIGHTS = "stale_weights"  # refused, nothing computed: the engine holds other weights (held_weights.py)
    TIMEOUT = "timeout"  # runtime.request_timeout_s passed
    INTERNAL = "internal"  # anything else: a bug, never retried
    # The scheduler refused to queue a new turn: scheduler.max_queued_turns turns already wait
    # for an engine. Nothing of it ran. Not retried by the scheduler (a retry there would only
    # spin against the same full queue); its caller may submit it again after a pause
    # (`resubmittable`): the rollout API does, the OpenAI endpoint answers 429 with Retry-After.
    QUEUE_FULL = "queue_full"

    @property
    def retryable(self) -> bool:
        """The scheduler itself retries it with attempt + 1 (within runtime.max_attempts)."""
        return self not in (ErrorKind.TIMEOUT, ErrorKind.INTERNAL, ErrorKind.QUEUE_FULL)

    @property
    def resubmittable(self) -> bool:
        """The turn never started: its caller may submit it again, as it is, after a pause."""
        return self is ErrorKind.QUEUE_FULL

    @property
    def about_stored_kv(self) -> bool:
        """A failure of the store's blocks, which runtime.kv_failure_policy governs."""
        return self in (ErrorKind.KV_MISSING, ErrorKind.KV_CORRUPT, ErrorKind.KV_UNREADABLE)

    @property
    def may_be_the_readers(self) -> bool:
        """The failure may be one node's (its storage client, its disk path), not the block's:
        a retry reads through the other side's reader first (SchedulerCore.next_attempt)."""
        return self in (ErrorKind.KV_UNREADABLE, ErrorKind.STORE_IO)
