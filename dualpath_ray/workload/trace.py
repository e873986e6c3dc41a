"""Trajectory traces: one Arrow / Parquet row per turn, and the typed in-memory form.

The file format is specified in docs/trace-format.md. Reading validates everything a rollout
relies on (columns, null cells, lengths, consecutive turns, one arrival per trajectory, token ids
inside the vocabulary) and raises `TraceError` naming the trajectory, turn and field, so a bad
trace fails before any request is sent instead of half-way through a run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dualpath_ray.workload.tokens import check_vocab_size, expand_tokens
from dualpath_ray.workload.validate import TraceLayout, TraceError, validate_table

__all__ = [
    "TRACE_FORMAT_VERSION",
    "TRACE_SCHEMA",
    "TraceError",
    "Trajectory",
    "TrajectoryShape",
    "Turn",
    "check_token_ids",
    "list_array",
    "make_table",
    "read_table",
    "read_trace",
    "table_to_trajectories",
    "trace_shapes",
    "trajectories_to_table",
    "write_table",
    "write_trace",
]

TRACE_FORMAT_VERSION = 1
_VERSION_KEY = b"dualpath.trace_format_version"
_MAX_LIST_VALUES = 2**31 - 1

TRACE_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("appended", pa.list_(pa.int32())),
        pa.field("appended_len", pa.int32()),
        pa.field("token_seed", pa.int64()),
        pa.field("gen_len", pa.int32(), nullable=False),
        pa.field("tool_latency_s", pa.float64()),
        pa.field("arrival_s", pa.float64()),
    ],
    metadata={_VERSION_KEY: str(TRACE_FORMAT_VERSION).encode()},
)


@dataclass(frozen=True)
class Turn:
    """One turn: tokens appended to the context, then `gen_len` generated tokens.

    The prompt of turn k is everything before it (earlier appended tokens and earlier
    outputs) followed by `appended`; `tool_latency_s` is the wait before the turn is sent.
    """

    appended: tuple[int, ...]
    gen_len: int
    tool_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.appended, tuple):
            # Lists and arrays are frozen to a tuple of ints: a Turn is immutable and hashable.
            object.__setattr__(self, "appended", tuple(int(token) for token in self.appended))
        if isinstance(self.gen_len, bool) or not isinstance(self.gen_len, (int, np.integer)) or (
            self.gen_len < 1
        ):
            raise TraceError(f"must be an int >= 1, got {self.gen_len!r}", field="gen_len")
        object.__setattr__(self, "gen_len", int(self.gen_len))
        if not math.isfinite(self.tool_latency_s) or self.tool_latency_s < 0:
            raise TraceError(
                f"must be a finite number >= 0, got {self.tool_latency_s!r}", field="tool_latency_s"
            )
        if self.appended and min(self.appended) < 0:
            raise TraceError(f"has a negative token id {min(self.appended)}", field="appended")


@dataclass(frozen=True)
class Trajectory:
    """A multi-turn trajectory; `arrival_s` is when its first turn may start (0 = offline)."""

    trajectory_id: str
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.turns, tuple):
            object.__setattr__(self, "turns", tuple(self.turns))
        where = {"trajectory_id": self.trajectory_id}
        if not isinstance(self.trajectory_id, str) or not self.trajectory_id:
            raise TraceError("must be a non-empty string", field="trajectory_id")
        if not self.turns:
            raise TraceError("has no turns", field="turns", **where)
        if not self.turns[0].appended:
            raise TraceError(
                "turn 0 appends no tokens, so the first prompt would be empty",
                field="appended", turn=0, **where,
            )
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise TraceError(
                f"must be a finite number >= 0, got {self.arrival_s!r}", field="arrival_s", **where
            )


@dataclass(frozen=True)
class TrajectoryShape:
    """The lengths of a trajectory without its token ids (enough for statistics)."""

    trajectory_id: str
    appended_lens: tuple[int, ...]
    gen_lens: tuple[int, ...]
    arrival_s: float


def check_token_ids(trajectories: Sequence[Trajectory], vocab_size: int) -> None:
    """Raise TraceError for the first token id outside [0, vocab_size), naming its turn."""
    check_vocab_size(vocab_size)
    for trajectory in trajectories:
        for index, turn in enumerate(trajectory.turns):
            if turn.appended and max(turn.appended) >= vocab_size:
                bad = max(turn.appended)
                raise TraceError(
                    f"token id {bad} at position {turn.appended.index(bad)} is outside "
                    f"[0, {vocab_size})",
                    field="appended", trajectory_id=trajectory.trajectory_id, turn=index,
                    fix=f"use ids below the model's vocab_size ({vocab_size})",
                )


def make_table(columns: Mapping[str, Any]) -> pa.Table:
    """A trace table in TRACE_SCHEMA from some of its columns; absent optional ones are null."""
    unknown = set(columns) - set(TRACE_SCHEMA.names)
    if unknown:
        raise TraceError(
            f"unknown columns {sorted(unknown)}; allowed: {', '.join(TRACE_SCHEMA.names)}"
        )
    n_rows = len(columns["trajectory_id"])
    arrays = []
    for field in TRACE_SCHEMA:
        values = columns.get(field.name)
        if values is None:
            arrays.append(pa.nulls(n_rows, field.type))
        elif isinstance(values, (pa.Array, pa.ChunkedArray)):
            arrays.append(values.cast(field.type))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=TRACE_SCHEMA)


def trajectories_to_table(trajectories: Sequence[Trajectory]) -> pa.Table:
    """The explicit-token form of a trace: `appended` ids, `appended_len` = their count."""
    ids: list[str] = []
    turn_index: list[int] = []
    lengths: list[int] = []
    gen: list[int] = []
    latency: list[float] = []
    arrival: list[float] = []
    chunks: list[np.ndarray] = []
    for trajectory in trajectories:
        for index, turn in enumerate(trajectory.turns):
            ids.append(trajectory.trajectory_id)
            turn_index.append(index)
            lengths.append(len(turn.appended))
            gen.append(turn.gen_len)
            latency.append(turn.tool_latency_s)
            arrival.append(trajectory.arrival_s)
            chunks.append(np.asarray(turn.appended, dtype=np.int32))
    return make_table(
        {
            "trajectory_id": ids,
            "turn": turn_index,
            "appended": list_array(chunks, lengths),
            "appended_len": lengths,
            "gen_len": gen,
            "tool_latency_s": latency,
            "arrival_s": arrival,
        }
    )


def list_array(chunks: Sequence[np.ndarray], lengths: Sequence[int]) -> pa.ListArray:
    """A list<int32> column whose row i holds chunks[i] (of length lengths[i])."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    if offsets[-1] > _MAX_LIST_VALUES:
        raise TraceError(
            f"the trace holds {offsets[-1]} explicit token ids, more than one Arrow list column "
            f"can ({_MAX_LIST_VALUES})",
            field="appended", fix="split the trace into several files, or store length + seed",
        )
    values = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values.astype(np.int32, copy=False))
    )


def table_to_trajectories(table: pa.Table, vocab_size: int) -> list[Trajectory]:
    """Validate a trace table and expand it to trajectories, in order of first appearance."""
    check_vocab_size(vocab_size)
    layout = validate_table(table, vocab_size)
    trajectories = []
    for group in layout.groups:
        turns = tuple(
            Turn(
                appended=_row_tokens(layout, int(row), vocab_size),
                gen_len=int(layout.gen_len[row]),
                tool_latency_s=float(layout.tool_latency_s[row]),
            )
            for row in group.rows
        )
        trajectories.append(Trajectory(group.trajectory_id, turns, group.arrival_s))
    return trajectories


def _row_tokens(layout: TraceLayout, row: int, vocab_size: int) -> tuple[int, ...]:
    length = int(layout.appended_len[row])
    if layout.explicit[row]:
        start = int(layout.explicit_offsets[row])
        return tuple(layout.explicit_values[start : start + length].tolist())
    return tuple(expand_tokens(length, int(layout.token_seed[row]), vocab_size).tolist())


def trace_shapes(table: pa.Table) -> list[TrajectoryShape]:
    """Validate a trace table's structure and return its lengths (no token ids are expanded)."""
    layout = validate_table(table, vocab_size=None)
    return [
        TrajectoryShape(
            trajectory_id=group.trajectory_id,
            appended_lens=tuple(layout.appended_len[group.rows].tolist()),
            gen_lens=tuple(layout.gen_len[group.rows].tolist()),
            arrival_s=group.arrival_s,
        )
        for group in layout.groups
    ]


def write_table(table: pa.Table, path: str | Path) -> Path:
    """Validate a trace table's structure and write it as Parquet (atomically: temp + rename)."""
    validate_table(table, vocab_size=None)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table.replace_schema_metadata(TRACE_SCHEMA.metadata), tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_trace(trajectories: Sequence[Trajectory], path: str | Path) -> Path:
    """Write trajectories as a Parquet trace in the explicit-token form."""
    return write_table(trajectories_to_table(trajectories), path)


def read_table(path: str | Path) -> pa.Table:
    """The raw table of a Parquet trace (not yet validated); file problems are TraceErrors."""
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise TraceError("no such file", source=str(path)) from None
    except (OSError, pa.ArrowInvalid) as exc:
        raise TraceError(f"not a readable Parquet file ({exc})", source=str(path)) from None
    version = (table.schema.metadata or {}).get(_VERSION_KEY)
    if version is not None and int(version) > TRACE_FORMAT_VERSION:
        raise TraceError(
            f"trace format version {int(version)} is newer than this reader "
            f"({TRACE_FORMAT_VERSION})",
            source=str(path), fix="upgrade dualpath_ray",
        )
    return table


def read_trace(path: str | Path, vocab_size: int) -> list[Trajectory]:
    """Read, validate and expand a Parquet trace; errors name the file, trajectory, turn, field."""
    table = read_table(path)
    try:
        return table_to_trajectories(table, vocab_size)
    except TraceError as exc:
        raise exc.with_source(str(path)) from None
