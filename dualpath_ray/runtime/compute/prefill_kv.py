"""A compute that keeps a prefill batch's KV in pages of its own: the `PrefillKV` it offers.

vLLM's engine computes a prefill batch in the pages it allocates for the batch's requests. A
prefill engine whose compute offers a PrefillKV (`EngineCompute.prefill_kv`,
runtime/vllm_engine/compute.py) keeps no layer window of KV: each chunk of a batch names where
its past KV lies and where its KV goes (`ChunkKV`, buffer extents of the readers, the store's
Full Block format), and the compute moves it through the transport itself, straight between
those extents and its pages, layer by layer inside its forward. The engine never asks which
compute it has, only whether it offers this; it reads back what moved (`PrefillMoved`) for its
counters, its statistics and the digests it hands the decode engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class KVSpan:
    """Tokens [lo, hi) of a request's KV in the buffer extent of reader endpoint `peer`, pool
    `pool`: the request's block i is the Full Block [n_layer, block_size, bytes] at byte offset
    `blocks[i]`. `side` names the counter side its bytes count on ("pe" or "de")."""

    peer: str
    pool: str
    blocks: tuple[int, ...]
    lo: int
    hi: int
    side: str


@dataclass(frozen=True)
class ChunkKV:
    """Where one chunk's KV comes from and goes.

    `past`: the spans holding its past KV [0, start) (loaded into the compute's pages before
    the layer that attends over it). `sent`: the spans its KV goes to (the decode node's
    extent: the new tokens, on a first PE-path chunk the hits too). `digests` [n_layer, >= start]:
    what the past KV was verified as (checked on landing; None when runtime.kv_digests is off).
    `oracle` (oracle mode): the whole prompt's KV [n_layer, prompt, bytes] in host memory,
    the past copied from it and the new KV copied into it, nothing moved."""

    past: tuple[KVSpan, ...] = ()
    sent: tuple[KVSpan, ...] = ()
    digests: np.ndarray | None = None
    oracle: torch.Tensor | None = None


@dataclass
class PrefillMoved:
    """What one batch moved: transfers, bytes, their counter sides, and each chunk's digests
    [n_layer, end] of the KV it leaves on the decode node (None where not digested)."""

    reads: int = 0
    writes: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    block_layers_in: int = 0  # (block, layer)s of past KV landed (each one block-layer of bytes)
    cnic_in: dict[str, int] = field(default_factory=dict)
    cnic_out: dict[str, int] = field(default_factory=dict)
    digest_mismatches: int = 0
    digest_rereads: int = 0
    wait_in_s: float = 0.0
    wait_out_s: float = 0.0
    max_transfers_per_layer_peer: int = 0
    layers: int = 0
    digests: list[np.ndarray | None] = field(default_factory=list)


class PrefillKV(Protocol):
    """A prefill batch's KV in the compute's own pages (see the module doc). Chunks that carry
    a `ChunkKV` (ChunkSpec.kv) are moved by the compute; `moved` reads what a batch moved once
    its `sample_last` returned."""

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The compute's whole KV memory, flat: the one transport pool KV moves in and out of."""
        ...

    def bind(self, transport: Any, pool: str) -> None:
        """The transport `kv_buffer` is registered with, under `pool`."""
        ...

    def bind_links(self, take_in: Callable[[int], None], take_out: Callable[[int], None]) -> None:
        """The engine's NIC directions: every transfer's bytes are taken from them as it is
        posted (an emulated link paces them)."""
        ...

    def moved(self, batch: Any) -> PrefillMoved:
        """What the batch (a PrefillBatch) moved, after its sample_last."""
        ...
