"""assign_prefill and choose_read_path: hand-worked cases and properties (issue 3)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.scheduling import (
    Assignment,
    EngineLoad,
    QueuedRequest,
    assign_prefill,
    choose_read_path,
)
from tests.unit.scheduling._policy_reference import reference_assign_prefill


def _queue(*tokens: int) -> list[QueuedRequest]:
    return [QueuedRequest(f"r{i + 1}", t) for i, t in enumerate(tokens)]


def _pe(engine_id: str, node_id: str, tok: int) -> EngineLoad:
    return EngineLoad(engine_id, node_id, seq=0, tok=tok)


def test_worked_example_prefers_short_read_queue_then_min_tok() -> None:
    engines = [_pe("A", "n0", 0), _pe("B", "n0", 5), _pe("C", "n1", 0)]
    read_q = {"n0": 0, "n1": 100}
    result = assign_prefill(_queue(10, 10, 10, 10, 10, 10), engines, read_q, alpha=10, beta=20)
    targets = [a.target for a in result]
    assert targets == ["A", "B", "A", "B", "A", "C"], (
        "C2 (short read queue) engines take requests by min tok until both pass beta, then C3"
    )
    assert result[0] == Assignment("r1", "A"), "an assignment is (request_id, engine_id)"


def test_ties_go_to_the_earliest_engine() -> None:
    engines = [_pe("A", "n0", 3), _pe("B", "n0", 3), _pe("C", "n0", 3)]
    result = assign_prefill(_queue(1, 1, 1, 1), engines, {"n0": 0}, alpha=0, beta=100)
    assert [a.target for a in result] == ["A", "B", "C", "A"], "equal tok is broken by engine order"


def test_short_read_queue_wins_even_with_more_tokens() -> None:
    engines = [_pe("far", "n1", 0), _pe("near", "n0", 90)]
    result = assign_prefill(_queue(5), engines, {"n0": 3, "n1": 4}, alpha=3, beta=100)
    assert result == [Assignment("r1", "near")], "read_q == alpha is short (C2) and C2 beats C3"


def test_tok_equal_to_beta_is_still_eligible() -> None:
    engines = [_pe("A", "n0", 20)]
    result = assign_prefill(_queue(7), engines, {"n0": 0}, alpha=1, beta=20)
    assert result == [Assignment("r1", "A")], "only tok > beta is overloaded (C1)"


def test_empty_queue_assigns_nothing() -> None:
    assert assign_prefill([], [_pe("A", "n0", 0)], {"n0": 0}, 1, 1) == [], "no requests, no assignments"


def test_no_engines_assigns_nothing() -> None:
    assert assign_prefill(_queue(1), [], {}, 1, 1) == [], "no engines, no assignments"


def test_all_overloaded_engines_get_nothing() -> None:
    engines = [_pe("A", "n0", 21), _pe("B", "n1", 50)]
    result = assign_prefill(_queue(1, 1), engines, {"n0": 0, "n1": 99}, alpha=10, beta=20)
    assert result == [], "every engine is in C1, so the call assigns nothing"


def test_call_stops_at_first_unplaceable_request() -> None:
    engines = [_pe("A", "n0", 0)]
    result = assign_prefill(_queue(11, 1), engines, {"n0": 0}, alpha=0, beta=10)
    assert result == [Assignment("r1", "A")], "after r1 A exceeds beta; r2 and later stay queued"


def test_missing_read_queue_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="read_q has no entry for node 'n9'"):
        assign_prefill(_queue(1), [_pe("A", "n9", 0)], {}, 1, 1)


def test_duplicate_engine_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="repeated: A"):
        assign_prefill(_queue(1), [_pe("A", "n0", 0), _pe("A", "n0", 0)], {"n0": 0}, 1, 1)


def test_inputs_are_not_mutated() -> None:
    queue = _queue(4, 9, 2)
    engines = [_pe("A", "n0", 0), _pe("B", "n1", 1)]
    read_q = {"n0": 5, "n1": 0}
    before = copy.deepcopy((queue, engines, read_q))
    assign_prefill(queue, engines, read_q, alpha=1, beta=5)
    assert (queue, engines, read_q) == before, "assign_prefill must not change its inputs"


def test_choose_read_path_shorter_queue_and_tie_to_pe() -> None:
    assert choose_read_path(3, 4) == "pe", "the PE node has the shorter read queue"
    assert choose_read_path(5, 4) == "de", "the DE node has the shorter read queue"
    assert choose_read_path(7, 7) == "pe", "a tie reads through the PE path"


_engine_lists = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 30)), min_size=0, max_size=8
).map(lambda rows: [_pe(f"e{i}", f"n{node}", tok) for i, (node, tok) in enumerate(rows)])


@settings(max_examples=300, deadline=None)
@given(
    engines=_engine_lists,
    tokens=st.lists(st.integers(1, 12), max_size=30),
    read_q=st.lists(st.integers(0, 10), min_size=4, max_size=4),
    alpha=st.integers(0, 10),
    beta=st.integers(0, 40),
)
def test_matches_the_literal_rule_and_keeps_fifo(
    engines: list[EngineLoad], tokens: list[int], read_q: list[int], alpha: int, beta: int
) -> None:
    queue = _queue(*tokens)
    node_q = {f"n{i}": q for i, q in enumerate(read_q)}
    result = assign_prefill(queue, engines, node_q, alpha, beta)
    assert result == reference_assign_prefill(queue, engines, node_q, alpha, beta), (
        "the heap implementation must pick exactly what the per-request scan of C1/C2/C3 picks"
    )
    assert [a.request_id for a in result] == [r.request_id for r in queue[: len(result)]], (
        "assigned requests are a prefix of the queue, in FIFO order"
    )
    tok = {e.engine_id: e.tok for e in engines}
    for assignment, request in zip(result, queue):
        assert tok[assignment.target] <= beta, "no request goes to an engine already past beta"
        tok[assignment.target] += request.tokens
