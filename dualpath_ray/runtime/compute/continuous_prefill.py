"""A compute that runs its own engine loop over prefill chunks: the `ContinuousPrefill` it offers.

vLLM schedules its own engine: requests join its waiting queue whenever they are added, and its
loop forms every step from what is running and waiting (continuous batching, chunked prefill).
A prefill engine whose compute offers this capability (`EngineCompute.continuous_prefill`:
vLLM's, runtime/vllm_engine/prefill_loop.py) does not run one batch at a time: its core
(runtime/prefill/core.py) admits READY jobs' chunks as they become ready, by the compute quota
and the window's tokens less what is already in flight (scheduling/batching.py
`pack_prefill_batch`, `running`), and collects each chunk once the compute sampled it; one of the
compute's steps may hold chunks of several admissions. Every chunk carries its `ChunkKV` (the
compute moves its KV, as a PrefillKV does).

The core calls every method from its worker thread; the compute's loop runs on a thread of its
own and calls the bound `wake` when something can be collected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from dualpath_ray.runtime.compute.chunk_spec import ChunkSpec
from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved


@dataclass(frozen=True)
class PrefillCollected:
    """One admitted chunk the compute is done with: its `ticket` (from `admit`), and either the
    token it sampled after the chunk's last token (`token`, `log_prob`; a non-final chunk's is
    not the request's and is ignored) with the digests [n_layer, end] of the KV it left on the
    decode node (None where not digested), or the `error` that failed it. A failed chunk's
    transfers have all ended: its extents may be freed."""

    ticket: str
    token: int = -1
    log_prob: float = 0.0
    digests: np.ndarray | None = None
    error: BaseException | None = None


class ContinuousPrefill(Protocol):
    """See the module doc."""

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """Called (from the compute's loop thread) whenever a chunk can be collected: the
        engine's worker sleeps until then rather than polling."""
        ...

    def admitting(self) -> bool:
        """Whether `admit` takes chunks now. False while the compute drains what it holds to
        recover from a failure that left shared state suspect (vLLM's prefix cache after a
        landing failed); the core keeps its jobs READY until it admits again."""
        ...

    def admit(self, chunks: Sequence[ChunkSpec]) -> list[str]:
        """Start computing the chunks (each with its ChunkKV); one ticket per chunk, in order.
        A chunk computes beside chunks admitted earlier and later; raising admits none."""
        ...

    def collect(self) -> list[PrefillCollected]:
        """The chunks finished (sampled or failed) since the last call, each once."""
        ...

    def take_moved(self) -> PrefillMoved:
        """The transfers the compute's steps moved since the last call (its digests unused:
        each chunk's come with it in `collect`)."""
        ...
