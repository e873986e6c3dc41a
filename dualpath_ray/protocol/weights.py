"""What a trainer's weight broadcast names (runtime/deploy/weight_sync.py): its tensors, in order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a trainer's weight broadcast, in manifest order (runtime/deploy/weight_sync.py)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
