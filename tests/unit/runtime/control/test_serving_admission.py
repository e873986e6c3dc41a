"""Admission at the serving of turns (runtime/control/serving.py) on a real scheduler core: a
burst beyond scheduler.max_queued_turns is answered at once with ErrorKind.QUEUE_FULL, to those
turns only, and never retried by the scheduler; the admitted turns are served as usual."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dualpath_ray.protocol.messages import ErrorKind
from dualpath_ray.runtime.control.serving import Serving
from tests.unit.runtime.control.test_serving import Rounds, final, placed, serving_of, spec_of

LIMIT = 3


def limited_serving(tmp_path: Path) -> tuple[Serving, Rounds]:
    """test_serving's serving, its core built from a config with the limit."""
    return serving_of(tmp_path, scheduler={"max_queued_turns": LIMIT})


def test_a_burst_beyond_the_limit_is_answered_queue_full_and_not_retried(tmp_path: Path) -> None:
    async def scenario() -> None:
        serving, rounds = limited_serving(tmp_path)
        burst = [asyncio.ensure_future(serving.generate(spec_of(f"traj{i}/t0"))) for i in range(LIMIT + 2)]
        await placed(rounds, LIMIT + 2)
        refused = [await turn for turn in burst[LIMIT:]]
        assert all(r.error_kind is ErrorKind.QUEUE_FULL for r in refused), "the turns beyond the limit are refused"
        assert "scheduler.max_queued_turns" in (refused[0].error or ""), "the refusal names the setting"
        assert not any(turn.done() for turn in burst[:LIMIT]), "the admitted turns are still being served"
        assert len(rounds.submitted) == LIMIT + 2 and serving.calls.retries == 0, (
            "a refused turn is tried once: the scheduler never retries a full queue in a loop"
        )
        assert serving.refused == 2 and len(serving.core.requests) == LIMIT, "only the admitted turns are queued"
        for attempt in rounds.submitted[:LIMIT]:
            serving.attempts.complete(final(attempt))
        admitted = [await turn for turn in burst[:LIMIT]]
        assert all(r.error_kind is ErrorKind.INTERNAL for r in admitted), "each admitted turn ends with its result"
        assert not serving.attempts.pending and not serving.aborts.running and not serving.core.requests, "nothing is left"
        again = asyncio.ensure_future(serving.generate(spec_of("traj3/t0")))
        await placed(rounds, LIMIT + 3)
        assert not again.done() and serving.core.dispatcher.queued == 1, "once room is free, a resubmitted turn is admitted"
        serving.attempts.complete(final(rounds.submitted[-1]))
        await again

    asyncio.run(scenario())
