"""pack_prefill_batch: compute-quota packing with a chunked tail (paper section 6)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.scheduling import pack_prefill_batch

Pairs = list[tuple[int, int]]


def _per_token(pairs: Pairs) -> float:
    return float(sum(bsz for _, bsz in pairs))


def _per_token_plus(overhead: float) -> Callable[[Pairs], float]:
    return lambda pairs: sum(bsz + overhead for _, bsz in pairs)


def test_whole_requests_then_maximal_chunk() -> None:
    queue = [("a", 0, 3), ("b", 0, 4), ("c", 0, 5), ("d", 0, 1)]
    packed = pack_prefill_batch(queue, _per_token, quota_ms=10)
    assert packed == [("a", 0, 3), ("b", 0, 4), ("c", 0, 3)], (
        "a and b fit whole (7 ms); c is cut to the 3 tokens left in the 10 ms quota and packing stops"
    )


def test_exact_fit_then_stop_without_chunk() -> None:
    packed = pack_prefill_batch([("a", 0, 10), ("b", 0, 1)], _per_token, quota_ms=10)
    assert packed == [("a", 0, 10)], "a fills the quota exactly; b has no chunk in [1, 0] and waits"


def test_no_chunk_fits_after_whole_requests() -> None:
    packed = pack_prefill_batch([("a", 0, 5), ("b", 0, 5)], _per_token_plus(2), quota_ms=9)
    assert packed == [("a", 0, 5)], "a costs 7; even one token of b costs 3 more, over the quota"


def test_first_request_chunked_when_it_alone_exceeds() -> None:
    packed = pack_prefill_batch([("a", 7, 20), ("b", 0, 1)], _per_token, quota_ms=10)
    assert packed == [("a", 7, 10)], "the largest chunk of a that fits is 10 tokens, cached kept"


def test_forced_single_token_when_nothing_fits() -> None:
    too_slow = _per_token_plus(100)
    assert pack_prefill_batch([("a", 0, 20)], too_slow, quota_ms=10) == [("a", 0, 1)], (
        "an empty batch forces one token of the first request so work progresses"
    )
    assert pack_prefill_batch([("a", 0, 1)], too_slow, quota_ms=10) == [("a", 0, 1)], (
        "a one-token request that alone exceeds the quota is forced whole"
    )


def test_cached_tokens_enter_the_prediction() -> None:
    def quadratic(pairs: Pairs) -> float:
        return sum(bsz * (cached + bsz) for cached, bsz in pairs) / 100

    packed = pack_prefill_batch([("a", 900, 100), ("b", 0, 100)], quadratic, quota_ms=1050)
    assert packed == [("a", 900, 100), ("b", 0, 70)], (
        "a costs 100 * 1000 / 100 = 1000 ms; b gets the largest b' with b'^2 / 100 <= 50, i.e. 70"
    )


def test_empty_queue_gives_empty_batch() -> None:
    assert pack_prefill_batch([], _per_token) == [], "nothing queued, nothing packed"


def test_bad_entries_are_rejected() -> None:
    with pytest.raises(ValueError, match="request 'a': bsz must be >= 1"):
        pack_prefill_batch([("a", 0, 0)], _per_token)
    with pytest.raises(ValueError, match="request 'a': cached must be >= 0"):
        pack_prefill_batch([("a", -1, 3)], _per_token)
    with pytest.raises(ValueError, match="quota_ms must be > 0"):
        pack_prefill_batch([("a", 0, 3)], _per_token, quota_ms=0)


def test_queue_and_predictor_arguments_are_not_mutated() -> None:
    seen: list[tuple[Pairs, Pairs]] = []

    def recording(pairs: Pairs) -> float:
        seen.append((pairs, list(pairs)))
        return _per_token(pairs)

    queue = [("a", 0, 4), ("b", 1, 9)]
    snapshot = list(queue)
    pack_prefill_batch(queue, recording, quota_ms=8)
    assert queue == snapshot, "the queue must not change"
    assert seen and all(passed == copied for passed, copied in seen), (
        "a list handed to the predictor must not be changed after the call"
    )


def _model(c0: float, c1: float, c2: float, c3: float) -> Callable[[Pairs], float]:
    def predict(pairs: Pairs) -> float:
        return (
            c0
            + c1 * len(pairs)
            + c2 * sum(b for _, b in pairs)
            + c3 * sum(b * (c + b) for c, b in pairs)
        )

    return predict


def _fits(predict: Callable[[Pairs], float], pairs: Pairs, quota: float) -> bool:
    return predict(pairs) <= quota


@settings(max_examples=400, deadline=None)
@given(
    queue=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 200)), max_size=12),
    coefficients=st.tuples(
        st.floats(0, 5), st.floats(0, 5), st.floats(0, 1), st.floats(0, 0.01)
    ),
    quota=st.floats(0.5, 400),
)
def test_quota_is_kept_and_the_chunk_is_maximal(
    queue: list[tuple[int, int]], coefficients: tuple[float, float, float, float], quota: float
) -> None:
    predict = _model(*coefficients)
    entries = [(f"r{i}", cached, bsz) for i, (cached, bsz) in enumerate(queue)]
    packed = pack_prefill_batch(entries, predict, quota_ms=quota)
    pairs = [(cached, bsz) for _, cached, bsz in packed]

    assert [p[0] for p in packed] == [e[0] for e in entries[: len(packed)]], "FIFO prefix"
    assert all(p == e for p, e in zip(packed[:-1], entries)), "all but the last go in whole"
    if entries:
        assert packed, "a non-empty queue always yields a non-empty batch"
    if packed and not _fits(predict, pairs, quota):
        assert len(packed) == 1 and packed[0][2] == 1, (
            "only the forced single-token first request may exceed the quota"
        )
    if packed:
        _, cached, chunk = packed[-1]
        original = entries[len(packed) - 1][2]
        forced = len(packed) == 1 and not _fits(predict, pairs, quota)
        if chunk < original and not forced:
            grown = pairs[:-1] + [(cached, chunk + 1)]
            assert not _fits(predict, grown, quota), "one more token in the chunk would exceed the quota"
    if len(packed) < len(entries) and packed and packed[-1] == entries[len(packed) - 1]:
        _, cached, _ = entries[len(packed)]
        assert not _fits(predict, pairs + [(cached, 1)], quota), (
            "packing stopped without a chunk only if no single token of the next request fits"
        )


def test_token_capacity_bounds_the_batch_and_cuts_the_tail() -> None:
    packed = pack_prefill_batch([("a", 40, 10), ("b", 30, 20), ("c", 0, 5)], _per_token, quota_ms=1000, max_tokens=90)
    assert packed == [("a", 40, 10), ("b", 30, 10)], (
        "a holds 50 tokens; b gets the 40 left: its 30 cached + a 10-token chunk; packing stops"
    )
    assert pack_prefill_batch([("a", 40, 10), ("b", 40, 20)], _per_token, 1000, max_tokens=80) == [("a", 40, 10)], (
        "b's 40 cached tokens alone overflow the 30 left, so b waits whole"
    )
    assert pack_prefill_batch([("a", 10, 100)], _per_token, 1000, max_tokens=50) == [("a", 10, 40)], (
        "a first request longer than the capacity is chunked to fit it"
    )


def test_a_request_whose_cache_alone_overflows_the_capacity_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefill_hbm_tokens"):
        pack_prefill_batch([("a", 64, 1)], _per_token, 1000, max_tokens=64)


def test_chunks_still_running_count_against_the_quota_and_the_tokens() -> None:
    """Continuous batching (runtime/compute/continuous_prefill.py): what is already admitted
    counts as the batch's head; with it nothing is forced in to make progress."""
    running = [(0, 6)]
    assert pack_prefill_batch([("a", 0, 3), ("b", 0, 3)], _per_token, quota_ms=10, running=running) == [
        ("a", 0, 3), ("b", 0, 1)
    ], "the quota left beside the running chunk (4 ms) takes a whole and cuts the next"
    assert pack_prefill_batch([("a", 0, 3)], _per_token, quota_ms=10, running=[(0, 10)]) == [], (
        "a quota the running chunks fill admits nothing, not even one token"
    )
    assert pack_prefill_batch([("a", 6, 5)], _per_token, quota_ms=100, max_tokens=12, running=[(0, 6)]) == [], (
        "a request whose cached tokens do not fit beside the running ones waits (no error while others run)"
    )
    assert pack_prefill_batch([("a", 0, 9)], _per_token, quota_ms=100, max_tokens=12, running=[(2, 6)]) == [("a", 0, 4)], (
        "the window's tokens left beside the running chunk's cached + new tokens bound the cut"
    )
