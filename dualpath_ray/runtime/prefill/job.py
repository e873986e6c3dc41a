"""A prefill engine's request record and what its core is built from: the job's lifecycle (one
transition function), its ports and settings. runtime/prefill/core.py has the logic and
runtime/prefill/pipeline.py runs a batch of jobs layer by layer; both import the job from here,
so neither imports the other's caller.

READING_HITS (the readers lease and fill its extents) -> READY -> BATCHED -> HANDED_OFF, or back to
READY after a chunk that does not end its prompt, or FAILED from any state before the handoff.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath_ray.lifecycle import Lifecycle, TransitionError
from dualpath_ray.protocol.messages import ExtentGrant, PrefillTask
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.engine.ports import (
    Clock, DecodePort, Pending, ReaderPort, SchedulerPort, TransportPort, WeightsPort,
)


class PrefillState(enum.Enum):
    READING_HITS = "reading_hits"
    READY = "ready"
    BATCHED = "batched"
    HANDED_OFF = "handed_off"
    FAILED = "failed"


class PrefillTransitionError(TransitionError):
    """A prefill job was asked to make a move its lifecycle forbids."""


PREFILL_LIFECYCLE = Lifecycle.of_targets(
    {
        PrefillState.READING_HITS: {PrefillState.READY, PrefillState.FAILED},
        PrefillState.READY: {PrefillState.BATCHED, PrefillState.FAILED},
        PrefillState.BATCHED: {PrefillState.READY, PrefillState.HANDED_OFF, PrefillState.FAILED},
        PrefillState.HANDED_OFF: set(),
        PrefillState.FAILED: set(),
    },
    PrefillTransitionError,
)


@dataclass
class PrefillJob:
    """One request on this engine, from assignment to handoff."""

    task: PrefillTask
    prompt: np.ndarray
    state: PrefillState = PrefillState.READING_HITS
    computed: int = 0
    # Each side's extent in flight while READING_HITS: read_hits (or, the DE side of a PE-path
    # request, a lease); both become `pe`/`de` once every one is done.
    reads: dict[ReadPath, Pending[ExtentGrant]] = field(default_factory=dict)
    pe: ExtentGrant | None = None
    de: ExtentGrant | None = None
    oracle_kv: torch.Tensor | None = None
    # Digests [n_layer, computed] of the KV of tokens [0, computed) as last verified or computed
    # (None: runtime.kv_digests is off); the first chunk's come from the reader's grant.
    digests: np.ndarray | None = None
    chunks: int = 0

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def owner(self) -> str:
        return self.task.request.owner


def transition(job: PrefillJob, target: PrefillState) -> None:
    """The one way a prefill job's state changes; an illegal move raises."""
    job.state = PREFILL_LIFECYCLE.move(f"request {job.request_id}", job.state, target)


@dataclass(frozen=True)
class PrefillPorts:
    readers: ReaderPort
    transport: TransportPort
    scheduler: SchedulerPort
    decode: DecodePort
    clock: Clock
    weights: WeightsPort


@dataclass(frozen=True)
class PrefillSettings:
    engine_id: str
    node_id: str
    reader: str
    quota_ms: float
    transfer_timeout_s: float
    kv_digests: bool = True
    cancel_horizon_s: float = 900.0  # how long a cancel is remembered (see runtime/engine/cancelled.py)
