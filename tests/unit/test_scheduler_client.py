"""The caller's side of the scheduler (api/client.py) against an in-process fake of the actor:
a moment's turns go in one submit, results come back by long-poll, refusals raise, and a
restarted scheduler (a new epoch) gets the turns it forgot submitted again."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from dualpath_ray.api.client import SchedulerClient
from dualpath_ray.protocol.messages import (
    Collected, Refusal, RequestSpec, SamplingParams, TurnResult, aborted_result,
)


class Method:
    """`handle.method.remote(...)` returning an awaitable, as a Ray actor handle does."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


class FakeScheduler:
    """Accepts turns and answers them when the test says; `epoch` changes on a 'restart'."""

    def __init__(self) -> None:
        self.epoch = 100
        self.accepted: dict[str, RequestSpec] = {}
        self.submits: list[list[str]] = []
        self.ready: list[TurnResult] = []
        self.event = asyncio.Event()
        self.refuse: dict[str, Refusal] = {}
        self.submit = Method(self._submit)
        self.collect = Method(self._collect)

    async def _submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        self.submits.append([s.request_id for s in specs])
        refusals = []
        for s in specs:
            refusals.append(self.refuse.get(s.request_id))
            if s.request_id not in self.refuse:
                self.accepted[s.request_id] = s
        return self.epoch, refusals

    async def _collect(self, client: str, epoch: int | None) -> Collected:
        if epoch is not None and epoch != self.epoch:
            return Collected(self.epoch)
        await self.event.wait()
        self.event.clear()
        ready, self.ready = self.ready, []
        return Collected(self.epoch, tuple(ready))

    def finish(self, *request_ids: str) -> None:
        for rid in request_ids:
            self.ready.append(aborted_result(self.accepted.pop(rid)))  # any result will do
        self.event.set()

    def restart(self) -> None:
        self.epoch += 1
        self.accepted.clear()
        self.event.set()  # the resent long-poll meets the new incarnation


def spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, 0, np.arange(8), SamplingParams(), "ns", 0.0)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_moments_turns_leave_in_one_submit_and_come_back_by_long_poll() -> None:
    async def scenario() -> None:
        scheduler = FakeScheduler()
        client = SchedulerClient(scheduler, name="c")
        calls = [asyncio.ensure_future(client.generate(spec(f"r{i}"))) for i in range(10)]
        await settle()
        assert scheduler.submits == [[f"r{i}" for i in range(10)]], "ten turns of one moment leave in one submit"
        scheduler.finish(*(f"r{i}" for i in range(10)))
        results = await asyncio.gather(*calls)
        assert [r.request_id for r in results] == [f"r{i}" for i in range(10)], "each caller gets its own result"
        assert client.collects <= 2, f"one long-poll brought them all back ({client.collects} collects)"
        assert client.in_flight() == 0, "nothing is left waiting"

    asyncio.run(scenario())


def test_a_refusal_is_raised_to_its_caller_only() -> None:
    async def scenario() -> None:
        scheduler = FakeScheduler()
        scheduler.refuse["dup"] = Refusal.DUPLICATE
        client = SchedulerClient(scheduler, name="c")
        ok = asyncio.ensure_future(client.generate(spec("ok")))
        dup = asyncio.ensure_future(client.generate(spec("dup")))
        await settle()
        with pytest.raises(ValueError, match="already in flight"):
            await dup
        scheduler.finish("ok")
        assert (await ok).request_id == "ok", "the other turn of the same submit is served"

    asyncio.run(scenario())


def test_a_restarted_scheduler_gets_the_turns_it_forgot_again() -> None:
    async def scenario() -> None:
        scheduler = FakeScheduler()
        client = SchedulerClient(scheduler, name="c")
        calls = [asyncio.ensure_future(client.generate(spec(f"r{i}"))) for i in range(3)]
        await settle()
        scheduler.restart()
        await settle()
        assert sorted(scheduler.accepted) == ["r0", "r1", "r2"], "every turn in flight was submitted to the new epoch"
        assert len(scheduler.submits) == 2, "in one more submit"
        scheduler.finish("r0", "r1", "r2")
        assert len(await asyncio.gather(*calls)) == 3, "and answered"

    asyncio.run(scenario())


def test_the_same_id_twice_from_one_caller_is_an_error() -> None:
    async def scenario() -> None:
        scheduler = FakeScheduler()
        client = SchedulerClient(scheduler, name="c")
        first = asyncio.ensure_future(client.generate(spec("x")))
        await settle()
        with pytest.raises(ValueError, match="already in flight"):
            await client.generate(spec("x"))
        scheduler.finish("x")
        await first

    asyncio.run(scenario())
