"""The fault plan's config section and one process's injector: validation, triggers, counters."""

from __future__ import annotations

import pytest

from dualpath_ray.config import ConfigError, parse_config
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import CallPhase, FaultPlan, FaultSite, FaultSpec


def plan(*faults: dict, seed: int = 0) -> FaultPlan:
    return parse_config({"faults": {"seed": seed, "faults": list(faults)}}).faults


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ({"site": "heartbeat", "mode": "corrupt", "nth": 1}, "not possible at site 'heartbeat'"),
        ({"site": "store_read", "mode": "fail"}, "needs a trigger"),
        ({"site": "store_read", "mode": "fail", "nth": 2, "probability": 0.5}, "exclude each other"),
        ({"site": "actor_call", "mode": "fail", "nth": 1, "methods": ["free"]}, "not fault sites"),
        ({"site": "layer_transfer", "mode": "fail", "nth": 1, "phase": "response"}, "only for site actor_call"),
        ({"site": "layer_transfer", "mode": "delay", "nth": 1}, "delay_s > 0"),
        ({"site": "layer_transfer", "mode": "explode", "nth": 1}, "faults.faults.0.mode"),
    ],
)
def test_a_bad_fault_names_its_field_and_the_fix(fault: dict, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        plan(fault)
    assert named in str(err.value), f"the error says what is wrong: {err.value}"


def test_store_damage_needs_a_directory_store() -> None:
    with pytest.raises(ConfigError, match="store.backend: local_dir"):
        parse_config({"store": {"backend": "memory"}, "faults": {"faults": [{"site": "store_read", "mode": "corrupt", "nth": 1}]}})


def test_nth_fires_exactly_once_at_that_event_of_each_process() -> None:
    p = plan({"site": "layer_transfer", "mode": "fail", "nth": 3})
    injector = FaultInjector(p, "prefill/p0/g0")
    fired = [injector.decide(FaultSite.LAYER_TRANSFER) is not None for _ in range(6)]
    assert fired == [False, False, True, False, False, False], "only the 3rd event is injected"
    counts = injector.counts()["layer_transfer:fail"]
    assert (counts.events, counts.injected) == (6, 1), "the counter saw every event and one injection"


def test_probability_is_seeded_bounded_and_forces_its_minimum() -> None:
    fault = {"site": "store_read", "mode": "fail", "probability": 0.25, "min_count": 2, "max_count": 30, "after": 1}
    first = FaultInjector(plan(fault), "reader/p0")
    again = FaultInjector(plan(fault), "reader/p0")
    other = FaultInjector(plan(fault), "reader/d0")
    runs = [[i.decide(FaultSite.STORE_READ) is not None for _ in range(400)] for i in (first, again, other)]
    assert runs[0] == runs[1], "the same seed and actor inject at the same events"
    assert runs[0] != runs[2], "each actor has its own stream"
    assert runs[0][:3] == [False, True, True], "after 1 free event, min_count injections are forced"
    assert sum(runs[0]) == 30, "max_count caps the injections (400 x 0.25 would be ~100)"


def test_actors_glob_and_methods_select_where_a_fault_applies() -> None:
    p = plan({"site": "actor_call", "mode": "fail", "nth": 1, "actors": "prefill/*", "methods": ["read_hits"]},
             {"site": "actor_call", "mode": "fail", "nth": 1, "phase": "response", "actors": "prefill/*"})
    decode = FaultInjector(p, "decode/d0/g0")
    assert not decode.active, "a decode engine has no prefill faults"
    prefill = FaultInjector(p, "prefill/p0/g1")
    assert not prefill.fail_call("lease", CallPhase.REQUEST), "lease is not among the request fault's methods"
    assert prefill.fail_call("read_hits", CallPhase.REQUEST), "the first read_hits request is lost"
    assert prefill.fail_call("lease", CallPhase.RESPONSE), "the first reply of any call is lost"
    assert set(prefill.counts()) == {"actor_call:fail:request", "actor_call:fail:response"}, "labels name the phase"


def test_an_empty_plan_is_inactive_everywhere() -> None:
    injector = FaultInjector(FaultPlan(), "reader/p0")
    assert not injector.active and injector.decide(FaultSite.STORE_READ) is None, "no plan, no faults"
    assert FaultSpec(site="heartbeat", mode="drop", nth=1).applies_to("decode/d0/g0"), "the default glob matches all"
