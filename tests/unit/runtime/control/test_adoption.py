"""What a restarted scheduler takes over (runtime/control/adoption.py), without Ray."""

from __future__ import annotations

import asyncio

import numpy as np

from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.protocol.messages import Holding, RequestSpec, SamplingParams, failed_result


def result_of(request_id: str, epoch: int = 5):
    spec = RequestSpec(request_id, 2, np.arange(4), SamplingParams(), "ns", 0.0, epoch)
    return failed_result(spec, "decode/d0/g0", "done")


def test_held_requests_become_adoptable_and_the_unstarted_ones_are_cancelled() -> None:
    adoptions = Adoptions()
    cancel = adoptions.learn("decode/d0/g0", {"running": Holding(2, True, 5), "reserved": Holding(0, False, 5)})
    cancel += adoptions.learn("prefill/p0/g0", {"reserved": Holding(0, False, 5)})
    assert cancel == ["reserved#0@5", "reserved#0@5"], "what was not handed off is cancelled at every engine holding it"
    assert adoptions.adoptable("running") and adoptions.adoptable("reserved"), (
        "every held request waits for its engines before it is dispatched again"
    )
    assert adoptions.engines() == {"decode/d0/g0", "prefill/p0/g0"}, "the heartbeat must ask both engines"


def test_a_result_reaches_its_waiting_caller_or_waits_for_it() -> None:
    async def scenario() -> None:
        adoptions = Adoptions()
        adoptions.learn("decode/d0/g0", {"a": Holding(2, True, 5), "b": Holding(2, True, 5)})
        waiting = adoptions.wait_for("a")
        assert adoptions.deliver(result_of("a"), 0.0), "a held request's result is adopted"
        assert (await waiting).request_id == "a", "the waiting caller gets the old attempt's result"
        assert adoptions.deliver(result_of("b"), 0.0) and adoptions.claim("b").request_id == "b", (
            "a result that came before its caller's resent generate is kept for it"
        )
        assert not adoptions.deliver(result_of("c"), 0.0), "a request nobody held is not adopted"
        assert adoptions.adopted == 2

    asyncio.run(scenario())


def test_a_request_no_engine_names_for_the_grace_is_dropped_to_be_dispatched_afresh() -> None:
    async def scenario() -> None:
        adoptions = Adoptions()
        adoptions.learn("decode/d0/g0", {"gone": Holding(0, False, 5), "kept": Holding(1, True, 5)})
        waiting = adoptions.wait_for("gone")
        held = {"decode/d0/g0": {"kept": Holding(1, True, 5)}}
        assert adoptions.check(held, set(), now=10.0, grace_s=1.5) == [], "the grace starts when it is first unheld"
        assert adoptions.check({}, {"decode/d0/g0"}, now=20.0, grace_s=1.5) == [], "a silent engine proves nothing"
        assert adoptions.check(held, set(), now=11.6, grace_s=1.5) == ["gone"], "unheld past the grace: dropped"
        assert await waiting is None, "its caller is told to dispatch it afresh"
        assert adoptions.adoptable("kept") and not adoptions.adoptable("gone")

    asyncio.run(scenario())


def test_an_adopted_result_no_caller_asks_for_expires_after_its_ttl() -> None:
    adoptions = Adoptions(unclaimed_ttl_s=30.0)
    adoptions.learn("decode/d0/g0", {"orphan": Holding(2, True, 5), "late": Holding(2, True, 5)})
    assert adoptions.deliver(result_of("orphan"), now=100.0), "kept for its caller's resent generate"
    assert adoptions.deliver(result_of("late"), now=125.0)
    adoptions.check({}, set(), now=131.0, grace_s=1.5)
    # Invariant: an unclaimed result lives unclaimed_ttl_s at most (its caller died: nobody ever asks).
    assert "orphan" not in adoptions.unclaimed and adoptions.expired == 1
    assert adoptions.claim("late").request_id == "late", "a younger one still waits for its caller"
    assert not adoptions.unclaimed and not adoptions.unclaimed_at, "claimed: forgotten"
