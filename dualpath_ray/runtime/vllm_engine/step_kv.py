"""What the connector (connector.py) and a step's KV moves (steps.py) say to each other, without
vLLM: the request parameters the host sets, one scheduled request, and the StepKV protocol."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from dualpath_ray.runtime.vllm_engine.pages import PageCodec

EXTERNAL_TOKENS = "external_tokens"  # kv_transfer_params: tokens whose KV the connector loads
KEY = "key"  # kv_transfer_params: our name of the request (the compute's, not vLLM's request id)
# kv_transfer_params: where the external tokens' KV lies, as KVSource's fields, for a request that
# loads it asynchronously (vLLM holds it in WAITING_FOR_REMOTE_KVS until the load finished).
SOURCE = "source"
# kv_transfer_params: the request's pages outlive it until `VllmHost.release` (a prefill whose KV
# a decode engine reads from them); its output's params name them (HELD_BLOCKS, HELD_ID).
HOLD = "hold"
HELD_BLOCKS = "held_blocks"
HELD_ID = "held_request_id"


@dataclass(frozen=True)
class KVSource:
    """Where a request's past KV lies, in pool `pool` of the transport endpoint `peer`: Full
    Blocks (the store's format, [n_layer, block_size, bytes]), block i of the request at byte
    offset `blocks[i]` (a reader's buffer extent, an engine's pages); or, with `pages`, another
    vLLM engine's pages of the same geometry, block i of the request in its vLLM block `blocks[i]`
    (a prefill engine's held pages: block_layers.py runs to runs, nothing to settle)."""

    peer: str
    pool: str
    blocks: tuple[int, ...]
    pages: bool = False

    def block_layer(self, block: int, layer: int, block_layer_bytes: int) -> tuple[str, int, int]:
        """(pool, byte offset, bytes) of one block-layer of the request's block `block`."""
        if not 0 <= block < len(self.blocks):
            raise ValueError(f"block {block} of a request whose past KV source holds {len(self.blocks)} blocks")
        return self.pool, self.blocks[block] + layer * block_layer_bytes, block_layer_bytes


@dataclass(frozen=True)
class ScheduledKV:
    """One request of a vLLM step: tokens [computed, computed + scheduled) compute now, in the
    pages `block_ids` (block i holds tokens [i * block_size, (i + 1) * block_size)).

    Tokens [load_from, computed) are loaded before this step computes (an empty range when
    nothing is: a request's later steps, or vLLM's own prefix cache held them all); tokens
    [0, load_from) came from vLLM's prefix cache. `first` marks the request's first step since
    vLLM (re)scheduled it, new or resumed after a preemption: its pages were all just assigned."""

    key: str
    block_ids: tuple[int, ...]
    computed: int
    scheduled: int
    load_from: int
    first: bool

    @property
    def loading(self) -> int:
        """Tokens this step loads (computed - load_from)."""
        return self.computed - self.load_from


class StepKV(Protocol):
    """What one vLLM step moves (runtime/vllm_engine/steps.py implements it)."""

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None: ...

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...

    def end(self) -> None: ...


def layer_index(name: str) -> int:
    """The decoder layer of an attention layer's name ("model.layers.12.self_attn.attn")."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ValueError(f"vLLM attention layer {name!r} names no layer index")
    return int(found[0])
