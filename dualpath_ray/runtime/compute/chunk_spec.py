"""One request's part of a prefill batch (`ChunkSpec`): what an engine's compute is asked to compute.

Its own module so that the compute's contracts (runtime/compute/engine_compute.py, and the
continuous prefill capability, runtime/compute/continuous_prefill.py) both name it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.prefill_kv import ChunkKV


@dataclass(frozen=True)
class ChunkSpec:
    """One request's part of a prefill batch: compute tokens [start, end) of `prompt`, whose first
    `start` tokens already have KV; its span in the window starts at token `offset`."""

    prompt: np.ndarray
    start: int
    end: int
    offset: int
    # How its next token is sampled, for a compute that samples inside the batch (vLLM samples in
    # its step); the native model samples in sample_last from the params given there.
    sampling: SamplingParams | None = None
    # The request's KV key namespace (model, weights, tenant's salt): a compute with a prefix
    # cache of its own (vLLM's) shares cached KV only between requests of one namespace.
    cache_domain: str = ""
    # Where its KV comes from and goes, for a compute that moves it itself (PrefillKV: vLLM's
    # pages); None for a compute that reads and writes the engine's window slot.
    kv: ChunkKV | None = None

    @property
    def new_tokens(self) -> int:
        return self.end - self.start
