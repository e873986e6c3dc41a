"""What `dualpath bench` samples during its timed phase (dualpath_ray/bench/sampler.py): the
sampler's series from a plain reading function, and which compute seconds a prefill engine's
`engine_stats` stands for (no Ray: the records are built by hand)."""

from __future__ import annotations

import time

from dualpath_ray.bench.sampler import CounterSampler, prefill_compute_s
from dualpath_ray.runtime.prefill.core import PrefillStats
from dualpath_ray.runtime.telemetry.engine_stats import EngineStats, HbmMoveCounts
from dualpath_ray.runtime.transport.moves import TransportStats


def engine_stats(compute_s: float, compute: dict[str, object]) -> EngineStats[PrefillStats]:
    core = PrefillStats()
    core.pipeline.compute_s = compute_s
    return EngineStats(core, TransportStats(), "cpu", HbmMoveCounts("staged", 0, 0, 0, {}), "inc", {}, 0, compute)


def test_prefill_compute_s_is_vllms_step_time_or_the_layers_compute() -> None:
    assert prefill_compute_s(engine_stats(1.25, {})) == 1.25, "the native engine: its layers' compute seconds"
    vllm = engine_stats(0.0, {"backend": "vllm", "steps": 40, "step_s": 3.5})
    assert prefill_compute_s(vllm) == 3.5, "a vLLM engine: the time inside its steps, not the idle layer pipeline's 0"


def test_sampler_keeps_answered_readings_and_skips_the_rest() -> None:
    answers = iter([{"a": 1, "b": 2}, None, {"a": 5, "b": 2}])
    sampler = CounterSampler("test", ["a", "b"], lambda: next(answers), interval_s=60.0, started=time.monotonic())
    for _ in range(3):
        sampler.sample()
    assert sampler.values == {"a": [1, 5], "b": [2, 2]}, "the unanswered reading is skipped, the others kept per key"
    assert len(sampler.t_s) == 2 and sampler.t_s[0] <= sampler.t_s[1], "one stamp per kept reading, in order"


def test_sampler_samples_on_entry_and_exit() -> None:
    count = iter(range(100))
    with CounterSampler("test", ["n"], lambda: {"n": next(count)}, interval_s=60.0, started=time.monotonic()) as s:
        pass
    assert s.values["n"] == [0, 1], "one reading as the timed phase starts and one as it ends"
