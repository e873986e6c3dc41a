"""What an engine actor's `engine_stats` answers: one typed, frozen record (not a dict literal),
so a caller reads named fields and a misspelt one is an AttributeError rather than a KeyError or
a silent default. `to_json()` is the plain dict the benchmarks' results and the chaos tests'
figures have always held, with the same keys."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Generic, Mapping, TypeVar

from dualpath_ray.runtime.transport.moves import TransportStats

# The engine core's own figures: PrefillStats (runtime/prefill/core.py) or DecodeStats
# (runtime/decode/job.py), each a dataclass; the roles sit above telemetry/, so the record is
# generic in them rather than importing them.
CoreStats = TypeVar("CoreStats")


@dataclass(frozen=True)
class HbmMoveCounts:
    """How the engine moves KV between host and HBM (runtime/engine/hbm_moves.py): `mode`
    (registered HBM or staged copies), the bytes copied each way and the copies made, and, per
    registered pool, whether its pinned host mirror is page-locked now."""

    mode: str
    h2d_bytes: int
    d2h_bytes: int
    copies: int
    mirrors_pinned: Mapping[str, bool]


@dataclass(frozen=True)
class EngineStats(Generic[CoreStats]):
    """One engine's figures: its core's (batches, chunks, handoffs, digest checks, ...), its
    transport's, the device it computes on, its HBM moves, its incarnation, the actor calls it
    made by method, its worker's wake-ups (an idle engine's grow by one a second at most) and
    what its compute reports (EngineCompute.stats: vLLM's steps and pages; empty otherwise)."""

    core: CoreStats
    transport: TransportStats
    device: str
    hbm_moves: HbmMoveCounts
    incarnation: str
    sent: Mapping[str, int]
    worker_loops: int
    compute: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        core = asdict(self.core) if is_dataclass(self.core) and not isinstance(self.core, type) else self.core
        return {
            "core": core, "transport": asdict(self.transport), "device": self.device,
            "hbm_moves": {**asdict(self.hbm_moves), "mirrors_pinned": dict(self.hbm_moves.mirrors_pinned)},
            "incarnation": self.incarnation, "sent": dict(self.sent), "worker_loops": self.worker_loops,
            "compute": dict(self.compute),
        }
