"""A decode engine's request record and what its core is built from: the job's lifecycle (one
transition function), the job table its core and intake share, its ports, settings and
statistics. runtime/decode/core.py has the logic.

RESERVED (pages set aside when the scheduler placed it) -> LOADING (its prompt's KV moves from the
decode node's buffer extent into its pages) -> RUNNING (decoded in batched steps) -> FINISHING
(its last blocks are on their way to the store) -> DONE; or FAILED from any of them.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dualpath_ray.lifecycle import Lifecycle, TransitionError
from dualpath_ray.protocol.messages import DecodeHandoff, PersistedBlock, attempt_owner
from dualpath_ray.runtime.engine.cancelled import CancelledAttempts
from dualpath_ray.runtime.engine.ports import (
    Clock,
    Pending,
    ReaderPort,
    SchedulerPort,
    TransportPort,
    WeightsPort,
)
from dualpath_ray.runtime.decode.verify import ExpectedKV, KVCheck
from dualpath_ray.protocol.types import StopReason


class DecodeState(enum.Enum):
    RESERVED = "reserved"
    LOADING = "loading"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


class DecodeTransitionError(TransitionError):
    """A decode job was asked to make a move its lifecycle forbids."""


DECODE_LIFECYCLE = Lifecycle.of_targets(
    {
        DecodeState.RESERVED: {DecodeState.LOADING, DecodeState.RUNNING, DecodeState.FAILED},
        DecodeState.LOADING: {DecodeState.RUNNING, DecodeState.FAILED},
        DecodeState.RUNNING: {DecodeState.FINISHING, DecodeState.FAILED},
        DecodeState.FINISHING: {DecodeState.DONE, DecodeState.FAILED},
        DecodeState.DONE: set(),
        DecodeState.FAILED: set(),
    },
    DecodeTransitionError,
)


@dataclass(frozen=True)
class StepLimits:
    """What a running job's every decode step checks, read once from its request as it starts
    running (runtime/decode/core.py): its stop ids, where its length or the context stops it
    (`stop_at` tokens, prompt included), whether its tokens stream."""

    prompt_len: int = 0
    max_new_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_at: int = 0
    stream: bool = False

    @classmethod
    def of(cls, job: DecodeJob, max_context: int) -> StepLimits:
        assert job.handoff is not None
        spec = job.handoff.task.request
        prompt_len, max_new = len(spec.prompt), spec.sampling.max_new_tokens
        return cls(prompt_len, max_new, frozenset(spec.sampling.stop_token_ids), min(prompt_len + max_new, max_context),
                   spec.stream)


@dataclass
class DecodeJob:
    request_id: str
    attempt: int
    reserved_tokens: int
    epoch: int = 0
    state: DecodeState = DecodeState.RESERVED
    handoff: DecodeHandoff | None = None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    kv_len: int = 0
    compute_state: Any = None
    # Its pages in the engine's books as last asked (kv/paged.py `ensure`), covering its tokens
    # so far: a table only grows while the job runs, so the core asks again only past its end.
    page_table: tuple[int, ...] = ()
    limits: StepLimits = field(default_factory=StepLimits)  # set as it starts running
    load: Pending[int] | None = None
    persists: list[tuple[Pending[int], tuple[PersistedBlock, ...]]] = field(default_factory=list)
    extent_persist: Pending[int] | None = None
    extent_blocks: tuple[PersistedBlock, ...] = ()
    # Filled blocks waiting to be posted: (the page the reader pulls it from: runtime/decode/filled_blocks.py, key).
    queued: deque[tuple[int, PersistedBlock]] = field(default_factory=deque)
    parent_key: str | None = None
    chain: list[PersistedBlock] = field(default_factory=list)  # every block keyed so far, in chain order
    stored: set[str] = field(default_factory=set)  # keys of its blocks the store holds (confirmed)
    refused: bool = False  # the store refused one of its blocks: nothing after it is persisted
    stop_reason: StopReason | None = None
    check: KVCheck = field(default_factory=KVCheck)
    bad_tokens: np.ndarray | None = None  # what the first check of the landed KV found wrong
    expected_kv: ExpectedKV | None = None  # runtime.verify_kv's expected prompt KV, computed before it landed

    @property
    def owner(self) -> str:
        """This attempt's name: what owns its pages and its extents."""
        return attempt_owner(self.request_id, self.attempt, self.epoch)

    @property
    def prompt_len(self) -> int:
        assert self.handoff is not None
        return len(self.handoff.task.request.prompt)


def transition(job: DecodeJob, target: DecodeState) -> None:
    """The one way a decode job's state changes; an illegal move raises."""
    job.state = DECODE_LIFECYCLE.move(f"request {job.request_id}", job.state, target)


@dataclass(frozen=True)
class DecodeJobTable:
    """A decode engine's jobs by owner, shared by its core and its intake (runtime/decode/intake.py).
    `lock` guards the table, the intake's arrivals and claims, and `cancelled`: a claim checks the
    cancels and reserves pages under one hold of it, so a cancel or abort cannot slip between."""

    jobs: dict[str, DecodeJob]
    lock: threading.Lock
    cancelled: CancelledAttempts

    def in_states(self, *states: DecodeState) -> list[DecodeJob]:
        with self.lock:
            return [job for job in self.jobs.values() if job.state in states]


@dataclass(frozen=True)
class DecodePorts:
    readers: ReaderPort
    transport: TransportPort
    scheduler: SchedulerPort
    clock: Clock
    weights: WeightsPort


@dataclass(frozen=True)
class DecodeSettings:
    engine_id: str
    node_id: str
    max_context: int
    max_persists_in_flight: int
    transfer_timeout_s: float
    verify_kv: bool
    kv_digests: bool = True
    cancel_horizon_s: float = 900.0  # how long a cancel that found nothing is remembered


@dataclass
class DecodeStats:
    steps: int = 0
    tokens: int = 0
    max_batch: int = 0
    loads: int = 0
    persisted_blocks: int = 0
    # Blocks of served turns left unpublished: the store refused them or a block before them.
    unpublished_blocks: int = 0
    max_persists_in_flight: int = 0
    persist_waits: int = 0
    finished: int = 0
    failures: int = 0
    digest_mismatches: int = 0  # (layer, token)s of landed prompt KV that differed from its digests
    digest_reloads: int = 0  # loads done once more after a mismatch, and then right
    busy_checks: int = 0  # KV checks that waited a round for the compute's pages (ComputeBusy)
    verify_mismatches: int = 0  # attempts runtime.verify_kv failed: their assembled KV differed from store / recompute
    cancelled_handoffs: int = 0  # handoffs of attempts the scheduler had cancelled, dropped
    aborted: int = 0  # attempts dropped mid-way because their caller aborted them
    compute_s: float = 0.0  # inside the model's decode steps
