"""What `dualpath bench` samples while its timed phase runs: the readers' exact SNIC read counters
and the prefill engines' cumulative compute seconds, each read by a driver thread every
`interval_s` through the actors' control concurrency group (never queued behind I/O; a vLLM
engine answers between two of its steps, whose lock its figures take)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import ray

from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.telemetry.engine_stats import EngineStats

SAMPLE_TIMEOUT_S = 30.0

Value = TypeVar("Value", int, float)


class CounterSampler(Generic[Value]):
    """Samples `read` on a thread every interval_s from `with` entry (t = 0 at `started`) to exit
    (one sample each). A read that answers None (an actor too busy to answer in time) is skipped;
    the next one is exact again, since every value is cumulative."""

    def __init__(
        self, name: str, keys: Sequence[str], read: Callable[[], Mapping[str, Value] | None], interval_s: float,
        started: float,
    ) -> None:
        self.read = read
        self.interval_s = interval_s
        self.started = started
        self.t_s: list[float] = []
        self.values: dict[str, list[Value]] = {key: [] for key in keys}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-sampler", daemon=True)

    def sample(self) -> None:
        before = time.monotonic()
        values = self.read()
        if values is None:
            return
        # The values were read somewhere between the call and the answer: stamp the middle.
        self.t_s.append((before + time.monotonic()) / 2 - self.started)
        for key, series in self.values.items():
            series.append(values[key])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> CounterSampler[Value]:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def snic_reads(readers: Mapping[str, Any]) -> Callable[[], dict[str, int] | None]:
    """node -> the bytes its reader read through its SNIC so far (every path)."""

    def read() -> dict[str, int] | None:
        refs = [reader.counters.remote() for reader in readers.values()]
        try:
            counters: list[NodeCounters] = ray.get(refs, timeout=SAMPLE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None
        return {node: sum(counter.snic_read.values()) for node, counter in zip(readers, counters)}

    return read


def prefill_compute_s(stats: EngineStats[Any]) -> float:
    """A prefill engine's compute seconds so far: the time inside vLLM's steps where its compute
    reports them (`step_s`), else its layers' compute (PrefillStats.pipeline.compute_s)."""
    if "step_s" in stats.compute:
        return float(stats.compute["step_s"])
    return float(stats.core.pipeline.compute_s)


def prefill_compute_reads(engines: Mapping[str, Any]) -> Callable[[], dict[str, float] | None]:
    """prefill engine -> its compute seconds so far (prefill_compute_s)."""

    def read() -> dict[str, float] | None:
        refs = [engine.engine_stats.remote() for engine in engines.values()]
        try:
            stats: list[EngineStats[Any]] = ray.get(refs, timeout=SAMPLE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None
        return {name: prefill_compute_s(s) for name, s in zip(engines, stats)}

    return read
