"""`profile` compute: engine time from the fitted latency model, tokens and KV from stamps.

Each prefill layer of a batch sleeps the time the hardware profile predicts for the batch's
(cached, bsz) pairs, and each decode step the predicted step time, on the engine's compute
thread, so transfers overlap it exactly as they would overlap real compute. The KV it writes is
stamped from (prefix hash, layer, position), so every byte the decode side assembles can still
be checked, and tokens come from the prefix hash, so all modes produce the same outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.compute.engine_compute import (
    ChunkSpec,
    DecodeSeq,
    EngineCompute,
    PrefillBatch,
    Sampled,
    page_token_views,
)
from dualpath_ray.runtime.emulation.stamps import extend_prefix, prefix_hashes, prefix_sum, stamp_kv, stamp_token
from dualpath_ray.protocol.messages import SamplingParams


@dataclass
class _Prefix:
    """A decoding sequence's running prefix state: S of `extend_prefix` over its tokens so far."""

    total: np.uint64


class ProfileCompute(EngineCompute):
    def __init__(self, cfg: DualPathConfig, layout: KVLayout, device: torch.device) -> None:
        from dualpath_ray.model.cost import cost_of_profile
        from dualpath_ray.model.profile import load_profile_for

        self.layout = layout
        self.device = device
        self.vocab_size = cfg.model.vocab_size
        # model/cost.py: the same engine-time model the cluster simulator advances its clock by.
        self.cost = cost_of_profile(load_profile_for(cfg), layout.bytes_per_token_per_layer)

    def begin_prefill(self, chunks: Sequence[ChunkSpec]) -> PrefillBatch:
        hashes = [prefix_hashes(c.prompt[: c.end]) for c in chunks]
        return PrefillBatch(tuple(chunks), hashes)

    def prefill_layer(self, batch: PrefillBatch, layer: int, slot: torch.Tensor) -> None:
        time.sleep(self.cost.prefill_layer_ms([(c.start, c.new_tokens) for c in batch.chunks]) / 1000.0)
        for chunk, hashes in zip(batch.chunks, batch.state):
            stamped = stamp_kv(self.layout, hashes[chunk.start :], layer)
            slot[chunk.offset + chunk.start : chunk.offset + chunk.end].copy_(stamped)

    def sample_last(self, batch: PrefillBatch, which: Sequence[int], params: Sequence[SamplingParams]) -> list[Sampled]:
        return [Sampled(stamp_token(int(batch.state[i][-1]), self.vocab_size), 0.0) for i in which]

    def decode_state(self, tokens: Sequence[int], cache_domain: str = "") -> Any:
        return _Prefix(prefix_sum(np.asarray(tokens[:-1], dtype=np.int64)))

    def decode_step(self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams]) -> list[Sampled]:
        time.sleep(self.cost.decode_step_ms(len(seqs), sum(s.position for s in seqs)) / 1000.0)
        block_size = self.layout.block_size
        sampled = []
        for seq in seqs:
            prefix: _Prefix = seq.state
            prefix.total, prefix_hash = extend_prefix(prefix.total, seq.token, seq.position)
            page, offset = seq.table[seq.position // block_size], seq.position % block_size
            hashes = np.array([prefix_hash], dtype=np.uint64)
            for layer in range(self.layout.n_layer):
                pages[page, layer, offset].copy_(stamp_kv(self.layout, hashes, layer)[0])
            sampled.append(Sampled(stamp_token(prefix_hash, self.vocab_size), 0.0))
        return sampled

    def load_weights(self, source: Any) -> None:
        """Stamps do not depend on weights: nothing to load (the key namespace still moves)."""

    def fill_pages(self, prompt: np.ndarray, start: int, end: int, pages: torch.Tensor, table: Sequence[int]) -> None:
        hashes = prefix_hashes(prompt[:end])[start:]
        for layer in range(self.layout.n_layer):
            data = stamp_kv(self.layout, hashes, layer)
            offset = 0
            for view in page_token_views(pages, layer, table, start, end):
                view.copy_(data[offset : offset + view.shape[0]])
                offset += view.shape[0]
