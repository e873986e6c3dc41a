"""Which bytes of a store block-layer each tensor-parallel rank of a vLLM engine moves: the rank
logic of a worker-side connector that runs in every TP rank (issue 32 item 4).

Under tensor parallelism vLLM shards attention by KV head (model_executor/layers/linear.py,
`QKVParallelLinear`), and each rank's worker allocates pages for its own heads only
(`ModelConfig.get_num_kv_heads`: max(1, H // tp) heads per rank):

- tp <= H: rank r holds heads [r * H / tp, (r + 1) * H / tp); vLLM needs H % tp == 0.
- tp > H: every rank holds one head, replicated: rank r holds head r // (tp / H) (the weight
  loader's `shard_rank = tp_rank // num_kv_head_replicas`); vLLM needs tp % H == 0.

The store's block-layer stays the whole model's, token-major [block_size, 2, H, D] (kv/layout.py),
so blocks, digests and readers do not depend on how an engine is sharded, and engines of other TP
sizes share them. A rank's part of it is, for every token and K or V, one run of its heads'
head_dim rows: 2 * block_size runs of H_r * D elements, which in order are the rank's own
token-major block-layer [block_size, 2, H_r, D], the block-layer its BlockLayerMap (built from its
own per-rank views) lands and settles. So a load reads the rank's runs straight out of the
source block-layer into the rank's pages (`landing_moves`, no staging, no head bytes another rank
owns), and a save writes the rank's unsettled block-layer into those runs of the store's
block-layer. With tp = 1 the runs merge into one. The cost of the strided split: 2 * block_size
descriptors per rank per block-layer (128 of 128 bytes at block 64, 2 heads of 64 in bf16 at
tp 2) where tp = 1 needs one; moving the whole block-layer to every rank instead would move tp
times the bytes.

Replicas (tp > H) each load their head (each rank's pages need it), but only the first replica
of a head (`saves`) writes it to the store: the ranks' saves cover every byte of a store
block-layer exactly once. A head count vLLM itself cannot shard (neither divides the other) is
refused here by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualpath_ray.runtime.transport.moves import Move, Region
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap


@dataclass(frozen=True)
class HeadRun:
    """One contiguous run of a rank's heads: bytes [store, store + nbytes) of the store's
    block-layer are bytes [local, local + nbytes) of the rank's token-major block-layer."""

    store: int
    local: int
    nbytes: int


@dataclass(frozen=True)
class TensorParallelHeads:
    """vLLM's split of `n_kv_head` KV heads over `tp` ranks (see the module doc)."""

    n_kv_head: int
    tp: int

    def __post_init__(self) -> None:
        h, tp = self.n_kv_head, self.tp
        if tp < 1 or h < 1:
            raise ValueError(f"engine.vllm_tensor_parallel_size {tp} and model.n_kv_head {h} must be at least 1")
        if (tp <= h and h % tp) or (tp > h and tp % h):
            raise ValueError(
                f"model.n_kv_head {h} cannot be sharded over engine.vllm_tensor_parallel_size {tp}: vLLM splits the KV "
                "heads evenly over the ranks (n_kv_head a multiple of the TP size) or replicates each head over TP size / "
                "n_kv_head ranks (the TP size a multiple of n_kv_head); pick a TP size that divides n_kv_head or that "
                "n_kv_head divides"
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads in each rank's pages (vLLM's get_num_kv_heads)."""
        return max(1, self.n_kv_head // self.tp)

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head: 1 unless tp > n_kv_head."""
        return max(1, self.tp // self.n_kv_head)

    def heads(self, rank: int) -> range:
        """The model's KV heads rank `rank` holds, in the order of its pages' head axis."""
        self._check(rank)
        first = (rank // self.replicas) * self.heads_per_rank
        return range(first, first + self.heads_per_rank)

    def saves(self, rank: int) -> bool:
        """Whether the rank writes its heads to the store: the first replica of each head only, so
        no store byte is written twice."""
        self._check(rank)
        return rank % self.replicas == 0

    def rank(self, rank: int, block_size: int, head_dim: int, itemsize: int) -> RankHeads:
        """The byte runs of rank `rank`'s heads in a store block-layer of this geometry."""
        heads = self.heads(rank)
        row, local_row = self.n_kv_head * head_dim * itemsize, len(heads) * head_dim * itemsize
        runs: list[HeadRun] = []
        for unit in range(2 * block_size):  # token t's K row is unit 2t, its V row unit 2t + 1
            run = HeadRun(unit * row + heads.start * head_dim * itemsize, unit * local_row, local_row)
            last = runs[-1] if runs else None
            if last is not None and last.store + last.nbytes == run.store and last.local + last.nbytes == run.local:
                runs[-1] = HeadRun(last.store, last.local, last.nbytes + run.nbytes)
            else:
                runs.append(run)
        return RankHeads(self, rank, heads, block_size, head_dim, itemsize, tuple(runs))

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ValueError(f"TP rank {rank} outside [0, {self.tp})")


@dataclass(frozen=True)
class RankHeads:
    """One rank's heads in the store's block-layers: what it loads into its own pages and what
    it saves (see the module doc)."""

    split: TensorParallelHeads
    rank: int
    heads: range
    block_size: int
    head_dim: int
    itemsize: int
    runs: tuple[HeadRun, ...]  # in the order of the rank's token-major block-layer

    @property
    def saves(self) -> bool:
        return self.split.saves(self.rank)

    @property
    def store_bytes(self) -> int:
        """Bytes of the whole model's (store) block-layer."""
        return self.block_size * 2 * self.split.n_kv_head * self.head_dim * self.itemsize

    @property
    def local_bytes(self) -> int:
        """Bytes of the rank's own token-major block-layer: its share of a store block-layer."""
        return sum(run.nbytes for run in self.runs)

    def sources(self, block_layer: Region) -> list[Region]:
        """The pieces of the store block-layer `block_layer` this rank reads, in its own
        block-layer's byte order."""
        self._check_store(block_layer.nbytes)
        return [Region(block_layer.pool, block_layer.offset + run.store, run.nbytes) for run in self.runs]

    def landing_moves(self, block_map: BlockLayerMap, pool: str, layer: int, block: int, block_layer: Region) -> list[Move]:
        """(rank's vLLM pool region, source region) pairs that land this rank's heads of the store
        block-layer `block_layer` (a remote region, token-major) in block `block` of `layer` of the
        rank's pages, for a transport read; the rank's `BlockLayerMap.settle` then makes them pages."""
        if block_map.block_layer_bytes != self.local_bytes:
            raise ValueError(
                f"TP rank {self.rank}'s pages hold block-layers of {block_map.block_layer_bytes} bytes, not the "
                f"{self.local_bytes} bytes of its {len(self.heads)} KV heads: the map is not this rank's"
            )
        return block_map.gather_moves(pool, layer, block, self.sources(block_layer))

    def save_moves(self, local: Region, block_layer: Region) -> list[Move]:
        """(local region, remote region) pairs that write this rank's token-major block-layer
        `local` (what its BlockLayerMap.unsettle read) into its runs of the remote store
        block-layer `block_layer`, for a transport write; none for a replica that does not save."""
        if local.nbytes != self.local_bytes:
            raise ValueError(f"a rank block-layer of {local.nbytes} bytes for TP rank {self.rank}'s {self.local_bytes}")
        if not self.saves:
            return []
        return [
            (Region(local.pool, local.offset + run.local, run.nbytes), piece)
            for run, piece in zip(self.runs, self.sources(block_layer))
        ]

    def take(self, block_layers: torch.Tensor) -> torch.Tensor:
        """This rank's token-major block-layers out of store block-layers (uint8 [..., store_bytes]),
        [..., local_bytes]: a copy, or a view where the rank holds every head (tp = 1)."""
        return self._heads_view(block_layers)[..., self._slice, :].reshape(*block_layers.shape[:-1], self.local_bytes)

    def place(self, local: torch.Tensor, block_layers: torch.Tensor) -> None:
        """Write this rank's token-major block-layers (uint8 [..., local_bytes], what its
        unsettle read) into its heads of store block-layers (uint8 [..., store_bytes]), in place;
        nothing for a replica that does not save."""
        if local.shape[-1] != self.local_bytes or local.shape[:-1] != block_layers.shape[:-1]:
            raise ValueError(f"rank block-layers of shape {tuple(local.shape)} for store block-layers of {tuple(block_layers.shape)}")
        if self.saves:
            view = self._heads_view(block_layers)
            view[..., self._slice, :] = local.reshape(*view.shape[:-2], len(self.heads), view.shape[-1])

    @property
    def _slice(self) -> slice:
        return slice(self.heads.start, self.heads.stop)

    def _heads_view(self, block_layers: torch.Tensor) -> torch.Tensor:
        """Store block-layers as [..., block_size, 2, H, head_dim * itemsize] bytes (a view)."""
        if block_layers.dtype != torch.uint8 or block_layers.shape[-1] != self.store_bytes:
            raise ValueError(f"store block-layers must be uint8 [..., {self.store_bytes}], not {block_layers.dtype} {tuple(block_layers.shape)}")
        return block_layers.view(*block_layers.shape[:-1], self.block_size, 2, self.split.n_kv_head, self.head_dim * self.itemsize)

    def _check_store(self, nbytes: int) -> None:
        if nbytes != self.store_bytes:
            raise ValueError(f"a store block-layer of {nbytes} bytes for block-layers of {self.store_bytes}")


def rank_heads(split: TensorParallelHeads, block_size: int, head_dim: int, dtype: torch.dtype) -> list[RankHeads]:
    """Every rank's `RankHeads` of one geometry, rank order."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return [split.rank(rank, block_size, head_dim, itemsize) for rank in range(split.tp)]

