"""A compute that keeps a decode engine's KV in pages of its own: the `HeldKV` it offers.

vLLM's engine allocates, fills and frees its own KV pages; a decode engine whose compute offers
a HeldKV (`EngineCompute.held_kv`, runtime/vllm_engine/compute.py) keeps no page memory of its
own (runtime/decode/actor.py): its page pool keeps only the books (reservations, which the
scheduler's admission counts), the prompt's KV lands straight in the compute's pages from the
decode node's buffer extent, the node's reader pulls filled blocks straight from them
(`paged_blocks`: how they lie; runtime/decode/filled_blocks.py) and the KV checks read full
blocks back from them, token-major (the store's Full Block format, kv/layout.py). The compute
keeps a sequence's pages until `EngineCompute.release` of its state, which the engine calls only
once no pull of them may still run. The engine never asks which compute it has, only whether
it offers this.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.messages import SamplingParams


class PromptLanding(Protocol):
    """A prompt's KV on its way into the compute's pages (a transfer: polled, never signalled)."""

    def done(self) -> bool:
        """Whether it landed; raises what failed it."""
        ...

    def wait(self, timeout_s: float | None = None) -> int:
        """Bytes moved, once landed; raises what failed it (TimeoutError past `timeout_s`)."""
        ...


class HeldKV(Protocol):
    """Decode sequences' KV in the compute's own pages. `state` is the compute's per-sequence
    state (`EngineCompute.decode_state`)."""

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The compute's whole KV memory, flat: the one transport pool the prompts land in."""
        ...

    def bind(self, transport: Any, pool: str) -> None:
        """The transport `kv_buffer` is registered with, under `pool`: what prompt loads use."""
        ...

    def load_prompt(
        self, state: Any, sampling: SamplingParams, peer: str, pool: str, offsets: Sequence[int],
    ) -> PromptLanding:
        """Start the sequence: its KV for every token but the last lies at `peer`'s `pool`, one
        Full Block per offset (a buffer extent), and lands straight in the pages the compute
        allocates for it."""
        ...

    def compute_prompts(self, states: Sequence[Any], sampling: Sequence[SamplingParams]) -> None:
        """Start these sequences with their KV computed here (oracle mode's handoffs): every
        token but the last has KV in the compute's pages when this returns. ComputeBusy: no
        pages for them yet; calling again with the same sequences carries on."""
        ...

    def read_blocks(self, state: Any, blocks: Sequence[int]) -> torch.Tensor:
        """A copy of the sequence's full blocks `blocks` as Full Blocks [len(blocks), n_layer,
        block_size, bytes] uint8, token-major: what the store holds for them."""
        ...

    def block_pages(self, state: Any, blocks: Sequence[int]) -> list[int]:
        """The compute's pages holding the sequence's full blocks `blocks` (what a reader pulls)."""
        ...

    def paged_blocks(self, pool: str) -> PagedBlockLayers:
        """How a page's block-layers lie in `kv_buffer`, registered as `pool`: what the node's
        reader pulls a filled block by (kv/paged_block_layers.py)."""
        ...
