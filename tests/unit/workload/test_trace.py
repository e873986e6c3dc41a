"""Trace schema: Parquet round trip, the (len, seed) expansion, and validation errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.workload.tokens import derive_seed, expand_tokens
from dualpath_ray.workload.trace import (
    TraceError,
    Trajectory,
    Turn,
    check_token_ids,
    make_table,
    read_trace,
    table_to_trajectories,
    trace_shapes,
    trajectories_to_table,
    write_table,
    write_trace,
)

VOCAB = 512


def _sample() -> list[Trajectory]:
    return [
        Trajectory("agent-a", (Turn((1, 2, 3), 4), Turn((), 2, 0.5), Turn((7,), 9, 1.25)), 1.5),
        Trajectory("agent-b", (Turn((5,) * 70, 1),)),
    ]


def _seeded_rows() -> dict[str, list[object]]:
    return {
        "trajectory_id": ["t0", "t0", "t1"],
        "turn": [0, 1, 0],
        "appended_len": [5, 3, 2],
        "token_seed": [11, 12, 13],
        "gen_len": [4, 4, 4],
    }


def _raises(table: pa.Table, vocab_size: int = VOCAB) -> TraceError:
    with pytest.raises(TraceError) as info:
        table_to_trajectories(table, vocab_size)
    return info.value


def _explicit_table(**overrides: list[object]) -> pa.Table:
    columns: dict[str, object] = {
        "trajectory_id": ["a", "a", "a", "b"],
        "turn": [0, 1, 2, 0],
        "appended": [[1, 2], [3], [4, 5, 6], [7]],
        "gen_len": [3, 3, 3, 3],
    }
    columns.update(overrides)
    return make_table(columns)


def test_parquet_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = write_trace(_sample(), tmp_path / "t.parquet")
    assert read_trace(path, VOCAB) == _sample(), "write_trace then read_trace must be the identity"
    schema = pq.read_schema(path)
    assert schema.field("turn").type == pa.int32(), "turn is stored as int32"
    assert schema.field("appended").type == pa.list_(pa.int32()), "appended is list<int32>"


def test_rows_may_come_in_any_order() -> None:
    table = trajectories_to_table(_sample())
    shuffled = table.take(pa.array([2, 0, 3, 1]))
    assert table_to_trajectories(shuffled, VOCAB) == _sample(), (
        "trajectories keep first-appearance order and turns are sorted by index"
    )


def test_seeded_rows_expand_with_expand_tokens() -> None:
    trajectories = table_to_trajectories(make_table(_seeded_rows()), VOCAB)
    assert trajectories[0].turns[1].appended == tuple(expand_tokens(3, 12, VOCAB).tolist()), (
        "a (appended_len, token_seed) row means exactly expand_tokens(len, seed, vocab)"
    )
    assert [len(t.turns) for t in trajectories] == [2, 1], "seeded rows group like explicit ones"


def test_explicit_ids_win_over_a_seed() -> None:
    table = _explicit_table(token_seed=[99, 99, 99, 99], appended_len=[2, 1, 3, 1])
    assert table_to_trajectories(table, VOCAB)[0].turns[0].appended == (1, 2), (
        "when a row has both, the explicit ids are the tokens and the seed is ignored"
    )


def test_int64_and_missing_optional_columns_are_accepted() -> None:
    table = pa.table(
        {
            "trajectory_id": ["x", "x"],
            "turn": pa.array([1, 0], pa.int64()),
            "appended": [[1], [2, 3]],
            "gen_len": pa.array([5, 6], pa.int64()),
        }
    )
    [trajectory] = table_to_trajectories(table, VOCAB)
    assert trajectory.turns[0] == Turn((2, 3), 6, 0.0), "optional tool latency defaults to 0"
    assert trajectory.arrival_s == 0.0, "a trace without arrival_s is offline (all at 0)"


def test_arrival_only_on_turn_zero_is_the_trajectorys_arrival() -> None:
    table = _explicit_table(arrival_s=[2.5, None, None, None])
    arrivals = [t.arrival_s for t in table_to_trajectories(table, VOCAB)]
    assert arrivals == [2.5, 0.0], "a value on turn 0 alone is the trajectory's arrival"


def test_expand_tokens_is_pinned_prefix_stable_and_in_range() -> None:
    assert expand_tokens(8, 12345, 32000).tolist() == [
        7274, 10136, 25515, 21640, 12515, 10650, 19145, 5975,
    ], "the expansion is part of the file format and must never change"
    long = expand_tokens(1000, 7, 50)
    assert long[:10].tolist() == expand_tokens(10, 7, 50).tolist(), "shorter is a prefix"
    assert long.min() >= 0 and long.max() < 50, "ids lie in [0, vocab_size)"
    assert len(set(long.tolist())) == 50, "1000 draws over 50 ids cover the whole vocabulary"
    assert derive_seed(0, "agent", 3) == 7821841812393672505, "derived seeds are pinned too"


def test_shapes_need_no_vocabulary() -> None:
    shapes = trace_shapes(make_table(_seeded_rows()))
    assert [s.appended_lens for s in shapes] == [(5, 3), (2,)], "shapes carry appended lengths"
    assert [s.gen_lens for s in shapes] == [(4, 4), (4,)], "shapes carry generation lengths"


@pytest.mark.parametrize("column", ["trajectory_id", "turn", "gen_len"])
def test_missing_required_column(column: str) -> None:
    error = _raises(_explicit_table().drop_columns([column]))
    assert error.field == column, "a missing column error names the column"
    assert "missing" in str(error), "the message says the column is missing"


def test_missing_token_columns() -> None:
    table = make_table(_seeded_rows()).drop_columns(["appended", "token_seed"])
    error = _raises(table)
    assert error.field == "appended", "without ids or seeds the error names 'appended'"
    assert "token_seed" in str(error), "the message names the alternative columns"


@pytest.mark.parametrize(
    ("overrides", "field", "trajectory", "turn", "words"),
    [
        ({"gen_len": [3, -2, 3, 3]}, "gen_len", "a", 1, "must be > 0"),
        ({"gen_len": [3, 3, 0, 3]}, "gen_len", "a", 2, "must be > 0"),
        ({"turn": [0, 1, 3, 0]}, "turn", "a", 2, "turn 2 is missing"),
        ({"turn": [0, 1, 1, 0]}, "turn", "a", 1, "appears twice"),
        ({"turn": [0, 1, 2, -1]}, "turn", "b", -1, "must be >= 0"),
        ({"appended": [[1, 2], [3], [4, 512, 6], [7]]}, "appended", "a", 2, "512 at position 1"),
        ({"appended": [[1, 2], [3], [4, 5, 6], [-1]]}, "appended", "b", 0, "-1 at position 0"),
        ({"appended": [[], [3], [4], [7]]}, "appended", "a", 0, "first prompt would be empty"),
        ({"appended_len": [2, 1, 9, 1]}, "appended_len", "a", 2, "holds 3 ids"),
        ({"appended_len": [2, -1, None, None]}, "appended_len", "a", 1, "must be >= 0"),
        ({"tool_latency_s": [0.0, -1.0, 0.0, 0.0]}, "tool_latency_s", "a", 1, ">= 0"),
        ({"tool_latency_s": [0.0, 0.0, float("nan"), 0.0]}, "tool_latency_s", "a", 2, "finite"),
        ({"arrival_s": [1.0, 1.0, 2.0, 0.0]}, "arrival_s", "a", 2, "belongs to the trajectory"),
        ({"gen_len": [3, None, 3, 3]}, "gen_len", "a", 1, "is null"),
    ],
)
def test_bad_rows_name_trajectory_turn_and_field(
    overrides: dict[str, list[object]], field: str, trajectory: str, turn: int, words: str
) -> None:
    error = _raises(_explicit_table(**overrides))
    assert (error.trajectory_id, error.turn, error.field) == (trajectory, turn, field), (
        f"the error must locate the bad cell, got {error}"
    )
    assert words in str(error), f"the message must explain the rule ({words!r}): {error}"
    assert f"trajectory {trajectory!r}" in str(error) and f"field {field!r}" in str(error), (
        "the message itself names the trajectory and the field"
    )


def test_seed_missing_for_a_seeded_row() -> None:
    rows = _seeded_rows()
    rows["token_seed"] = [11, None, 13]
    error = _raises(make_table(rows))
    assert (error.trajectory_id, error.turn, error.field) == ("t0", 1, "token_seed"), (
        "a length without a seed or ids names token_seed"
    )


def test_null_trajectory_id() -> None:
    table = pa.table({"trajectory_id": ["a", None], "turn": [0, 0], "appended": [[1], [2]],
                      "gen_len": [1, 1]})
    error = _raises(table)
    assert error.field == "trajectory_id" and "row 1" in str(error), "a null id names its row"


def test_read_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(_explicit_table(gen_len=[3, 3, -5, 3]), path)
    with pytest.raises(TraceError) as info:
        read_trace(path, VOCAB)
    assert str(path) in str(info.value), "errors from read_trace name the file"
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "absent.parquet", VOCAB)


def test_write_refuses_an_invalid_table(tmp_path: Path) -> None:
    with pytest.raises(TraceError):
        write_table(_explicit_table(turn=[0, 0, 1, 0]), tmp_path / "t.parquet")
    assert not list(tmp_path.iterdir()), "an invalid trace leaves no file behind"


def test_in_memory_forms_are_normalised() -> None:
    turn = Turn(np.array([1, 2], dtype=np.int32), np.int64(3))
    assert turn == Turn((1, 2), 3) and hash(turn) == hash(Turn((1, 2), 3)), (
        "arrays and numpy ints are accepted and frozen to tuples of ints"
    )
    assert type(turn.gen_len) is int, "gen_len is stored as a Python int"
    assert Trajectory("x", [turn]).turns == (turn,), "a list of turns becomes a tuple"


def test_in_memory_checks() -> None:
    with pytest.raises(TraceError, match="gen_len"):
        Turn((1,), 0)
    with pytest.raises(TraceError, match="first prompt would be empty"):
        Trajectory("x", (Turn((), 1),))
    with pytest.raises(TraceError) as info:
        check_token_ids(_sample(), 6)
    assert (info.value.trajectory_id, info.value.turn) == ("agent-a", 2), (
        "check_token_ids names the first turn with an id beyond the vocabulary"
    )


def test_trace_error_survives_pickling() -> None:
    error = TraceError("bad", field="gen_len", trajectory_id="a", turn=3, fix="do x")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.field, copy.trajectory_id, copy.turn, copy.fix) == ("gen_len", "a", 3, "do x"), (
        "TraceError crosses Ray process boundaries with its location intact"
    )
    assert str(copy) == str(error), "the message is unchanged by pickling"


_turns = st.lists(
    st.builds(
        Turn,
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(tuple),
        st.integers(1, 500),
        st.floats(0, 10, allow_nan=False),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_turns, min_size=1, max_size=4), st.floats(0, 1e6, allow_nan=False))
def test_table_round_trip_property(turn_lists: list[list[Turn]], arrival: float) -> None:
    trajectories = [
        Trajectory(f"t{i}", tuple(turns), arrival) for i, turns in enumerate(turn_lists)
    ]
    table = trajectories_to_table(trajectories)
    assert table_to_trajectories(table, VOCAB) == trajectories, "table form is lossless"
    assert np.all(np.asarray(table.column("appended_len")) >= 1), "appended_len is filled in"
