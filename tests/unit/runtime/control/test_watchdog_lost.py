"""The watchdog's verdict on a lost attempt (no live engine names it for the grace): the attempt
is failed and retried, and what it leased on every reader is reclaimed, since no live engine will
move KV into those extents or free them (a killed engine's staged attempts leaked 3 blocks each
on the decode node's buffer before). Real Watchdog and Liveness on a fake clock; fakes for the
scheduler core, the cluster control and the adoptions; no Ray cluster."""

from __future__ import annotations

from typing import Any

import numpy as np

from dualpath_ray.config import parse_config
from dualpath_ray.protocol.messages import Holding, RequestSpec, SamplingParams
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.requests import Request, RequestState

GRACE = 2.0
PE, DE = "prefill/p0/g0", "decode/d0/g0"


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


class Core:
    """The SchedulerCore surface `_judge` reads: the requests in flight."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = {r.request_id: r for r in requests}

    def handed_off(self, request_id: str) -> bool:
        return False

    def stale_holdings(self, held: dict[str, Any]) -> list[tuple[str, str]]:
        return []


class Control:
    def __init__(self) -> None:
        self.reclaimed: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []

    def reclaim(self, reader: str, owner: str) -> None:
        self.reclaimed.append((reader, owner))

    def cancel(self, engine: str, owner: str) -> None:
        self.cancelled.append((engine, owner))


class Adoptions:
    holders: dict[str, Any] = {}

    def check(self, *args: object) -> None:
        return None


def prefilling(request_id: str) -> Request:
    spec = RequestSpec(request_id, 0, np.arange(8), SamplingParams(), "ns", 0.0)
    request = Request(request_id, 8, 0, 16, (), spec, RequestState.PREFILLING)
    request.prefill_engine, request.decode_engine = PE, DE
    return request


def test_a_lost_attempt_is_failed_and_its_extents_reclaimed_on_every_reader() -> None:
    cfg = parse_config({"cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1}})
    clock = Clock()
    lost, held = prefilling("lost"), prefilling("held")
    control, failed = Control(), []
    watchdog = Watchdog(
        cfg, Core([lost, held]), control, Liveness(GRACE, clock), Adoptions(), None,  # type: ignore[arg-type]
        SchedulerCounts(), lambda spec, by, why: failed.append(spec.owner), lambda: None,
    )
    holdings = {PE: {"held": Holding.of(held.spec, False)}, DE: {}}  # `held` is named by its prefill engine
    watchdog._judge(holdings, set(), 5.0)
    assert not failed and not control.reclaimed, "within the grace nothing is judged"
    clock.t += GRACE
    watchdog._judge(holdings, set(), 5.0)
    assert failed == [lost.spec.owner], "only the attempt no live engine names is failed (and so retried)"
    assert sorted(control.reclaimed) == [("reader/d0", lost.spec.owner), ("reader/p0", lost.spec.owner)], (
        "what the lost attempt leased is reclaimed on every reader, and nothing of the held one"
    )
    assert watchdog.calls.lost_assignments == 1, "the verdict is counted"


class SilentCore(Core):
    """Fails the given attempts when their engine goes silent, and takes the engine back."""

    def __init__(self, requests: list[Request]) -> None:
        super().__init__(requests)

    def engine_died(self, engine: str, confirmed: bool) -> list[RequestSpec]:
        return [r.spec for r in self.requests.values()]

    def readmit(self, engine: str) -> bool:
        return True

    def engine_restarted(self, engine: str) -> list[RequestSpec]:
        return []


def test_the_attempts_of_a_silent_engine_are_bounded_and_forgotten_when_it_answers_again(monkeypatch) -> None:
    import dualpath_ray.runtime.control.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "MAX_UNRECLAIMED", 2)
    cfg = parse_config({"cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1}})
    control = Control()
    watchdog = Watchdog(
        cfg, SilentCore([prefilling(f"r{i}") for i in range(3)]), control, Liveness(GRACE, Clock()), Adoptions(),
        None, SchedulerCounts(), lambda spec, by, why: None, lambda: None,  # type: ignore[arg-type]
    )
    watchdog.engine_died(PE, confirmed=False)
    # Invariant: a silent engine's attempts wait for its certain death, at most MAX_UNRECLAIMED of them.
    assert list(watchdog.unreclaimed[PE]) == ["r1#0", "r2#0"] and not control.reclaimed
    watchdog.observe(PE, "incarnation-1")  # the same process answers again
    # Invariant: the same process answering again frees its own (its cancels), so nothing is kept.
    assert PE not in watchdog.unreclaimed and not control.reclaimed
    watchdog.engine_died(PE, confirmed=False)
    watchdog.observe(PE, "incarnation-2")  # a new process answers: the old one is certainly gone
    # Invariant: a new process's answer reclaims what the dead one's attempts leased, on every reader.
    assert sorted(control.reclaimed) == sorted((reader, owner) for owner in ("r1#0", "r2#0")
                                               for reader in ("reader/d0", "reader/p0"))
    assert PE not in watchdog.unreclaimed
