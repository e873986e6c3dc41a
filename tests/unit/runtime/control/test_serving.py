"""The serving of turns (runtime/control/serving.py, its attempts' ends at
runtime/control/attempts.py) on a real scheduler core, without Ray: the decision rounds only
queue and finish (nothing is placed), the engines are a recorder."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import (
    ErrorKind,
    RequestSpec,
    SamplingParams,
    StopReason,
    TurnResult,
    failed_result,
)
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.attempts import Attempts
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.runtime.control.serving import Serving
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.scheduler import SchedulerCore


class Rounds:
    """Queues a submitted attempt in the core and finishes it there; places nothing."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.submitted: list[RequestSpec] = []
        self.changes = 0

    def submit(self, spec: RequestSpec) -> None:
        self.submitted.append(spec)
        self.core.submit(spec)

    def finish(self, result: TurnResult, group_id: str | None) -> tuple[str, ...]:
        return self.core.finish(result)

    def everything_changed(self) -> None:
        self.changes += 1


class Decisions:
    def __init__(self, core: SchedulerCore) -> None:
        self.rounds = Rounds(core)
        self.decode_group_of: dict[str, str] = {}


class Watchdog:
    def __init__(self) -> None:
        self.work = asyncio.Event()
        self.probed: list[set[str]] = []

    async def probe(self, peers: set[str]) -> None:
        self.probed.append(peers)


class Control:
    """What the engines were told: (verb, engine, attempt owner)."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, str]] = []

    def cancel(self, engine: str, owner: str) -> None:
        self.told.append(("cancel", engine, owner))

    def abort(self, engine: str, owner: str) -> None:
        self.told.append(("abort", engine, owner))


class Metrics:
    def __init__(self) -> None:
        self.finished_turns: list[TurnResult] = []

    def finished(self, result: TurnResult) -> None:
        self.finished_turns.append(result)


def serving_of(tmp_path: Path, scheduler: dict[str, object] | None = None, **runtime: object) -> tuple[Serving, Rounds]:
    cfg = DualPathConfig().with_overrides(store={"root": str(tmp_path)}, runtime=dict(runtime), scheduler=scheduler or {})
    core = build_core(cfg, str(tmp_path), "dualpath", epoch=1_000)
    liveness = Liveness(cfg.runtime.heartbeat_timeout_s, time.monotonic, cfg.runtime.heartbeat_s)
    decisions, aborts, adoptions, calls = Decisions(core), Aborts(), Adoptions(), SchedulerCounts()
    attempts = Attempts(core, decisions, Control(), liveness, aborts, adoptions, calls, Metrics())  # type: ignore[arg-type]
    serving = Serving(cfg, core, attempts, decisions, Watchdog(), liveness, aborts, adoptions, calls)  # type: ignore[arg-type]
    return serving, decisions.rounds


def spec_of(request_id: str = "traj0/0") -> RequestSpec:
    return RequestSpec(request_id, 0, np.arange(8), SamplingParams(max_new_tokens=2), "ns", 0.0)


def final(spec: RequestSpec) -> TurnResult:
    """An attempt's last word: a failure never retried (the fake rounds place nothing, and only
    a placed attempt may end well)."""
    return failed_result(spec, "decode/d0/g0", "a bug", ErrorKind.INTERNAL)


async def placed(rounds: Rounds, count: int, served: asyncio.Future[TurnResult] | None = None) -> RequestSpec:
    """The `count`th attempt handed to the rounds, once it is (a serving that ended or raised
    first fails the test at once instead of hanging it; the test's timeout ends any other wait)."""
    while len(rounds.submitted) < count:
        if served is not None and served.done():
            served.result()  # raises what the serving raised
            raise AssertionError(f"the serving ended before attempt {count} was placed")
        await asyncio.sleep(0)
    return rounds.submitted[count - 1]


def test_a_turn_is_answered_by_its_current_attempt_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        serving, rounds = serving_of(tmp_path)
        served = asyncio.ensure_future(serving.generate(spec_of()))
        attempt = await placed(rounds, 1, served)
        assert attempt.epoch == serving.core.epoch + 1, "each serving gets its own epoch (RequestSpec.epoch)"
        serving.attempts.complete(final(dataclasses.replace(attempt, epoch=attempt.epoch - 1)))
        assert serving.calls.stale_results == 1 and not served.done(), "another serving's result is dropped"
        serving.attempts.complete(final(attempt))
        result = await served
        assert result.error_kind is ErrorKind.INTERNAL and result.epoch == attempt.epoch
        assert serving.calls.retries == 0, "a bug is answered, not retried"
        assert not serving.attempts.pending and not serving.aborts.running, "nothing of the turn is left behind"

    asyncio.run(scenario())


def test_a_peer_death_is_retried_as_the_next_attempt(tmp_path: Path) -> None:
    async def scenario() -> None:
        serving, rounds = serving_of(tmp_path)
        served = asyncio.ensure_future(serving.generate(spec_of()))
        first = await placed(rounds, 1, served)
        serving.attempts.fail(first, "reader/d0", "died")
        second = await placed(rounds, 2, served)
        assert (second.attempt, second.epoch) == (1, first.epoch), "the retry is the same serving's next attempt"
        serving.attempts.complete(final(second))
        assert (await served).attempt == 1
        assert serving.calls.retries == 1 and not serving.attempts.suspects

    asyncio.run(scenario())


def test_an_abort_answers_at_once_and_is_not_retried(tmp_path: Path) -> None:
    async def scenario() -> None:
        serving, rounds = serving_of(tmp_path)
        served = asyncio.ensure_future(serving.generate(spec_of()))
        await placed(rounds, 1, served)
        assert serving.attempts.abort("traj0/0") and not serving.attempts.abort("traj0/1"), "only a request in flight is aborted"
        result = await served
        assert result.stop_reason is StopReason.ABORTED and result.error_kind is None
        assert len(rounds.submitted) == 1 and rounds.changes == 1, "not retried; what it held is offered again"
        assert not serving.core.requests

    asyncio.run(scenario())


def test_a_turn_without_a_result_times_out_and_is_abandoned(tmp_path: Path) -> None:
    async def scenario() -> None:
        serving, rounds = serving_of(tmp_path, request_timeout_s=0.05)
        result = await serving.generate(spec_of())
        assert result.error_kind is ErrorKind.TIMEOUT and serving.calls.timeouts == 1
        assert not serving.core.requests and not serving.attempts.pending, "the core forgot the abandoned attempt"

    asyncio.run(scenario())
