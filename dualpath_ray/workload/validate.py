"""Validation of trace tables, vectorised so a million-row trace checks in a blink.

`validate_table` is the only gate between a trace file and the rest of the system: every rule
of docs/trace-format.md is checked here, and the first violation raises a `TraceError` that names
where it is (trajectory, turn, field) and how to fix it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

REQUIRED_COLUMNS = ("trajectory_id", "turn", "gen_len")
_TURN_FIX = "number the turns of every trajectory 0, 1, ..., n-1, one row each"


class TraceError(ValueError):
    """A trace (file, table, line or value) is invalid; says where and how to fix it."""

    def __init__(
        self,
        problem: str,
        *,
        field: str | None = None,
        trajectory_id: str | None = None,
        turn: int | None = None,
        line: int | None = None,
        source: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.field = field
        self.trajectory_id = trajectory_id
        self.turn = turn
        self.line = line
        self.source = source
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.source is not None:
            where.append(self.source)
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.trajectory_id is not None:
            where.append(f"trajectory {self.trajectory_id!r}")
        if self.turn is not None:
            where.append(f"turn {self.turn}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        text = ": ".join([*where, self.problem])
        return f"{text} (fix: {self.fix})" if self.fix else text

    def with_source(self, source: str) -> TraceError:
        """The same error, located in `source` (a file name)."""
        return TraceError(self.problem, **{**self.location(), "source": source})

    def location(self) -> dict[str, object]:
        """Where the problem is, and its fix, as keyword arguments of TraceError."""
        return {
            "field": self.field, "trajectory_id": self.trajectory_id, "turn": self.turn,
            "line": self.line, "source": self.source, "fix": self.fix,
        }

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return functools.partial(TraceError, self.problem, **self.location()), ()


@dataclass(frozen=True)
class TraceGroup:
    """The rows of one trajectory, in turn order, and its arrival time."""

    trajectory_id: str
    rows: np.ndarray
    arrival_s: float


@dataclass(frozen=True)
class TraceLayout:
    """A validated trace table as per-row arrays (nulls resolved) plus its trajectories."""

    groups: tuple[TraceGroup, ...]
    appended_len: np.ndarray
    explicit: np.ndarray
    explicit_offsets: np.ndarray
    explicit_values: np.ndarray
    token_seed: np.ndarray
    gen_len: np.ndarray
    tool_latency_s: np.ndarray


@dataclass(frozen=True)
class _Ints:
    values: np.ndarray
    null: np.ndarray


def validate_table(table: pa.Table, vocab_size: int | None) -> TraceLayout:
    """Check every rule of the trace format; token ids are range-checked when vocab_size is given."""
    missing = [name for name in REQUIRED_COLUMNS if name not in table.column_names]
    if missing:
        raise TraceError(
            f"missing column(s) {missing}; a trace needs {', '.join(REQUIRED_COLUMNS)}",
            field=missing[0], fix="add the column (see docs/trace-format.md)",
        )
    if "appended" not in table.column_names and not {"appended_len", "token_seed"} <= set(
        table.column_names
    ):
        raise TraceError(
            "missing column: a trace needs 'appended' (token ids) or both 'appended_len' and "
            "'token_seed'",
            field="appended", fix="add the column (see docs/trace-format.md)",
        )
    ids = _ids(table)
    turn = _int_column(table, "turn")
    _reject_nulls(turn, "turn", ids, turn)
    gen_len = _int_column(table, "gen_len")
    _reject_nulls(gen_len, "gen_len", ids, turn)
    _reject_rows(gen_len.values < 1, "gen_len", ids, turn, gen_len.values, "must be > 0")
    explicit_len, explicit_values = _explicit_column(table)
    length, explicit, seed = _appended_form(table, ids, turn, explicit_len)
    latency = _float_column(table, "tool_latency_s", ids, turn)
    arrival = _float_column(table, "arrival_s", ids, turn)
    groups = _groups(ids, turn, length, arrival)
    offsets = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(np.where(explicit_len.null, 0, explicit_len.values)[:-1], out=offsets[1:])
    layout = TraceLayout(
        groups=groups,
        appended_len=length,
        explicit=explicit,
        explicit_offsets=offsets,
        explicit_values=explicit_values,
        token_seed=seed,
        gen_len=gen_len.values,
        tool_latency_s=np.where(np.isnan(latency), 0.0, latency),
    )
    if vocab_size is not None:
        _check_vocab(table, layout, ids, turn, vocab_size)
    return layout


def _where(ids: list[str | None], turn: _Ints, row: int) -> dict[str, object]:
    return {
        "trajectory_id": ids[row],
        "turn": None if turn.null[row] else int(turn.values[row]),
    }


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _reject_rows(
    mask: np.ndarray, field: str, ids: list[str | None], turn: _Ints, values: np.ndarray,
    rule: str, fix: str | None = None,
) -> None:
    row = _first(mask)
    if row is not None:
        raise TraceError(
            f"{rule}, got {values[row]}", field=field, fix=fix, **_where(ids, turn, row)
        )


def _reject_nulls(column: _Ints, field: str, ids: list[str | None], turn: _Ints) -> None:
    row = _first(column.null)
    if row is not None:
        raise TraceError(
            f"is null (row {row})", field=field, fix=f"give every row a {field}",
            **_where(ids, turn, row),
        )


def _ids(table: pa.Table) -> list[str | None]:
    column = table.column("trajectory_id")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise TraceError(
            f"has type {column.type}, expected string", field="trajectory_id",
            fix="store trajectory ids as strings",
        )
    ids = column.to_pylist()
    for row, value in enumerate(ids):
        if not value:
            raise TraceError(
                f"is {'null' if value is None else 'empty'} (row {row})", field="trajectory_id",
                fix="give every row its trajectory's non-empty id",
            )
    return ids


def _int_column(table: pa.Table, name: str) -> _Ints:
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise TraceError(f"has type {column.type}, expected an integer type", field=name)
    try:
        column = column.cast(pa.int64())
    except pa.ArrowInvalid as exc:
        raise TraceError(f"does not fit in int64 ({exc})", field=name) from None
    null = np.asarray(column.is_null(), dtype=bool)
    return _Ints(np.asarray(column.fill_null(0), dtype=np.int64), null)


def _optional_int_column(table: pa.Table, name: str) -> _Ints:
    if name not in table.column_names:
        n_rows = table.num_rows
        return _Ints(np.zeros(n_rows, dtype=np.int64), np.ones(n_rows, dtype=bool))
    return _int_column(table, name)


def _float_column(table: pa.Table, name: str, ids: list[str | None], turn: _Ints) -> np.ndarray:
    """Values as float64, NaN where the cell (or the whole optional column) is null."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    column = table.column(name)
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
        raise TraceError(f"has type {column.type}, expected a number", field=name)
    column = column.cast(pa.float64())
    null = np.asarray(column.is_null(), dtype=bool)
    values = np.asarray(column.fill_null(0.0), dtype=np.float64)
    bad = ~null & ~(np.isfinite(values) & (values >= 0))
    _reject_rows(bad, name, ids, turn, values, "must be a finite number of seconds >= 0")
    return np.where(null, np.nan, values)


def _explicit_column(table: pa.Table) -> tuple[_Ints, np.ndarray]:
    """(length of each row's `appended` list, null where absent; all ids flattened, int64)."""
    if "appended" not in table.column_names:
        n_rows = table.num_rows
        return _Ints(np.zeros(n_rows, dtype=np.int64), np.ones(n_rows, dtype=bool)), np.zeros(
            0, dtype=np.int64
        )
    column = table.column("appended").combine_chunks()
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(
        kind.value_type
    ):
        raise TraceError(f"has type {kind}, expected list<int32>", field="appended")
    lengths = pc.list_value_length(column)
    null = np.asarray(lengths.is_null(), dtype=bool)
    values = np.asarray(pc.list_flatten(column).cast(pa.int64()), dtype=np.int64)
    return _Ints(np.asarray(lengths.fill_null(0), dtype=np.int64), null), values


def _appended_form(
    table: pa.Table, ids: list[str | None], turn: _Ints, explicit_len: _Ints
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(appended length, explicit?, token seed) per row; explicit `appended` wins over a seed."""
    declared = _optional_int_column(table, "appended_len")
    seed = _optional_int_column(table, "token_seed")
    explicit = ~explicit_len.null
    _reject_rows(
        ~declared.null & (declared.values < 0), "appended_len", ids, turn, declared.values,
        "must be >= 0 (a token count)",
    )
    row = _first(~explicit & declared.null)
    if row is not None:
        raise TraceError(
            "the row has no tokens: 'appended' is null and 'appended_len' is null",
            field="appended", fix="give 'appended' ids, or 'appended_len' and 'token_seed'",
            **_where(ids, turn, row),
        )
    row = _first(~explicit & seed.null)
    if row is not None:
        raise TraceError(
            "is null, but 'appended' is null too, so appended_len has no ids to expand",
            field="token_seed", fix="give a token_seed >= 0 or explicit 'appended' ids",
            **_where(ids, turn, row),
        )
    _reject_rows(
        ~explicit & (seed.values < 0), "token_seed", ids, turn, seed.values, "must be >= 0"
    )
    row = _first(explicit & ~declared.null & (declared.values != explicit_len.values))
    if row is not None:
        raise TraceError(
            f"is {declared.values[row]} but 'appended' holds {explicit_len.values[row]} ids",
            field="appended_len", fix="make them equal or leave appended_len null",
            **_where(ids, turn, row),
        )
    length = np.where(explicit, explicit_len.values, declared.values)
    return length, explicit, seed.values


def _groups(
    ids: list[str | None], turn: _Ints, length: np.ndarray, arrival: np.ndarray
) -> tuple[TraceGroup, ...]:
    if not ids:
        return ()
    encoded = pa.array(ids).dictionary_encode()
    codes = np.asarray(encoded.indices, dtype=np.int64)
    names = encoded.dictionary.to_pylist()
    order = np.lexsort((turn.values, codes))
    sorted_codes = codes[order]
    starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
    position = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    _check_turn_numbers(ids, turn, order, position)
    _reject_empty_first_turn(ids, turn, order[starts], length)
    arrivals = _arrivals(ids, turn, order, starts, arrival)
    bounds = np.r_[starts, len(order)]
    return tuple(
        TraceGroup(names[sorted_codes[start]], order[start:end], arrivals[index])
        for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))
    )


def _check_turn_numbers(
    ids: list[str | None], turn: _Ints, order: np.ndarray, position: np.ndarray
) -> None:
    sorted_turns = turn.values[order]
    bad = _first(sorted_turns != position)
    if bad is None:
        return
    row = int(order[bad])
    expected = int(position[bad])
    where = {"trajectory_id": ids[row], "field": "turn", "fix": _TURN_FIX}
    if sorted_turns[bad] < 0:
        raise TraceError(f"must be >= 0, got {sorted_turns[bad]}", turn=int(sorted_turns[bad]), **where)
    if expected > 0 and sorted_turns[bad] == sorted_turns[bad - 1]:
        raise TraceError(
            f"turn {sorted_turns[bad]} appears twice (rows {order[bad - 1]} and {row})",
            turn=int(sorted_turns[bad]), **where,
        )
    raise TraceError(
        f"turn {expected} is missing (the next turn present is {sorted_turns[bad]})",
        turn=expected, **where,
    )


def _reject_empty_first_turn(
    ids: list[str | None], turn: _Ints, first_rows: np.ndarray, length: np.ndarray
) -> None:
    row = _first(length[first_rows] == 0)
    if row is not None:
        raise TraceError(
            "turn 0 appends no tokens, so the first prompt would be empty",
            field="appended", fix="give turn 0 at least one token",
            **_where(ids, turn, int(first_rows[row])),
        )


def _arrivals(
    ids: list[str | None], turn: _Ints, order: np.ndarray, starts: np.ndarray, arrival: np.ndarray
) -> list[float]:
    """One arrival per trajectory: its non-null values must agree; none at all means 0."""
    values = arrival[order]
    low = np.minimum.reduceat(np.where(np.isnan(values), np.inf, values), starts)
    high = np.maximum.reduceat(np.where(np.isnan(values), -np.inf, values), starts)
    group = _first(np.isfinite(low) & (high > low))
    if group is not None:
        end = starts[group + 1] if group + 1 < len(starts) else len(order)
        rows = order[starts[group] : end]
        row = int(rows[np.flatnonzero(arrival[rows] == high[group])[0]])
        raise TraceError(
            f"is {high[group]} but another turn of this trajectory says {low[group]}; "
            "arrival_s belongs to the trajectory",
            field="arrival_s", fix="put one value on every row of the trajectory, or only on turn 0",
            **_where(ids, turn, row),
        )
    return [float(value) if np.isfinite(value) else 0.0 for value in low]


def _check_vocab(
    table: pa.Table, layout: TraceLayout, ids: list[str | None], turn: _Ints, vocab_size: int
) -> None:
    values = layout.explicit_values
    bad = _first((values < 0) | (values >= vocab_size))
    if bad is None:
        return
    parents = np.asarray(pc.list_parent_indices(table.column("appended").combine_chunks()))
    row = int(parents[bad])
    raise TraceError(
        f"token id {values[bad]} at position {bad - layout.explicit_offsets[row]} is outside "
        f"[0, {vocab_size})",
        field="appended", fix=f"use ids of the model's vocabulary (vocab_size = {vocab_size})",
        **_where(ids, turn, row),
    )

