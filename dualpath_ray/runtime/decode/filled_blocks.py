"""Where the reader pulls a decode engine's filled blocks from, to persist them: `FilledBlocks`.

A block a decode step fills is persisted by the node's reader, which pulls it from the engine's
pool registered as Pool.HBM (runtime/decode/persistence.py). Two homes of the engine's KV:

- `PagePulls`: the engine's own pages (kv/paged.py) are that pool; a filled block is pulled
  from its page, where it stays until the request leaves.
- `StagedPulls`: the KV lives in the compute's pages (runtime/compute/held_kv.py: vLLM's), in
  the compute's layout, which it may reuse once the request leaves. A filled block is read out
  token-major as it fills (the persistence digests it then) and copied into a slot of a small
  staging pool (Pool.HBM here: `runtime.max_persists_in_flight` Full Blocks) when its persist
  is posted; the slot is free again when that persist settled, or, for a request that failed,
  once every pull of it ended (`release`, which the core calls then).

`stage` answers None while too few slots are free: the persist waits for the next step, as one
the in-flight budget holds back does (slots of a failed request's pulls still running count).
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

import torch

from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.runtime.compute.held_kv import HeldKV
from dualpath_ray.runtime.decode.job import DecodeJob

Captured = Union[int, torch.Tensor]  # a page (PagePulls), or the block's copy (StagedPulls)


class FilledBlocks(Protocol):
    def capture(self, job: DecodeJob, block: int) -> tuple[Captured, torch.Tensor]:
        """The job's full block `block`: (what the persist queue keeps, its Full Block bytes)."""
        ...

    def stage(self, owner: str, blocks: Sequence[tuple[Captured, PersistedBlock]]) -> list[tuple[int, PersistedBlock]] | None:
        """The pool pages the reader pulls `blocks` from, or None: not now."""
        ...

    def settled(self, owner: str, blocks: Sequence[PersistedBlock]) -> None:
        """A persist of `blocks` ended: its pulls are over."""
        ...

    def release(self, owner: str) -> None:
        """`owner` left and no pull of it is running."""
        ...


class PagePulls:
    """The engine's own pages are the pulled pool (see the module doc)."""

    def __init__(self, pages: PagedKVPool) -> None:
        self.pages = pages

    def capture(self, job: DecodeJob, block: int) -> tuple[Captured, torch.Tensor]:
        page = self.pages.table(job.owner)[block]
        return page, self.pages.page(page)

    def stage(self, owner: str, blocks: Sequence[tuple[Captured, PersistedBlock]]) -> list[tuple[int, PersistedBlock]] | None:
        return [(int(page), persisted) for page, persisted in blocks]

    def settled(self, owner: str, blocks: Sequence[PersistedBlock]) -> None:
        return None

    def release(self, owner: str) -> None:
        return None


class StagedPulls:
    """Filled blocks read out of the compute's pages, pulled from `staging` [slots, n_layer,
    block_size, bytes] (see the module doc)."""

    def __init__(self, held: HeldKV, staging: torch.Tensor) -> None:
        self.held = held
        self.staging = staging
        self._free = list(reversed(range(len(staging))))
        self._slots: dict[tuple[str, str], int] = {}  # (owner, block key) -> its slot while pulled

    def capture(self, job: DecodeJob, block: int) -> tuple[Captured, torch.Tensor]:
        data = self.held.read_blocks(job.compute_state, [block])[0]
        return data, data

    def stage(self, owner: str, blocks: Sequence[tuple[Captured, PersistedBlock]]) -> list[tuple[int, PersistedBlock]] | None:
        if len(blocks) > len(self._free):
            return None
        staged = []
        for data, persisted in blocks:
            slot = self._free.pop()
            self.staging[slot].copy_(data)
            self._slots[(owner, persisted.key)] = slot
            staged.append((slot, persisted))
        return staged

    def settled(self, owner: str, blocks: Sequence[PersistedBlock]) -> None:
        for persisted in blocks:
            slot = self._slots.pop((owner, persisted.key), None)
            if slot is not None:
                self._free.append(slot)

    def release(self, owner: str) -> None:
        for key in [key for key in self._slots if key[0] == owner]:
            self._free.append(self._slots.pop(key))

    @property
    def free_slots(self) -> int:
        return len(self._free)
