"""pack_lockstep_round: one round of data-parallel engines that step their layers together."""

from __future__ import annotations

from dualpath_ray.scheduling import pack_lockstep_round, pack_prefill_batch

Pairs = list[tuple[int, int]]


def _per_token(pairs: Pairs) -> float:
    return float(sum(bsz for _, bsz in pairs))


def _round_ms(batches: list[list[tuple[str, int, int]]]) -> float:
    return max(_per_token([(c, b) for _, c, b in batch]) for batch in batches)


def test_engines_with_their_own_work_keep_it() -> None:
    queues = [[("a", 0, 4, True)], [("b", 0, 4, True)]]
    assert pack_lockstep_round(queues, _per_token, quota_ms=10) == [[("a", 0, 4)], [("b", 0, 4)]], (
        "a balanced round is each engine's own FIFO packing, nothing moves"
    )


def test_an_idle_engine_takes_what_its_peer_cannot_fit() -> None:
    queues = [[("a", 0, 6, True), ("b", 0, 6, True), ("c", 0, 3, True)], []]
    batches = pack_lockstep_round(queues, _per_token, quota_ms=10)
    own = pack_prefill_batch([(r, c, b) for r, c, b, _ in queues[0]], _per_token, 10)
    assert own == [("a", 0, 6), ("b", 0, 4)], "alone, the first engine packs a whole and chunks b"
    assert batches[1] and batches[1][0][0] == "c", "the idle engine runs c, which its peer left for later"
    assert _round_ms(batches) <= 10, "no engine goes over the quota"


def test_a_movable_request_moves_when_that_shortens_the_round() -> None:
    queues = [[("a", 0, 5, True), ("b", 0, 4, True)], []]
    batches = pack_lockstep_round(queues, _per_token, quota_ms=10)
    assert _round_ms(batches) == 5, "moving b to the idle engine cuts the round from 9 ms to 5 ms"
    assert sorted(r for batch in batches for r, _, _ in batch) == ["a", "b"], "each request runs once"


def test_a_started_request_stays_on_its_engine() -> None:
    queues = [[("a", 100, 5, False), ("b", 100, 4, False)], []]
    batches = pack_lockstep_round(queues, _per_token, quota_ms=10)
    assert batches == [[("a", 100, 5), ("b", 100, 4)], []], (
        "requests that computed a chunk on their engine are not movable, so the idle engine idles"
    )


def test_every_request_is_packed_at_most_once_and_never_grows() -> None:
    queues = [
        [("a", 0, 9, True), ("b", 0, 9, True), ("c", 0, 2, False)],
        [("d", 0, 1, True)],
        [],
        [("e", 5, 12, True), ("f", 0, 3, True)],
    ]
    batches = pack_lockstep_round(queues, _per_token, quota_ms=10)
    wanted = {r: b for queue in queues for r, _, b, _ in queue}
    packed = [r for batch in batches for r, _, _ in batch]
    assert len(packed) == len(set(packed)), "no request is in two engines' batches"
    for batch in batches:
        for request_id, _, bsz in batch:
            assert 1 <= bsz <= wanted[request_id], f"{request_id}: packs at most the tokens it has left"
    assert _round_ms(batches) <= 10, "every engine stays within the quota"
    starts = {r: e for e, queue in enumerate(queues) for r, _, _, movable in queue if not movable}
    for engine, batch in enumerate(batches):
        for request_id, _, _ in batch:
            assert starts.get(request_id, engine) == engine, f"{request_id} is not movable and stayed put"
