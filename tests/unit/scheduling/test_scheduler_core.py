"""The pure scheduler core driven by fake load reports, as the runtime and the simulator drive it:
a request's whole life in one record, hits found in the index with one token left to compute,
placement and the read path, and what a death fails before and after the KV handoff."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.requests import IllegalTransition, RequestState, transition
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Mode, ReadPath

BLOCK = 16
NAMESPACE = "model@0"


def core(mode: Mode = Mode.DUALPATH, alpha: int = 10_000) -> SchedulerCore:
    return SchedulerCore(CoreSettings(mode, BLOCK, Constants(alpha, 100_000)), PrefixIndex(BLOCK))


def spec(rid: str, tokens: int, attempt: int = 0, seed: int = 0) -> RequestSpec:
    prompt = np.random.default_rng(seed).integers(0, 512, tokens)
    return RequestSpec(rid, attempt, prompt, SamplingParams(max_new_tokens=8), NAMESPACE, 0.0)


def decode(*engines: tuple[str, int], read_q: int = 0) -> GroupReport:
    return GroupReport("decode/d0", "d0", tuple(EngineLoad(e, "d0", 0, 0, free) for e, free in engines), read_q)


def prefill(*engines: str, read_q: int = 0) -> GroupReport:
    return GroupReport("prefill/p0", "p0", tuple(EngineLoad(e, "p0", 0, 0) for e in engines), read_q)


def result_of(s: RequestSpec, persisted: tuple[PersistedBlock, ...] = (), error: str | None = None) -> TurnResult:
    return TurnResult(s.request_id, s.attempt, (1,), (0.0,), "length", len(s.prompt), 0, ReadPath.PE,
                      "prefill/p0/g0", "decode/d0/g0", 0.1, 0.01, persisted=persisted, error=error)


def serve_and_store(c: SchedulerCore, s: RequestSpec, hbm: int = 10_000) -> list[str]:
    """Serve `s` alone and publish every full block of its prompt, as a finished turn does;
    returns the block keys."""
    keys = block_keys(s.prompt, BLOCK, NAMESPACE)
    c.submit(s)
    c.fetch_decode(decode(("decode/d0/g0", hbm)))
    c.fetch_prefill(prefill("prefill/p0/g0"))
    c.finish(result_of(s, tuple(PersistedBlock(k, p) for k, p in zip(keys, [None, *keys[:-1]]))))
    return keys


def test_a_request_lives_in_one_record_from_submit_to_done() -> None:
    c = core()
    s = spec("r", 40)
    request = c.submit(s)
    assert request.state is RequestState.QUEUED_DECODE and c.requests["r"] is request, "one record, queued"
    assert request.decode_tokens == 48, "the reservation is prompt + max new tokens in whole pages (3 x 16)"
    (reservation,) = c.fetch_decode(decode(("decode/d0/g0", 1000)))
    assert (reservation.decode_engine, reservation.tokens) == ("decode/d0/g0", 48)
    assert request.state is RequestState.QUEUED_PREFILL, "a decode engine holds its HBM; it waits for a prefill engine"
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0"))
    assert task.request is s and task.decode_engine == "decode/d0/g0", "the task carries the caller's spec"
    assert request.state is RequestState.PREFILLING and request.prefill_engine == "prefill/p0/g0"
    assert c.handed_off("r") and request.state is RequestState.DECODING, "the KV handoff moves it to decoding"
    assert not c.handed_off("r"), "a second sighting of the handoff changes nothing"
    assert c.finish(result_of(s)) == () and request.state is RequestState.DONE, "done, no engine to cancel at"
    assert not c.requests, "a finished request leaves the core"
    c.dispatcher.check_integrity()


def test_published_blocks_are_hit_by_the_next_turn_leaving_one_token_to_compute() -> None:
    c = core()
    first = spec("t0", 64)
    keys = serve_and_store(c, first, hbm=1000)
    again = RequestSpec("t1", 0, first.prompt, first.sampling, NAMESPACE, 0.0)
    assert c.lookup(again)[1] == 48, "all 64 tokens are stored, but the last block stays to compute the logits"
    longer = RequestSpec("t2", 0, np.concatenate([first.prompt, [1, 2, 3]]), first.sampling, NAMESPACE, 0.0)
    assert c.lookup(longer) == (tuple(keys), 64), "a longer prompt hits every stored block"


@pytest.mark.parametrize(("mode", "path"), [(Mode.DUALPATH, ReadPath.DE), (Mode.BASIC, ReadPath.PE)])
def test_the_read_path_follows_the_shorter_read_queue_only_in_dualpath_mode(mode: Mode, path: ReadPath) -> None:
    c = core(mode)
    c.submit(spec("r", 40))
    c.fetch_decode(decode(("decode/d0/g0", 1000), read_q=0))
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0", read_q=500))
    assert task.path is path, f"{mode.value}: the prefill node's queue is longer, so {path.value}"
    assert not task.oracle


def test_oracle_tasks_say_so() -> None:
    c = core(Mode.ORACLE)
    c.submit(spec("r", 40))
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0"))
    assert task.oracle and task.path is ReadPath.PE, "oracle mode reads nothing; the task is marked for in-place KV"


def test_a_prefill_engine_death_fails_what_it_prefills_but_not_what_it_handed_off() -> None:
    c = core()
    for rid in ("a", "b"):
        c.submit(spec(rid, 40, seed=ord(rid)))
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    c.fetch_prefill(prefill("prefill/p0/g0"))
    c.handed_off("a")
    failed = c.engine_died("prefill/p0/g0")
    assert [s.request_id for s in failed] == ["b"], "a's KV is at its decode engine already; only b depended on the dead engine"
    assert [s.request_id for s in c.engine_died("decode/d0/g0")] == ["a", "b"], "both hold HBM on the decode engine"


def test_the_lifecycle_rejects_illegal_moves() -> None:
    c = core()
    request = c.submit(spec("r", 40))
    with pytest.raises(IllegalTransition):
        transition(request, RequestState.DECODING)
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    assert c.abandon("r") == ("decode/d0/g0",), "abandoning names the engine holding its reservation"
    with pytest.raises(IllegalTransition):
        transition(request, RequestState.QUEUED_PREFILL)


def test_a_failed_attempt_names_the_engines_to_cancel_and_its_retry_is_queued_afresh() -> None:
    c = core()
    s = spec("r", 40)
    c.submit(s)
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    assert c.finish(result_of(s, error="boom")) == ("decode/d0/g0",), "its HBM reservation is to be cancelled"
    retry = spec("r", 40, attempt=1)
    c.submit(retry)
    c.dispatcher.check_integrity()
    assert c.is_current(result_of(retry)) and not c.is_current(result_of(s)), "only the retry's result counts"


def test_proportional_split_reads_share_a_requests_hits_by_read_queue_headroom() -> None:
    c = SchedulerCore(CoreSettings(Mode.DUALPATH, BLOCK, Constants(1000, 100_000), read_split="proportional"),
                      PrefixIndex(BLOCK))
    first = spec("t0", 130)
    serve_and_store(c, first)
    again = RequestSpec("t1", 0, np.concatenate([first.prompt, [7] * 20]), first.sampling, NAMESPACE, 0.0)
    c.submit(again)
    c.fetch_decode(decode(("decode/d0/g0", 10_000), read_q=600))
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0", read_q=200))
    assert len(task.hit_keys) == 8, "the 8 stored blocks are hits"
    assert task.path is ReadPath.SPLIT and task.pe_hit_blocks == 5, (
        "headroom below alpha=1000 is 800 on the prefill node and 400 on the decode node: 8 x 2/3 -> 5 blocks go PE"
    )
    assert c.dispatcher.read_q == {"p0": 200 + 5 * BLOCK, "d0": 600 + 3 * BLOCK}, (
        "until the readers report again, each side's queue counts the share it was given"
    )


def test_a_prefill_engines_load_counts_the_tokens_its_requests_compute_not_their_prompts() -> None:
    """beta bounds what a prefill engine has to compute: a turn with 48 of its 64 tokens cached
    weighs 16, a cold 64-token turn 64 (a cold burst can no longer all land on the first puller)."""
    c = SchedulerCore(CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, 40)), PrefixIndex(BLOCK))
    first = spec("warm-0", 64)
    serve_and_store(c, first)
    for i in range(3):  # the same prompt again: 48 tokens hit, 16 to compute
        c.submit(RequestSpec(f"warm-{i + 1}", 0, first.prompt, first.sampling, NAMESPACE, 0.0))
    c.fetch_decode(decode(("decode/d0/g0", 10_000)))
    assert [r.prefill_tokens for r in c.requests.values()] == [16, 16, 16], "prompt minus hits"
    tasks = c.fetch_prefill(prefill("prefill/p0/g0"))
    assert len(tasks) == 3, "16 + 16 <= beta (40), so the third still fits; 64-token prompts would have stopped at one"
    c.submit(spec("cold-a", 64, seed=1))
    c.submit(spec("cold-b", 64, seed=2))
    c.fetch_decode(decode(("decode/d0/g0", 10_000)))
    idle = GroupReport("prefill/p1", "p1", (EngineLoad("prefill/p1/g0", "p1", 0, 0),), 0)
    assert [t.request_id for t in c.fetch_prefill(idle)] == ["cold-a"], (
        "a cold 64-token turn alone puts an idle engine over beta: the next waits for another engine"
    )


def test_a_turn_whose_chain_left_the_index_finishes_and_publishes_nothing_orphaned() -> None:
    c = core()
    first = spec("t0", 40)
    keys = serve_and_store(c, first)
    follow = RequestSpec("t1", 0, np.concatenate([first.prompt, np.arange(30)]), SamplingParams(max_new_tokens=8),
                         NAMESPACE, 0.0)
    c.submit(follow)
    c.fetch_decode(decode(("decode/d0/g0", 10_000)))
    c.fetch_prefill(prefill("prefill/p0/g0"))
    c.reset_prefix_cache()  # verl's abort with reset_prefix_cache, while t1 runs
    chain = block_keys(follow.prompt, BLOCK, NAMESPACE)
    persisted = tuple(PersistedBlock(k, p) for k, p in zip(chain[len(keys):], chain[len(keys) - 1:]))
    c.finish(result_of(follow, persisted))  # its first block's parent is gone: raised ValueError before
    assert not c.requests, "the turn finished (a lost frame would leave it waiting for its deadline)"
    assert len(c.index) == 0 and c.unpublished_blocks == len(persisted), (
        "an orphan chain is not published (no lookup could reach it), and it is counted"
    )


def test_an_engine_that_is_not_ready_gets_no_work_until_it_is() -> None:
    c = core()
    assert c.engine_readiness("decode/d0/g0", False), "turning unready is a change"
    assert not c.engine_readiness("decode/d0/g0", False), "saying it again is not"
    c.submit(spec("r", 40))
    assert c.fetch_decode(decode(("decode/d0/g0", 1000))) == [], "an unready engine is out of service"
    assert c.engine_readiness("decode/d0/g0", True)
    (reservation,) = c.fetch_decode(decode(("decode/d0/g0", 1000)))
    assert reservation.decode_engine == "decode/d0/g0", "ready again: it takes work"


def test_a_read_that_failed_on_one_reader_is_retried_through_the_other_then_repaired() -> None:
    import dataclasses

    from dualpath_ray.protocol.messages import ErrorKind

    c = core()
    first = spec("t1", 80, seed=7)
    keys = serve_and_store(c, first)
    s = spec("t2", 80, seed=7)  # the same prompt: its hits are t1's blocks
    c.submit(s)
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0", read_q=0))
    assert task.path is ReadPath.PE, "an idle prefill-side reader reads the hits (the shorter queue; ties to PE)"
    failed = dataclasses.replace(result_of(s, error="EIO"), error_kind=ErrorKind.KV_UNREADABLE,
                                 bad_keys=(keys[1],), failed_reader="p0")
    c.finish(failed)
    retry, unindexed = c.next_attempt(failed, s)
    assert (retry.attempt, retry.avoid_reader, unindexed) == (1, "p0", 0), (
        "an I/O error on the prefill node's reader: the retry avoids that reader and nothing is repaired"
    )
    assert c.reread_elsewhere == {"kv_unreadable": 1}, "counted by cause"
    c.submit(retry)
    c.fetch_decode(decode(("decode/d0/g0", 1000)))
    (task,) = c.fetch_prefill(prefill("prefill/p0/g0", read_q=0))
    assert task.path is ReadPath.DE and task.hit_keys == tuple(keys[:4]), (
        "the retry reads every hit block through the decode node's reader"
    )
    failed_again = dataclasses.replace(result_of(retry, error="EIO"), error_kind=ErrorKind.KV_UNREADABLE,
                                       bad_keys=(keys[1],), failed_reader="d0")
    c.finish(failed_again)
    third, unindexed = c.next_attempt(failed_again, retry)
    assert third.avoid_reader == "" and unindexed == len(keys) - 1, (
        "unreadable on both sides: the block and its successors leave the index, the next retry recomputes them"
    )


def test_a_corrupt_block_is_repaired_at_once_whoever_read_it() -> None:
    import dataclasses

    from dualpath_ray.protocol.messages import ErrorKind

    c = core()
    keys = serve_and_store(c, spec("t1", 80, seed=3))
    s = spec("t2", 80, seed=3)
    failed = dataclasses.replace(result_of(s, error="checksum"), error_kind=ErrorKind.KV_CORRUPT,
                                 bad_keys=(keys[2],), failed_reader="p0")
    retry, unindexed = c.next_attempt(failed, s)
    assert retry.avoid_reader == "" and unindexed == len(keys) - 2, (
        "a checksum failure is the block's on every reader: repaired, not read elsewhere"
    )
