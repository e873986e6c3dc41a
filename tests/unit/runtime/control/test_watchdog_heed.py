"""The watchdog hears which incarnation took each task push through the decisions' `accepted`
queue (runtime/control/plane.py builds the rounds before the watchdog, so neither calls the
other back): a known incarnation is an answer, a new one a restart. Real Watchdog and Liveness,
the fakes of test_watchdog_lost; no Ray cluster."""

from __future__ import annotations

import asyncio

from dualpath_ray.config import parse_config
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.scheduling.liveness import Liveness
from tests.unit.runtime.control.test_watchdog_lost import GRACE, PE, Adoptions, Clock, Control, SilentCore


def test_push_answers_reach_the_watchdog_in_order_and_a_new_incarnation_is_a_restart() -> None:
    cfg = parse_config({"cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1}})
    changes: list[None] = []
    watchdog = Watchdog(
        cfg, SilentCore([]), Control(), Liveness(GRACE, Clock()), Adoptions(), None,  # type: ignore[arg-type]
        SchedulerCounts(), lambda spec, by, why: None, lambda: changes.append(None),
    )

    async def run() -> None:
        accepted: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        heeding = asyncio.get_running_loop().create_task(watchdog.heed(accepted))
        accepted.put_nowait((PE, "incarnation-1"))
        accepted.put_nowait((PE, "incarnation-1"))
        await asyncio.sleep(0)
        assert watchdog.incarnations.known[PE] == "incarnation-1", "the first push answer is a first sighting"
        assert watchdog.calls.restarted_engines == 0, "the same incarnation again is no restart"
        accepted.put_nowait((PE, "incarnation-2"))
        await asyncio.sleep(0)
        assert watchdog.calls.restarted_engines == 1 and changes, "a new incarnation is a restart: the rounds rerun"
        heeding.cancel()

    asyncio.run(run())


class BrokenCore(SilentCore):
    """Raises on taking back one engine (a bug in handling its answer)."""

    def readmit(self, engine: str) -> bool:
        if engine == BROKEN:
            raise RuntimeError(f"a bug handling {engine}")
        return True


BROKEN = "prefill/p0/g1"


def test_an_answer_that_raises_is_logged_and_the_next_ones_are_still_heard() -> None:
    cfg = parse_config({"cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1}})
    watchdog = Watchdog(
        cfg, BrokenCore([]), Control(), Liveness(GRACE, Clock()), Adoptions(), None,  # type: ignore[arg-type]
        SchedulerCounts(), lambda spec, by, why: None, lambda: None,
    )

    async def run() -> None:
        accepted: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        heeding = asyncio.get_running_loop().create_task(watchdog.heed(accepted))
        accepted.put_nowait((BROKEN, "incarnation-1"))  # its handling raises
        accepted.put_nowait((PE, "incarnation-1"))
        await asyncio.sleep(0)
        assert not heeding.done(), "a bug in one answer does not end the watch over push answers"
        assert watchdog.incarnations.known.get(PE) == "incarnation-1", "the answer after it is heard"
        heeding.cancel()

    asyncio.run(run())
