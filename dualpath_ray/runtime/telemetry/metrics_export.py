"""Turning an actor's own figures into the Ray metrics of dualpath_ray/metrics.py.

Each actor already keeps exact running totals (NodeCounters, its core's stats, the scheduler's
call counts) and can report its load at any time. An exporter reads those on a background
thread every runtime.metrics_interval_s and hands them to Ray: totals become counter
increments of exactly the growth since the last read, so after a read a counter in Prometheus
equals the runtime's own total; loads become gauges. Only what exists nowhere else (a stage
call's duration, a scheduling decision's duration, a served turn's TTFT/TPOT) is observed
directly where it happens. With runtime.metrics off no thread starts and nothing is recorded.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from dualpath_ray.metrics import MetricSink, MetricSpec, Tags

LOG = logging.getLogger("dualpath_ray.metrics")


class CounterTotals:
    """Running totals to counter increments. A counter starts at zero in every process, so
    adding each total's growth since the last update keeps counter == total after every
    update (totals never shrink: the cores only ever add to them)."""

    def __init__(self, sink: MetricSink) -> None:
        self.sink = sink
        self._sent: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def update(self, spec: MetricSpec, total: float, tags: Tags) -> None:
        key = (spec.name, tuple(sorted(tags.items())))
        growth = total - self._sent.get(key, 0.0)
        if growth > 0:
            self.sink.inc(spec, growth, tags)
            self._sent[key] = total


class PeriodicExport:
    """Calls `collect` every `interval_s` on a daemon thread until closed; `close` collects once
    more, so what an actor counted before it stopped is exported too. A failing collect is
    logged (once per kind of error) and retried at the next tick: metrics never stop an actor."""

    def __init__(self, name: str, interval_s: float, collect: Callable[[], None]) -> None:
        self.name = name
        self.interval_s = interval_s
        self.collect = collect
        self.failures = 0
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # one collect at a time: the thread's and close()'s
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{name}", daemon=True)

    def start(self) -> PeriodicExport:
        self._thread.start()
        return self

    def flush(self) -> None:
        with self._lock:
            try:
                self.collect()
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                self.failures += 1
                if type(exc).__name__ not in self._logged:
                    self._logged.add(type(exc).__name__)
                    LOG.warning("%s: exporting metrics failed (%r); retrying every %.1fs", self.name, exc, self.interval_s)

    def close(self) -> None:
        self._stopped.set()
        self.flush()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.flush()
