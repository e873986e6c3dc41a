"""The scheduler's liveness watch on a fake clock: silent engines, lost attempts, deliveries,
and an attempt retried under the same request id starting a clock of its own."""

from __future__ import annotations

import numpy as np

from dualpath_ray.protocol.messages import Holding, RequestSpec, SamplingParams
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.requests import Request, RequestState

GRACE = 10.0
PE, DE = "prefill/p0/g0", "decode/d0/g0"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, state: RequestState, attempt: int = 0) -> Request:
    spec = RequestSpec(rid, attempt, np.arange(8), SamplingParams(), "ns", 0.0)
    r = Request(rid, 8, 0, 16, (), spec, state)
    r.decode_engine = DE if state is not RequestState.QUEUED_DECODE else ""
    r.prefill_engine = PE if state in (RequestState.PREFILLING, RequestState.DECODING) else ""
    return r


def test_an_engine_is_presumed_dead_only_after_grace_of_silence_in_a_row() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    assert not live.missed(PE), "one missed beat is silence, not death"
    clock.t += GRACE - 0.1
    assert not live.missed(PE), "silent just under the grace: still not dead"
    live.answered(PE)
    clock.t += 5.0
    assert not live.missed(PE), "an answer restarts the count"
    clock.t += GRACE
    assert live.missed(PE), "silent for the whole grace: presumed dead"
    assert live.tracked() == (0, 0, 0), "a verdict clears the engine's clock"


def test_an_attempt_no_engine_holds_is_lost_after_the_grace() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    r = request("r", RequestState.PREFILLING)
    assert live.check([r], {PE: {}, DE: {}}, set()).lost == [], "unheld for an instant is not lost"
    clock.t += GRACE
    assert live.check([r], {PE: {}, DE: {}}, set()).lost == [r.spec], "unheld for the grace: lost"
    assert live.tracked() == (0, 0, 0), "a lost verdict forgets its clock"


def test_an_attempt_held_by_its_prefill_or_decode_engine_is_never_lost() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    prefilling, decoding = request("p", RequestState.PREFILLING), request("d", RequestState.DECODING)
    held = {PE: {"p": Holding(0, False)}, DE: {"d": Holding(0, True)}}
    for _ in range(3):
        clock.t += GRACE
        assert live.check([prefilling, decoding], held, set()).lost == [], "held attempts are alive"


def test_queued_attempts_are_held_by_the_scheduler_and_never_judged() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    queued = [request("a", RequestState.QUEUED_DECODE), request("b", RequestState.QUEUED_PREFILL)]
    live.check(queued, {}, set())
    clock.t += 2 * GRACE
    assert live.check(queued, {}, set()).lost == [], "queued at the scheduler: nothing to lose"


def test_an_attempt_in_delivery_or_on_a_silent_engine_is_not_judged() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    r = request("r", RequestState.PREFILLING)
    live.sending([r.spec.owner])
    live.check([r], {PE: {}, DE: {}}, set())
    clock.t += 2 * GRACE
    assert live.check([r], {PE: {}, DE: {}}, set()).lost == [], "its task push is not answered yet"
    live.sent([r.spec.owner])
    assert live.check([r], {DE: {}}, {PE}).lost == [], "its prefill engine is silent: unknown either way"
    assert live.check([r], {PE: {}, DE: {}}, set()).lost == [], "the clock starts once it can be judged"
    clock.t += GRACE
    assert live.check([r], {PE: {}, DE: {}}, set()).lost == [r.spec], "then the grace applies"


def test_a_retry_under_the_same_request_id_starts_a_clock_of_its_own() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    first = request("r", RequestState.PREFILLING, attempt=0)
    live.check([first], {PE: {}, DE: {}}, set())
    clock.t += GRACE - 1.0  # the first attempt failed for another reason just before its verdict
    retry = request("r", RequestState.PREFILLING, attempt=1)
    assert live.check([retry], {PE: {}, DE: {}}, set()).lost == [], "the retry does not inherit the old clock"
    assert live.tracked()[1] == 1, "the old attempt's clock was dropped once it was no longer in flight"
    clock.t += GRACE
    assert live.check([retry], {PE: {}, DE: {}}, set()).lost == [retry.spec], "the retry's own grace applies"


def test_an_earlier_attempt_held_does_not_keep_the_current_one_alive() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    retry = request("r", RequestState.PREFILLING, attempt=1)
    stale = {PE: {"r": Holding(0, False)}, DE: {}}
    live.check([retry], stale, set())
    clock.t += GRACE
    assert live.check([retry], stale, set()).lost == [retry.spec], "only the attempt in flight counts as held"


def test_a_decode_engine_holding_a_prefilling_attempt_says_it_was_handed_off() -> None:
    live = Liveness(GRACE, FakeClock())
    r = request("r", RequestState.PREFILLING)
    verdicts = live.check([r], {PE: {}, DE: {"r": Holding(0, True)}}, set())
    assert verdicts.handed_off == ["r"] and verdicts.lost == [], "the heartbeat makes up a lost handoff note"


def test_nothing_is_left_tracked_once_requests_leave() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock)
    requests = [request(f"r{i}", RequestState.PREFILLING) for i in range(50)]
    live.sending(r.spec.owner for r in requests[:10])
    live.sent(r.spec.owner for r in requests[:10])
    live.check(requests, {PE: {}, DE: {}}, set())
    assert live.tracked() == (0, 50, 0), "every unheld attempt has a clock while in flight"
    for r in requests[:25]:
        live.forget(r.spec.owner)
    live.check([], {PE: {}, DE: {}}, set())
    assert live.tracked() == (0, 0, 0), "forgotten or no longer in flight: nothing is kept"


def test_a_beat_asks_only_whom_it_has_not_heard_from_and_a_sweep_asks_everyone() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock, sweep_s=3.0)
    watched = {PE, DE, "reader/p0"}
    first = live.plan(watched)
    assert first.sweep and first.ask == watched, "the first beat is a sweep: everyone is asked"
    clock.t += 0.1
    for name in watched:
        live.answered(name)  # their answers to it
    clock.t += 0.9
    assert live.plan(watched).ask == set(), "whoever answered the last beat is not asked again at once"
    clock.t += 0.5
    live.answered(DE)  # its step's report
    clock.t += 0.5
    third = live.plan(watched, always={"decode/d0/g1"})
    assert not third.sweep and third.ask == {PE, "reader/p0", "decode/d0/g1"}, (
        "a busy engine that reported is not asked; the others are, and an engine presumed dead always is"
    )
    clock.t += 1.0
    assert live.plan(watched).sweep, "every sweep_s a sweep asks everyone again (attempts are judged then)"


def test_names_no_longer_watched_are_forgotten_at_a_sweep() -> None:
    clock = FakeClock()
    live = Liveness(GRACE, clock, sweep_s=3.0)
    for i in range(20):
        live.answered(f"prefill/p1/g{i}")
    clock.t += 3.0
    live.plan({PE})
    assert live.heard_of() == 0, "engines that hold nothing any more are not remembered"
