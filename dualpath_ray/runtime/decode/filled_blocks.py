"""Where the reader pulls a decode engine's filled blocks from, to persist them: `FilledBlocks`.

A block a decode step fills is persisted by the node's reader, which pulls it from the engine's
KV memory (runtime/decode/persistence.py). Two homes of that KV:

- `PagePulls`: the engine's own pages (kv/paged.py), registered as Pool.HBM, one Full Block
  each; a filled block is pulled from its page, where it stays until the request leaves.
- `HeldPulls`: the KV lives in the compute's pages (runtime/compute/held_kv.py: vLLM's), in the
  compute's layout, registered as Pool.COMPUTE_KV. A filled block is pulled straight from the
  compute's page, run by run, and made token-major in the reader's buffer slot (`paged`,
  kv/paged_block_layers.py): no copy of it is kept on the engine. The compute holds the page
  until the request's compute state is released, which the core does only once no pull of the
  request may still read it (runtime/decode/core.py `_forget`).

`read` is blocks' Full Block bytes as the engine holds them (digested when one fills, and
written by oracle mode in place): the pages themselves for PagePulls, token-major copies read
from the compute's pages for HeldPulls (one gather per layer for all of them).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.runtime.compute.held_kv import HeldKV
from dualpath_ray.runtime.decode.job import DecodeJob


class FilledBlocks(Protocol):
    @property
    def paged(self) -> PagedBlockLayers | None:
        """How the pulled pages lie (None: Full Block pages of Pool.HBM)."""
        ...

    def capture(self, job: DecodeJob, block: int) -> int:
        """The page the reader pulls the job's full block `block` from."""
        ...

    def read(self, job: DecodeJob, blocks: Sequence[int]) -> Sequence[torch.Tensor]:
        """The job's full blocks `blocks`, each as Full Block bytes [n_layer, block_size, bytes]."""
        ...


class PagePulls:
    """The engine's own pages are the pulled pool (see the module doc)."""

    paged = None

    def __init__(self, pages: PagedKVPool) -> None:
        self.pages = pages

    def capture(self, job: DecodeJob, block: int) -> int:
        return int(self.pages.table(job.owner)[block])

    def read(self, job: DecodeJob, blocks: Sequence[int]) -> Sequence[torch.Tensor]:
        table = self.pages.table(job.owner)
        return [self.pages.page(table[block]) for block in blocks]


class HeldPulls:
    """The compute's own pages are the pulled pool, `pool` its name (see the module doc)."""

    def __init__(self, held: HeldKV, pool: str) -> None:
        self.held = held
        self.paged: PagedBlockLayers | None = held.paged_blocks(pool)

    def capture(self, job: DecodeJob, block: int) -> int:
        return self.held.block_pages(job.compute_state, [block])[0]

    def read(self, job: DecodeJob, blocks: Sequence[int]) -> Sequence[torch.Tensor]:
        return self.held.read_blocks(job.compute_state, blocks) if blocks else []
