"""Admission on the pure scheduler core (scheduling/admission.py): a burst beyond
scheduler.max_queued_turns is refused with QueueFull, the count is exactly what waits for an
engine (not what engines hold), a retry of an admitted turn is never refused, the scheduler
does not retry a refusal, and no limit (the simulator's default) admits everything."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.protocol.messages import ErrorKind, GroupReport, RequestSpec, SamplingParams, failed_result
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.admission import Admission, QueueFull
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Mode

BLOCK = 16
LIMIT = 4


def core(limit: int = LIMIT) -> SchedulerCore:
    return SchedulerCore(CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, 100_000), admission=Admission(limit)),
                         PrefixIndex(BLOCK))


def spec(rid: str, attempt: int = 0) -> RequestSpec:
    prompt = np.random.default_rng(len(rid)).integers(0, 512, 40)
    return RequestSpec(rid, attempt, prompt, SamplingParams(max_new_tokens=8), "model@0", 0.0)


def decode_report(free_tokens: int) -> GroupReport:
    return GroupReport("decode/d0", "d0", (EngineLoad("decode/d0/g0", "d0", 0, 0, free_tokens),), 0)


def prefill_report() -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), 0)


def test_a_burst_beyond_the_limit_is_refused_and_nothing_of_it_is_kept() -> None:
    c = core()
    for i in range(LIMIT):
        c.submit(spec(f"burst{i}"))
    with pytest.raises(QueueFull) as refused:
        c.submit(spec("burst-extra"))
    assert (refused.value.queued, refused.value.limit) == (LIMIT, LIMIT), "the refusal says how many wait and the limit"
    assert "scheduler.max_queued_turns" in str(refused.value), "the refusal names the setting that bounds the queue"
    assert "burst-extra" not in c.requests and c.dispatcher.queued == LIMIT, "a refused turn leaves nothing behind"
    c.dispatcher.check_integrity()


def test_the_count_is_what_waits_for_an_engine_not_what_engines_hold() -> None:
    c = core()
    for i in range(LIMIT):
        c.submit(spec(f"r{i}"))
    c.fetch_decode(decode_report(10_000))
    assert c.dispatcher.queued == LIMIT, "a turn placed on a decode engine's books still waits for a prefill engine"
    with pytest.raises(QueueFull):
        c.submit(spec("while-queued-for-prefill"))
    assert len(c.fetch_prefill(prefill_report())) == LIMIT, "every queued turn goes to the prefill engine"
    assert c.dispatcher.queued == 0, "a turn an engine was handed no longer counts as queued"
    for i in range(LIMIT):
        c.submit(spec(f"next{i}"))
    assert c.dispatcher.queued == LIMIT and len(c.requests) == 2 * LIMIT, "the limit bounds the queue, not the engines"
    c.dispatcher.check_integrity()


def test_a_turn_that_leaves_the_queue_unplaced_frees_its_place_at_once() -> None:
    c = core()
    specs = [spec(f"q{i}") for i in range(LIMIT)]
    for s in specs:
        c.submit(s)
    c.abandon("q0")  # its deadline passed while it waited
    c.finish(failed_result(specs[1], "decode/d0/g0", "its engine died", ErrorKind.PEER_DIED))
    assert c.dispatcher.queued == LIMIT - 2, "an abandoned and a failed queued turn no longer count"
    c.submit(spec("x1"))
    c.submit(spec("x2"))
    with pytest.raises(QueueFull):
        c.submit(spec("x3"))
    c.dispatcher.check_integrity()


def test_a_retry_of_an_admitted_turn_is_never_refused() -> None:
    c = core()
    for i in range(LIMIT):
        c.submit(spec(f"r{i}"))
    retried = c.submit(spec("admitted-before", attempt=1))
    assert retried.spec.attempt == 1 and c.dispatcher.queued == LIMIT + 1, (
        "attempt 1 belongs to a turn admitted once: refusing it would fail a turn already being served"
    )
    c.dispatcher.check_integrity()


def test_the_scheduler_does_not_retry_a_refusal_but_its_caller_may() -> None:
    c = core()
    refused = failed_result(spec("r"), "scheduler", "full", ErrorKind.QUEUE_FULL)
    assert not ErrorKind.QUEUE_FULL.retryable and not c.should_retry(refused), (
        "a retry at the scheduler would only spin against the same full queue"
    )
    assert ErrorKind.QUEUE_FULL.resubmittable, "nothing of the turn ran: its caller may submit it again"
    assert not any(kind.resubmittable for kind in ErrorKind if kind is not ErrorKind.QUEUE_FULL), (
        "only a refused admission is the caller's to resubmit"
    )


def test_no_limit_admits_every_turn_as_before() -> None:
    c = core(limit=0)
    for i in range(1000):
        c.submit(spec(f"r{i}"))
    assert c.dispatcher.queued == 1000, "0 means no limit (the simulator's default)"
    assert CoreSettings(Mode.DUALPATH, BLOCK, Constants(1, 1)).admission.max_queued_turns == 0, (
        "a core built without a limit (the simulator) admits everything"
    )


def test_a_negative_limit_is_an_error_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="scheduler.max_queued_turns"):
        Admission(-1)
