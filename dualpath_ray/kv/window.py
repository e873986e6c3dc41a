"""A prefill engine's KV memory: a ring of a few layer slots, each holding one layer of a batch.

Layerwise prefill never needs every layer at once: while layer l computes, layer l+1's hit KV is
on its way in and layer l-1's KV on its way out. So the engine holds RING_LAYERS = 3 slots of
[capacity_tokens, bytes_per_token_per_layer] uint8 on its device; layer l uses slot l % 3. In a
slot each request of the batch owns the contiguous token span [offset, offset + cached + bsz):
its past KV first (loaded), then the KV it computes, so attention reads the span in place.

A slot's lifecycle, one transition function: FREE -> LOADING -> READY (or FREE -> READY when the
layer needs no incoming KV) -> COMPUTED -> SENDING -> FREE (or COMPUTED -> FREE when nothing is
sent, oracle mode). So a slot can never be overwritten by the next load while its KV still
leaves, nor computed before its past KV has landed.
"""

from __future__ import annotations

import enum
import threading
from typing import Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.lifecycle import Lifecycle, TransitionError

RING_LAYERS = 3


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"
    COMPUTED = "computed"
    SENDING = "sending"


class SlotEvent(enum.Enum):
    LOAD = "load"
    LOADED = "loaded"
    SKIP_LOAD = "skip_load"
    COMPUTE = "compute"
    SEND = "send"
    SENT = "sent"
    DROP = "drop"


class SlotTransitionError(TransitionError):
    """A window slot was asked for a move its lifecycle forbids (a pipeline ordering bug)."""


SLOT_LIFECYCLE = Lifecycle(
    moves={
        (SlotState.FREE, SlotEvent.LOAD): SlotState.LOADING,
        (SlotState.LOADING, SlotEvent.LOADED): SlotState.READY,
        (SlotState.FREE, SlotEvent.SKIP_LOAD): SlotState.READY,
        (SlotState.READY, SlotEvent.COMPUTE): SlotState.COMPUTED,
        (SlotState.COMPUTED, SlotEvent.SEND): SlotState.SENDING,
        (SlotState.SENDING, SlotEvent.SENT): SlotState.FREE,
        (SlotState.COMPUTED, SlotEvent.DROP): SlotState.FREE,
    },
    error=SlotTransitionError,
)


def transition(slot: int, current: SlotState, event: SlotEvent) -> SlotState:
    return SLOT_LIFECYCLE.move(f"window slot {slot}", current, event)


def span_offsets(lengths: Sequence[int]) -> list[int]:
    """Start token of each request's span when spans of these lengths are laid out in order."""
    offsets, position = [], 0
    for length in lengths:
        offsets.append(position)
        position += length
    return offsets


class LayerWindow:
    """RING_LAYERS layer slots of one batch's KV, with a checked lifecycle per slot."""

    def __init__(
        self, capacity_tokens: int, layout: KVLayout, device: str | torch.device = "cpu", storage: bool = True,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        self.layout = layout
        self.capacity_tokens = capacity_tokens
        # Without storage the window only bounds a batch's tokens: a compute that keeps the
        # batch's KV in pages of its own (runtime/compute/prefill_kv.py: vLLM's) needs no slots.
        tokens = capacity_tokens if storage else 0
        self.tensor = torch.empty((RING_LAYERS, tokens, layout.bytes_per_token_per_layer), dtype=torch.uint8, device=device)
        self._states = [SlotState.FREE] * RING_LAYERS
        self._lock = threading.Lock()
        self.max_held = 0

    @staticmethod
    def slot_of(layer: int) -> int:
        return layer % RING_LAYERS

    def slot(self, layer: int) -> torch.Tensor:
        """The [capacity_tokens, bytes] slot that holds `layer`."""
        return self.tensor[self.slot_of(layer)]

    @property
    def slot_bytes(self) -> int:
        return self.capacity_tokens * self.layout.bytes_per_token_per_layer

    def token_offset(self, layer: int, token: int) -> int:
        """Byte offset of `token` of the slot holding `layer`, within the whole window tensor."""
        return self.slot_of(layer) * self.slot_bytes + token * self.layout.bytes_per_token_per_layer

    def move(self, layer: int, event: SlotEvent) -> None:
        slot = self.slot_of(layer)
        with self._lock:
            self._states[slot] = transition(slot, self._states[slot], event)
            self.max_held = max(self.max_held, self.held())

    def state(self, layer: int) -> SlotState:
        with self._lock:
            return self._states[self.slot_of(layer)]

    def held(self) -> int:
        """Slots not FREE (callers hold the lock or accept a racy read)."""
        return sum(state is not SlotState.FREE for state in self._states)

    def reset(self) -> None:
        """After a failed batch whose transfers have all ended: every slot is free again."""
        with self._lock:
            self._states = [SlotState.FREE] * RING_LAYERS

    def all_free(self) -> bool:
        with self._lock:
            return self.held() == 0
