"""The simulator's workload: trajectories as lengths and block chains, never token ids.

The same trace formats as the runtime: a Parquet trace (docs/trace-format.md; only its lengths,
tool latencies and arrivals are read, no token id is expanded), synthetic parameters
(workload/synth.py, the same generator and statistics), in memory `Trajectory` objects (tests,
calibration), and the public Mooncake JSONL form (workload/mooncake.py), whose hash ids become
the block keys of a `TreeIndex` so prefixes shared between requests hit as they would.

A turn's prompt is everything before it (earlier appended and generated tokens) plus what it
appends; it generates `gen` tokens (greedy, no stop token, as the runtime's replay of a trace).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from dualpath_ray.sim.index import chain_key
from dualpath_ray.workload.mooncake import MOONCAKE_BLOCK_TOKENS, MooncakeRequest, read_mooncake
from dualpath_ray.workload.synth import SynthParams, synthesize
from dualpath_ray.workload.trace import Trajectory, read_table
from dualpath_ray.workload.validate import validate_table


@dataclass(frozen=True)
class SimTrajectory:
    """One agent: its turns' appended and generated lengths, tool latencies and arrival.

    `chain` names its block chain (ChainIndex); `keys`, when given, are the explicit block keys
    of its single turn's prompt (TreeIndex, Mooncake)."""

    trajectory_id: str
    appended: np.ndarray
    gen: np.ndarray
    tool_latency_s: np.ndarray
    arrival_s: float
    chain: int
    keys: tuple[int, ...] = ()

    @property
    def turns(self) -> int:
        return len(self.gen)


@dataclass(frozen=True)
class Workload:
    trajectories: tuple[SimTrajectory, ...]
    tree: bool = False  # explicit block keys (TreeIndex) instead of one chain per trajectory
    source: str = ""

    @property
    def turns(self) -> int:
        return sum(t.turns for t in self.trajectories)


def _arrays(appended: Sequence[int], gen: Sequence[int], latency: Sequence[float]) -> tuple[np.ndarray, ...]:
    return (np.asarray(appended, dtype=np.int64), np.asarray(gen, dtype=np.int64), np.asarray(latency, dtype=np.float64))


def from_trajectories(trajectories: Sequence[Trajectory], source: str = "<trajectories>") -> Workload:
    """In-memory trajectories (tests, calibration): only their lengths are kept."""
    result = []
    for chain, t in enumerate(trajectories, start=1):
        appended, gen, latency = _arrays(
            [len(turn.appended) for turn in t.turns], [turn.gen_len for turn in t.turns],
            [turn.tool_latency_s for turn in t.turns],
        )
        result.append(SimTrajectory(t.trajectory_id, appended, gen, latency, t.arrival_s, chain))
    return Workload(tuple(result), source=source)


def from_table(table: object, source: str) -> Workload:
    """A trace table (Parquet form): lengths, tool latencies and arrivals, validated as the runtime's."""
    layout = validate_table(table, vocab_size=None)  # type: ignore[arg-type]
    result = []
    for chain, group in enumerate(layout.groups, start=1):
        rows = group.rows
        result.append(SimTrajectory(
            group.trajectory_id, layout.appended_len[rows].astype(np.int64), layout.gen_len[rows].astype(np.int64),
            layout.tool_latency_s[rows].astype(np.float64), group.arrival_s, chain,
        ))
    return Workload(tuple(result), source=source)


def from_synth(params: SynthParams) -> Workload:
    return from_table(synthesize(params), source=f"synth {params.as_dict()}")


def from_mooncake(requests: Sequence[MooncakeRequest], block_size: int, source: str = "<mooncake>") -> Workload:
    """One one-turn trajectory per request; its prompt's block keys follow its hash-id chain, so
    two requests share exactly the blocks their common leading hash ids imply."""
    if MOONCAKE_BLOCK_TOKENS % block_size:
        raise ValueError(f"store.block_size {block_size} must divide the Mooncake block of {MOONCAKE_BLOCK_TOKENS}")
    per_hash = MOONCAKE_BLOCK_TOKENS // block_size
    interned: dict[tuple[int, int, int], int] = {}
    result = []
    for number, request in enumerate(requests, start=1):
        keys: list[int] = []
        parent = -1
        for position in range(request.input_length // block_size):
            hash_id = request.hash_ids[position // per_hash]
            name = (parent, hash_id, position % per_hash)
            key = interned.get(name)
            if key is None:
                # Negative keys: never equal to a chain_key of a request's own decode blocks.
                key = interned[name] = -(len(interned) + 1)
            keys.append(key)
            parent = key
        appended, gen, latency = _arrays([request.input_length], [request.output_length], [0.0])
        result.append(SimTrajectory(
            request.trajectory_id, appended, gen, latency, request.timestamp_ms / 1000.0, number, tuple(keys)
        ))
    return Workload(tuple(result), tree=True, source=source)


def load_workload(path: str | Path, block_size: int) -> Workload:
    """A trace file: Mooncake JSONL (.jsonl) or a Parquet trace (anything else)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return from_mooncake(read_mooncake(path), block_size, source=str(path))
    return from_table(read_table(path), source=str(path))


def block_key(trajectory: SimTrajectory, position: int, tree: bool) -> int:
    """The key of block `position` of a trajectory's context: its explicit key while the prompt
    has one (tree), else the block's place in the trajectory's own chain."""
    if tree and position < len(trajectory.keys):
        return trajectory.keys[position]
    return chain_key(trajectory.chain, position)
