"""Decode steps in closed form against running every step one by one."""

from __future__ import annotations

import pytest

from dualpath_ray.model.latency import LayerModel
from dualpath_ray.model.profile import HardwareProfile, describe_model
from dualpath_ray.protocol.messages import DecodeReservation, PrefillTask, RequestSpec, SamplingParams
from dualpath_ray.protocol.types import ReadPath, Role
from dualpath_ray.sim.decode import SimDecodeEngine, SimDecodeStats
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.nodes import SimNode
from dualpath_ray.sim.prefill import SimPrefillJob
from dualpath_ray.sim.settings import settings_for
from tests.unit.sim.simcases import case_config

PER_TOKEN_MS, PER_CONTEXT_MS, LAYERS = 1.0, 0.001, 2


def step_ms(batch: int, context: int) -> float:
    return LAYERS * ((PER_TOKEN_MS) * batch + PER_CONTEXT_MS * (context + batch))


def stepwise(arrivals: list[tuple[str, float, int, int]]) -> dict[str, float]:
    """Every step one at a time: joiners enter at the first boundary at or after they land."""
    pending = sorted(arrivals, key=lambda a: a[1])
    running: dict[str, list[int]] = {}
    done: dict[str, float] = {}
    now = 0.0
    while pending or running:
        if not running:
            now = max(now, pending[0][1])
        while pending and pending[0][1] <= now + 1e-12:
            rid, _, prompt, steps = pending.pop(0)
            running[rid] = [steps, prompt]
        now += step_ms(len(running), sum(kv for _, kv in running.values())) / 1000
        for rid in list(running):
            running[rid][0] -= 1
            running[rid][1] += 1
            if running[rid][0] == 0:
                done[rid] = now
                del running[rid]
    return done


def oracle_job(rid: str, prompt: int, gen: int, decode_node: SimNode) -> SimPrefillJob:
    spec = RequestSpec(rid, 0, list(range(prompt)), SamplingParams(max_new_tokens=gen), "ns", 0.0)  # type: ignore[arg-type]
    task = PrefillTask(spec, (), 0, ReadPath.PE, True, "prefill/p0/g0", "p0", "decode/d0/g0", "d0")
    return SimPrefillJob(task, prompt, prompt, 0, 0, None, decode_node, None)  # type: ignore[arg-type]


def test_closed_form_decode_matches_step_by_step(tmp_path):
    cfg = case_config(tmp_path)
    profile = HardwareProfile(LayerModel(0.0, PER_TOKEN_MS, PER_CONTEXT_MS), LAYERS, describe_model(cfg.model))
    path = tmp_path / "ctx.json"
    profile.save(path)
    settings = settings_for(cfg.with_overrides(emulation={"profile_path": str(path)}), "oracle")
    loop = EventLoop()
    finished: dict[str, float] = {}
    node = SimNode("d0", Role.DECODE, settings)
    engine = SimDecodeEngine("decode/d0/g0", node, settings, loop, lambda e, job, now: finished.update({job.request_id: now}),
                          SimDecodeStats())
    arrivals = [("r1", 0.0, 100, 5), ("r2", 0.0031, 300, 3), ("r3", 0.02, 50, 4), ("r4", 0.5, 10, 2)]
    for rid, at, prompt, steps in arrivals:
        engine.accept(DecodeReservation(rid, 0, 64 * 8, engine.engine_id))
        job = oracle_job(rid, prompt, steps + 1, node)
        loop.at(at, lambda j: engine.hand_off(j, loop.now), job)
    loop.run()
    expected = stepwise(arrivals)
    assert finished.keys() == expected.keys()
    for rid, when in expected.items():
        assert finished[rid] == pytest.approx(when, rel=1e-9), f"{rid} ends at the same step boundary"
    assert engine.free_pages == settings.hbm_pages and not engine.jobs, "every reservation is released"
