"""A turn the scheduler refused because its queue was full (ErrorKind.QUEUE_FULL) is submitted
again by `SchedulerClient.generate_admitted` (what the rollout API uses) after growing pauses,
within its bound; any other answer is returned as it came. Against the in-process fake scheduler
of tests/unit/test_scheduler_client.py."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

from dualpath_ray.api.client import Backoff, SchedulerClient
from dualpath_ray.protocol.messages import (
    ErrorKind, Refusal, RequestSpec, TurnResult, aborted_result, failed_result,
)
from tests.unit.test_scheduler_client import FakeScheduler, spec

QUICK = Backoff(first_s=0.001, factor=2.0, max_s=0.004, seed=1)


class FullScheduler(FakeScheduler):
    """Answers each request id's first `refusals` submits at once with QUEUE_FULL, then serves it."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals
        self.seen: Counter[str] = Counter()

    async def _submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        answer = await super()._submit(client, specs)
        for s in specs:
            self.seen[s.request_id] += 1
            accepted = self.accepted.pop(s.request_id)
            full = self.seen[s.request_id] <= self.refusals
            self.ready.append(failed_result(accepted, "scheduler", "full", ErrorKind.QUEUE_FULL) if full
                              else aborted_result(accepted))
        self.event.set()
        return answer


def test_a_refused_turn_is_submitted_again_until_it_is_admitted() -> None:
    async def scenario() -> TurnResult:
        scheduler = FullScheduler(refusals=3)
        client = SchedulerClient(scheduler)
        result = await client.generate_admitted(spec("traj0/t0"), within_s=10.0, pauses=QUICK)
        assert scheduler.seen["traj0/t0"] == 4 and client.resubmits == 3, "three refusals, three resubmits"
        return result

    result = asyncio.run(scenario())
    assert result.error_kind is None, "the turn the queue finally admitted is answered"


def test_resubmitting_stops_at_its_bound_with_the_last_refusal() -> None:
    readings = itertools.count()

    def clock() -> float:
        """Moves 0.01 s per reading, whatever the machine's speed: one reading at the first
        submit, one after each refusal."""
        return next(readings) * 0.01

    async def scenario() -> tuple[TurnResult, FullScheduler, SchedulerClient]:
        scheduler = FullScheduler(refusals=10**6)
        client = SchedulerClient(scheduler)
        result = await client.generate_admitted(spec("traj0/t0"), within_s=0.05, pauses=QUICK, clock=clock)
        return result, scheduler, client

    result, scheduler, client = asyncio.run(scenario())
    assert result.error_kind is ErrorKind.QUEUE_FULL, "past the bound the caller gets the refusal, not a hang"
    # Refusals read the clock at 0.01 .. 0.05; a resubmit goes out while reading + pause (QUICK:
    # at most 0.006 s) ends within 0.05, so after the refusals read at 0.01 .. 0.04 only.
    assert client.resubmits == 4 and scheduler.seen["traj0/t0"] == 5, (
        f"resubmitting stopped at its bound of 0.05 s: {client.resubmits} resubmits, "
        f"{scheduler.seen['traj0/t0']} submits"
    )


def test_other_failures_are_not_resubmitted() -> None:
    async def scenario() -> None:
        scheduler = FakeScheduler()
        client = SchedulerClient(scheduler)
        turn = asyncio.ensure_future(client.generate_admitted(spec("traj0/t0"), within_s=10.0, pauses=QUICK))
        while "traj0/t0" not in scheduler.accepted:
            await asyncio.sleep(0)
        scheduler.ready.append(failed_result(scheduler.accepted.pop("traj0/t0"), "decode/d0/g0", "bug"))
        scheduler.event.set()
        assert (await turn).error_kind is ErrorKind.INTERNAL and client.resubmits == 0, "only queue_full is resubmitted"
        assert scheduler.submits == [["traj0/t0"]], "submitted once"

    asyncio.run(scenario())


def test_backoff_pauses_grow_to_their_cap_with_jitter() -> None:
    pauses = iter(Backoff(first_s=0.1, factor=2.0, max_s=0.4, jitter=0.5, seed=3))
    drawn = [next(pauses) for _ in range(6)]
    bases = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    assert all(0.5 * b <= d <= 1.5 * b for d, b in zip(drawn, bases)), f"each pause within +-50% of its base: {drawn}"
    assert len(set(drawn)) == len(drawn), "jittered, so refused turns do not all come back at once"
