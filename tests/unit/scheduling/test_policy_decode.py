"""assign_decode_groups (phase 1) and assign_decode_in_group (phase 2): cases and properties."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.scheduling import (
    Assignment,
    EngineLoad,
    QueuedRequest,
    assign_decode_groups,
    assign_decode_in_group,
)
from tests.unit.scheduling._policy_reference import (
    reference_assign_decode_groups,
    reference_assign_decode_in_group,
)


def _queue(*tokens: int) -> list[QueuedRequest]:
    return [QueuedRequest(f"r{i + 1}", t) for i, t in enumerate(tokens)]


def _de(engine_id: str, seq: int, tok: int, free: int) -> EngineLoad:
    return EngineLoad(engine_id, "n0", seq=seq, tok=tok, free_hbm_tokens=free)


def test_groups_take_requests_by_min_summed_tok_ties_in_mapping_order() -> None:
    groups = {
        "g0": [_de("a", 0, 10, 0), _de("b", 0, 0, 0)],
        "g1": [_de("c", 0, 5, 0)],
        "g2": [_de("d", 0, 10, 0)],
    }
    result = assign_decode_groups(_queue(3, 3, 10), groups)
    assert [a.target for a in result] == ["g1", "g1", "g0"], (
        "sums 10/5/10: r1 and r2 go to g1 (5 -> 8 -> 11), then g0 and g2 tie at 10 and g0 is first"
    )


def test_groups_empty_queue_or_no_groups() -> None:
    assert assign_decode_groups([], {"g0": [_de("a", 0, 0, 0)]}) == [], "empty queue assigns nothing"
    assert assign_decode_groups(_queue(1), {}) == [], "no groups, nowhere to assign"


def test_group_without_engines_is_rejected() -> None:
    with pytest.raises(ValueError, match="decode group 'g1' has no engines"):
        assign_decode_groups(_queue(1), {"g0": [_de("a", 0, 0, 0)], "g1": []})


def test_in_group_worked_example() -> None:
    engines = [_de("E0", 2, 100, 100), _de("E1", 0, 50, 30), _de("E2", 1, 0, 200)]
    # Total free 330 admits all five (270 tokens); Z = 1.0 * (270 + 150) / 3 = 140.
    result = assign_decode_in_group(_queue(40, 20, 60, 100, 50), engines, margin=1.0)
    assert [a.target for a in result] == ["E2", "E1", "E2", "E0", "E2"], (
        "r1: E1 lacks HBM, E0/E2 normal, min seq E2; r2: all normal, min seq E1; r3: E0 would pass Z, "
        "E2 normal; r4: both candidates high, min tok tie -> earliest E0; r5: only E2 has room"
    )


def test_in_group_seq_ties_break_on_tok_then_position() -> None:
    engines = [_de("A", 0, 10, 100), _de("B", 0, 5, 100), _de("C", 0, 5, 100)]
    result = assign_decode_in_group(_queue(1), engines, margin=100.0)
    assert result == [Assignment("r1", "B")], "equal seq: min tok (B, C), then the earliest (B)"


def test_in_group_high_only_picks_min_tok() -> None:
    engines = [_de("A", 0, 30, 100), _de("B", 5, 20, 100)]
    # Z = 1.0 * (50 + 50) / 2 = 50: both A (80) and B (70) would exceed it.
    result = assign_decode_in_group(_queue(50), engines, margin=1.0)
    assert result == [Assignment("r1", "B")], "with C_norm empty the min tok of C_high wins"


def test_in_group_no_hbm_assigns_nothing() -> None:
    engines = [_de("A", 0, 0, 0), _de("B", 0, 0, 0)]
    assert assign_decode_in_group(_queue(1, 1), engines) == [], "no engine has free HBM"


def test_in_group_stops_at_first_request_without_room() -> None:
    engines = [_de("A", 0, 0, 50)]
    assert assign_decode_in_group(_queue(60, 10), engines) == [], (
        "r1 fits nowhere, so the call ends there even though r2 would fit"
    )


def test_in_group_fragmented_hbm_stops() -> None:
    engines = [_de("A", 0, 0, 50), _de("B", 0, 0, 50)]
    assert assign_decode_in_group(_queue(60), engines) == [], (
        "R admits r1 (60 <= 100 in total) but no single engine has 60 free"
    )


def test_in_group_empty_inputs() -> None:
    assert assign_decode_in_group([], [_de("A", 0, 0, 10)]) == [], "empty queue assigns nothing"
    assert assign_decode_in_group(_queue(1), []) == [], "an empty group assigns nothing"


def test_decode_inputs_are_not_mutated() -> None:
    queue = _queue(5, 7, 3)
    engines = [_de("A", 1, 3, 10), _de("B", 0, 9, 8)]
    groups = {"g0": engines, "g1": [_de("C", 0, 0, 4)]}
    before = copy.deepcopy((queue, engines, groups))
    assign_decode_in_group(queue, engines)
    assign_decode_groups(queue, groups)
    assert (queue, engines, groups) == before, "the decode policy must not change its inputs"


_de_lists = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 40)), max_size=6
).map(lambda rows: [_de(f"e{i}", s, t, f) for i, (s, t, f) in enumerate(rows)])


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 15), max_size=25),
    groups=st.lists(_de_lists.filter(bool), max_size=5),
)
def test_groups_match_the_literal_rule(tokens: list[int], groups: list[list[EngineLoad]]) -> None:
    queue = _queue(*tokens)
    mapping = {f"g{i}": members for i, members in enumerate(groups)}
    result = assign_decode_groups(queue, mapping)
    assert result == reference_assign_decode_groups(queue, mapping), (
        "the heap must pick the min-sum group with mapping-order ties, exactly like a scan"
    )
    if mapping:
        assert len(result) == len(queue), "phase 1 drains the whole global queue"


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 15), max_size=25),
    engines=_de_lists,
    margin=st.sampled_from([1.0, 1.05, 1.5, 3.0]),
)
def test_in_group_matches_the_literal_rule_and_respects_hbm(
    tokens: list[int], engines: list[EngineLoad], margin: float
) -> None:
    queue = _queue(*tokens)
    result = assign_decode_in_group(queue, engines, margin)
    assert result == reference_assign_decode_in_group(queue, engines, margin), (
        "sorted-list picks must equal the literal C_norm/C_high scan, ties included"
    )
    assert [a.request_id for a in result] == [r.request_id for r in queue[: len(result)]], (
        "phase 2 assigns a prefix of the private queue"
    )
    used = {e.engine_id: 0 for e in engines}
    for assignment, request in zip(result, queue):
        used[assignment.target] += request.tokens
    for engine in engines:
        assert used[engine.engine_id] <= engine.free_hbm_tokens, (
            f"engine {engine.engine_id} got more tokens than its free HBM"
        )
