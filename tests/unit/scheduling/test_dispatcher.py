"""The dispatcher's request lifecycle: cancelling a request leaves no trace in any queue."""

from __future__ import annotations

import pytest

from dualpath_ray.scheduling.dispatcher import Constants, Dispatcher
from dualpath_ray.scheduling.requests import IllegalTransition, Request, RequestState, transition
from dualpath_ray.scheduling.loads import EngineLoad

DECODE = (EngineLoad("d0/g0", "d0", 0, 0, free_hbm_tokens=10_000),)
PREFILL = (EngineLoad("p0/g0", "p0", 0, 0),)


def queued_everywhere() -> Dispatcher:
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=4096))
    for rid in ("a", "b", "c"):
        dispatcher.submit(Request(rid, 256, 128, 320))
    dispatcher.fetch_decode("d0", DECODE)  # all three placed, waiting for a prefill engine
    return dispatcher


@pytest.mark.parametrize("victim", ["a", "b", "c"])
def test_a_cancelled_request_leaves_every_queue_and_others_proceed(victim: str) -> None:
    dispatcher = queued_everywhere()
    dispatcher.submit(Request("late", 256, 0, 320))  # still in the global decode queue
    entry = dispatcher.cancel(victim)
    assert entry is not None and entry.state is RequestState.FAILED, "a cancelled request ends FAILED"
    assert dispatcher.cancel("late") is not None, "a request still waiting for a decode engine cancels too"
    assert victim not in dispatcher.prefill_queue and "late" not in dispatcher.decode_global, (
        "no queue keeps a cancelled id (a later fetch would look up a missing entry)"
    )
    placed = [d.request_id for d in dispatcher.fetch_prefill(PREFILL)]
    assert victim not in placed and set(placed) <= {"a", "b", "c"} - {victim}, "only live requests are placed"
    assert dispatcher.cancel(victim) is None, "cancelling twice is a no-op"


def test_terminal_states_have_no_way_out() -> None:
    dispatcher = queued_everywhere()
    entry = dispatcher.cancel("a")
    assert entry is not None
    with pytest.raises(IllegalTransition):
        transition(entry, RequestState.PREFILLING)


def test_a_dead_engines_requests_are_found_and_its_group_stops_receiving_work() -> None:
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=4096))
    two = (EngineLoad("d0/g0", "d0", 0, 0, free_hbm_tokens=700), EngineLoad("d0/g1", "d0", 0, 0, free_hbm_tokens=700))
    for rid in ("a", "b", "c", "d", "e"):
        dispatcher.submit(Request(rid, 256, 0, 320))  # 2 fit per engine: "e" stays in the group's private queue
    placed = dispatcher.fetch_decode("d0", two)
    on_g1 = {d.request_id for d in placed if d.decode_engine == "d0/g1"}
    assert on_g1 and {r.request_id for r in dispatcher.requests_on("d0/g1")} == on_g1, "requests reserved on the engine are found"
    assert dispatcher.engines_in_use() == {"d0/g0", "d0/g1"}, "both engines hold reservations"
    assert list(dispatcher.decode_private["d0"]) == ["e"], "e waits in the group's private queue"
    dispatcher.forget_engine("d0/g1")
    assert "d0" not in dispatcher.decode_loads, "the dead engine's group gets nothing until it reports again"
    assert list(dispatcher.decode_global) == ["e"], "its private queue goes back to the global queue"
    assert dispatcher.fetch_decode("d0", ()) == [], "a group whose engines all died places nothing"


@pytest.mark.parametrize("stage", ["queued_decode", "queued_prefill", "prefilling"])
def test_a_request_failed_while_waiting_is_retried_under_its_id_without_a_stale_copy(stage: str) -> None:
    """A request fails in any live state (its decode engine died while it waited for a prefill
    engine, say) and is resubmitted under the same id: no queue may keep the failed copy, or
    the next fetch meets it in the wrong state and every later prefill pull fails."""
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=4096))
    for rid in ("a", "b"):
        dispatcher.submit(Request(rid, 256, 128, 320))
    if stage != "queued_decode":
        dispatcher.fetch_decode("d0", DECODE)
    if stage == "prefilling":
        dispatcher.fetch_prefill(PREFILL[:1])
        assert dispatcher.requests["a"].state is RequestState.PREFILLING
    dispatcher.check_integrity()
    dispatcher.finish("a", failed=True)
    dispatcher.check_integrity()
    dispatcher.submit(Request("a", 256, 128, 320))
    dispatcher.check_integrity()
    dispatcher.fetch_decode("d0", DECODE)
    dispatcher.check_integrity()
    placed = [d.request_id for d in dispatcher.fetch_prefill(PREFILL)]
    dispatcher.check_integrity()
    assert placed.count("a") == 1, f"the retry is placed exactly once: {placed}"
    assert all(e.state is RequestState.PREFILLING for e in dispatcher.requests.values()), "both requests are prefilling"


def test_the_integrity_check_catches_a_stale_queued_id() -> None:
    dispatcher = queued_everywhere()
    dispatcher.prefill_queue.append("a")
    with pytest.raises(AssertionError, match="more than once"):
        dispatcher.check_integrity()
    dispatcher.prefill_queue.pop()
    dispatcher.requests.pop("b")
    with pytest.raises(AssertionError, match="not live requests"):
        dispatcher.check_integrity()


def _decode_group(node: str) -> tuple[EngineLoad, ...]:
    return (EngineLoad(f"{node}/g0", node, 0, 0, free_hbm_tokens=100_000),)


def test_a_fresh_dispatcher_spreads_its_first_burst_over_every_decode_group() -> None:
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=4096), decode_groups=2)
    for rid in ("a", "b", "c", "d"):
        dispatcher.submit(Request(rid, 256, 0, 320))  # a burst queued before any leader pulled
    assert dispatcher.fetch_decode("d0", _decode_group("d0")) == [], (
        "the first group to pull does not take the whole burst while the other has not reported"
    )
    on_d1 = {r.request_id for r in dispatcher.fetch_decode("d1", _decode_group("d1"))}
    on_d0 = {r.request_id for r in dispatcher.fetch_decode("d0", _decode_group("d0"))}
    assert on_d0 and on_d1 and on_d0 | on_d1 == {"a", "b", "c", "d"}, (
        f"once both groups reported, phase 1 spread the burst over both: d0 {on_d0}, d1 {on_d1}"
    )


def test_a_decode_group_that_never_reports_holds_the_first_spread_only_a_few_pulls() -> None:
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=4096), decode_groups=2)
    dispatcher.submit(Request("a", 256, 0, 320))
    pulls = [dispatcher.fetch_decode("d0", _decode_group("d0")) for _ in range(5)]
    assert [len(p) for p in pulls] == [0, 0, 0, 0, 1], (
        "with d1 gone for good, d0 takes the request after 2 x 2 held pulls, not never"
    )
    dispatcher.submit(Request("b", 256, 0, 320))
    assert [r.request_id for r in dispatcher.fetch_decode("d0", _decode_group("d0"))] == ["b"], (
        "only the first spread is held: later requests go out at the next pull"
    )
