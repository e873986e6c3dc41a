"""What a trainer's weight broadcast names (runtime/weights/sync.py): its tensors, in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a trainer's weight broadcast, in manifest order (runtime/weights/sync.py)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...


@dataclass(frozen=True)
class WeightsId:
    """One set of weights: the version it serves as and the fingerprint of its tensors
    (model/weights.py `weights_fingerprint`; runtime/engine/held_weights.py `config_fingerprint`
    for the weights an engine's config builds)."""

    version: int
    fingerprint: str


@dataclass(frozen=True)
class WeightSource:
    """Where an update's weights come from: a safetensors checkpoint directory, or a state dict
    in Ray's object store (`state`: its ObjectRef). Wrapped so that the Scheduler, which fans an
    update out, hands the ref on to the engines instead of fetching the tensors itself (Ray
    resolves only refs passed as top-level arguments)."""

    checkpoint: str | None = None
    state: Any = None  # ray.ObjectRef of a state dict; typed Any so this module needs no Ray

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.state is None):
            raise ValueError("a WeightSource is a checkpoint directory or a state dict's ObjectRef (exactly one)")

    def argument(self) -> Any:
        """What each engine's update_weights is given: the directory, or the ref (resolved there)."""
        return self.checkpoint if self.checkpoint is not None else self.state
